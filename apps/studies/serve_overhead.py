"""What the server adds to a request: the same prompts through ``Engine.generate`` and through the HTTP API
(``openai`` client, non-streaming and streaming), interleaved prompt by prompt with the order alternating, wall time
on both sides.

    python -m kangaroo_apps.studies.serve_overhead --limit 12 --repeats 2 --max-new-tokens 64 -- --threads 2

By default the server runs in this process on the *same engine object* (uvicorn on a thread), so the comparison
isolates the server's own work (HTTP, JSON, the queue, the engine thread, detokenising per round) from machine
noise between two processes; ``--subprocess`` starts ``kangaroo serve`` with the same flags instead (what a
deployment runs). Arguments after ``--`` are engine flags (``kangaroo serve`` takes them as ``generate`` does). Only
one side decodes at a time. Greedy: the texts must be equal, which the report checks.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import click

from kangaroo_apps.cli_options import SHIPPED_QUESTIONS


def wait_healthy(url: str, process, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kangaroo serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("kangaroo serve did not become healthy")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--questions", **SHIPPED_QUESTIONS)
@click.option("--limit", type=int, default=12, show_default=True, help="Prompts (first turns) to send.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=1, show_default=True, help="Send every prompt this many times.")
@click.option("--subprocess", "use_subprocess", is_flag=True,
              help="Serve from a `kangaroo serve` subprocess instead of this process's engine.")
@click.option("--port", type=int, default=0, help="Port for the server (default: a free one).")
@click.option("--out", default=None, help="Also write the report as JSON here.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
def main(questions, limit, repeats, use_subprocess, max_new_tokens, port, out, engine_args) -> None:
    import httpx
    import openai
    from tqdm import tqdm

    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_apps.serve.local import free_port

    from kangaroo_apps.serve.app import create_app
    from kangaroo_apps.serve.local import LocalServer

    prompts = [q.turns[0] for q in load_questions(questions)][:limit] * repeats
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    server = in_process = None
    if use_subprocess:
        server = subprocess.Popen([sys.executable, "-m", "kangaroo_apps.cli", "serve", "--port", str(port),
                                   "--log-level", "warning", "--max-new-tokens", str(max_new_tokens), *engine_args])
    try:
        # this side: the same flags, parsed by the same command line, into an engine
        engine = EngineOptions.from_args(["--max-new-tokens", str(max_new_tokens), *engine_args]).engine()
        engine.generate("Hello", max_new_tokens=4)
        if use_subprocess:
            wait_healthy(url, server)
        else:
            in_process = LocalServer(create_app(engine), port=port).__enter__()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        rows = []
        def via_engine(prompt):
            began = time.perf_counter()
            result = engine.generate(prompt, max_new_tokens=max_new_tokens)
            return result, time.perf_counter() - began

        def via_api(prompt):
            began = time.perf_counter()
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=max_new_tokens)
            api_s = time.perf_counter() - began
            began = time.perf_counter()
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_new_tokens,
                stream=True) if c.choices)
            return reply, api_s, streamed, time.perf_counter() - began

        rows = []
        for i, prompt in enumerate(tqdm(prompts, desc="engine vs API", unit="prompt", file=sys.stderr)):
            if i % 2 == 0:  # alternate which side goes first: no order effect in the ratio
                (local, local_s), (reply, api_s, streamed, stream_s) = via_engine(prompt), via_api(prompt)
            else:
                (reply, api_s, streamed, stream_s), (local, local_s) = via_api(prompt), via_engine(prompt)
            rows.append({"engine_s": local_s, "engine_own_s": local.seconds, "api_s": api_s, "stream_s": stream_s,
                         "server_engine_s": reply.model_extra["kangaroo"]["engine_seconds"],
                         "tokens": local.new_tokens, "identical": reply.choices[0].message.content == local.text
                         and streamed == local.text})
        total = {k: sum(r[k] for r in rows) for k in ("engine_s", "api_s", "stream_s", "server_engine_s", "engine_own_s")}
        report = {
            "prompts": len(rows), "max_new_tokens": max_new_tokens, "engine_args": list(engine_args),
            "server": "subprocess" if use_subprocess else "in-process, same engine",
            "all_identical": all(r["identical"] for r in rows), **{k: round(v, 3) for k, v in total.items()},
            "api_overhead": round(total["api_s"] / total["engine_s"] - 1, 4),
            "stream_overhead": round(total["stream_s"] / total["engine_s"] - 1, 4),
            "median_api_ratio": round(statistics.median(r["api_s"] / r["engine_s"] for r in rows), 4),
            "median_stream_ratio": round(statistics.median(r["stream_s"] / r["engine_s"] for r in rows), 4),
            "http_share": round((total["api_s"] - total["server_engine_s"]) / total["api_s"], 4),
            "rows": rows,
        }
        click.echo(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
        if out:
            with open(out, "w") as handle:
                handle.write(json.dumps(report, indent=2) + "\n")
        httpx.get(url + "/health", timeout=5)
    finally:
        if in_process is not None:
            in_process.__exit__(None, None, None)
        if server is not None:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
