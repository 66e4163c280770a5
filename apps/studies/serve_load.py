"""A bounded load test of a running ``kangaroo serve``, and the checks that make it a test.

``clients`` threads each send ``requests`` streaming chat requests (even (client + request): greedy; odd: sampled at
temperature 0.8 with a seed of their own) through the ``openai`` client. A 429 or 503 (the designed answer of a full
queue) is counted and retried after the server's Retry-After. Afterwards every distinct request is sent again alone,
one at a time, and the report says whether

* every response arrived whole (a finish reason, the stream closed normally),
* every greedy response equals its single-client run, and every seeded response its rerun with the same seed,
* nothing failed but the designed 429/503,
* ``/health`` still answers ok.

    python -m kangaroo_apps.studies.serve_load --url http://127.0.0.1:8000 --clients 16 --requests 4

Two servers compared (``kangaroo serve --threads 2`` vs ``kangaroo serve --replicas 2 --threads 1``, docs/scaling.md):
``--answers-out FILE`` keeps one run's answers, ``--compare-answers FILE`` counts the answers of another run that are
identical to them (same prompts, clients and requests).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import attrs
import click

from kangaroo_apps.cli_options import SHIPPED_QUESTIONS


@attrs.frozen
class Spec:
    """One request of the load: which client sent it, its prompt and its sampling."""

    client: int
    index: int
    prompt: str
    temperature: float
    seed: int | None


@attrs.define
class Outcome:
    text: str = ""
    finish: str | None = None
    whole: bool = False
    retries: int = 0
    error: str | None = None
    seconds: float = 0.0
    tokens: int = 0
    first_token: float | None = None  # seconds from sending to the first text


def plan(prompts: list[str], clients: int, requests: int, greedy: bool = False) -> list[Spec]:
    specs = []
    for client in range(clients):
        for index in range(requests):
            sampled = (client + index) % 2 == 1 and not greedy
            prompt = prompts[(client * requests + index) % len(prompts)]
            specs.append(Spec(client, index, prompt, 0.8 if sampled else 0.0, 1000 * client + index if sampled else None))
    return specs


def send(client, model: str, spec: Spec, max_tokens: int, max_retries: int = 120) -> Outcome:
    """One streaming request; a 429/503 is retried (counted) after the server's Retry-After."""
    import openai

    outcome = Outcome()
    started = time.perf_counter()
    while True:
        try:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": spec.prompt}], max_tokens=max_tokens,
                temperature=spec.temperature, seed=spec.seed, stream=True, stream_options={"include_usage": True})
            pieces = []
            for chunk in stream:
                if chunk.usage is not None:
                    outcome.tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    if chunk.choices[0].delta.content and outcome.first_token is None:
                        outcome.first_token = time.perf_counter() - started
                    pieces.append(chunk.choices[0].delta.content or "")
                    outcome.finish = chunk.choices[0].finish_reason or outcome.finish
            outcome.text, outcome.whole = "".join(pieces), outcome.finish is not None
            break
        except (openai.RateLimitError, openai.InternalServerError) as exc:
            status = getattr(exc, "status_code", None)
            if status not in (429, 503) or outcome.retries >= max_retries:
                outcome.error = f"{type(exc).__name__}: {exc}"
                break
            outcome.retries += 1
            time.sleep(float(exc.response.headers.get("retry-after", "1")))
        except Exception as exc:  # anything else is a failure of the server under load
            outcome.error = f"{type(exc).__name__}: {exc}"
            break
    outcome.seconds = time.perf_counter() - started
    return outcome


def answer_key(spec: Spec) -> str:
    return f"{spec.client}-{spec.index}"


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def run_load(url: str, prompts: list[str], *, clients: int = 16, requests: int = 4, max_tokens: int = 48,
             progress=None, greedy: bool = False, reference: dict[str, str] | None = None) -> dict:
    """Run the load and the checks; returns the report (see the module docstring). ``reference``: another run's
    ``answers`` (by :func:`answer_key`) to count identical answers against."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    specs = plan(prompts, clients, requests, greedy)
    outcomes: dict[Spec, Outcome] = {}
    lock = threading.Lock()

    def one_client(number: int) -> None:
        for spec in (s for s in specs if s.client == number):
            result = send(client, model, spec, max_tokens)
            with lock:
                outcomes[spec] = result
                if progress:
                    progress(1)

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one_client, range(clients)))
    load_seconds = time.perf_counter() - began

    # the references: every distinct request alone, one at a time
    alone: dict[tuple, Outcome] = {}
    for spec in specs:
        key = (spec.prompt, spec.temperature, spec.seed)
        if key not in alone:
            alone[key] = send(client, model, spec, max_tokens)
            if progress:
                progress(1)
    greedy = [s for s in specs if s.seed is None]
    seeded = [s for s in specs if s.seed is not None]
    same = lambda s: outcomes[s].text == alone[(s.prompt, s.temperature, s.seed)].text  # noqa: E731
    errors = [f"client {s.client} request {s.index}: {o.error}" for s, o in outcomes.items() if o.error]
    health = httpx.get(url.rstrip("/") + "/health", timeout=30)
    return {
        "url": url, "model": model, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
        "responses": len(outcomes), "whole": sum(o.whole for o in outcomes.values()),
        "greedy": len(greedy), "greedy_identical_to_single_client": sum(map(same, greedy)),
        "seeded": len(seeded), "seeded_reproduced": sum(map(same, seeded)),
        "retried_429_or_503": sum(o.retries for o in outcomes.values()),
        "requests_that_waited_for_a_retry": sum(o.retries > 0 for o in outcomes.values()),
        "errors": errors, "finish_reasons": dict(Counter(o.finish for o in outcomes.values())),
        "load_seconds": round(load_seconds, 2),
        "new_tokens_per_second_under_load": round(sum(o.tokens for o in outcomes.values()) / load_seconds, 2),
        "first_token_seconds": sorted(round(o.first_token, 2) for o in outcomes.values() if o.first_token is not None),
        "first_token_seconds_median": _quantile([o.first_token for o in outcomes.values()
                                                 if o.first_token is not None], 0.5),
        "request_seconds_median": _quantile([o.seconds for o in outcomes.values()], 0.5),
        "request_seconds_p90": _quantile([o.seconds for o in outcomes.values()], 0.9),
        "health_after": health.status_code == 200 and health.json().get("status") == "ok",
        **({} if reference is None else {
            "identical_to_reference": sum(reference.get(answer_key(s)) == o.text for s, o in outcomes.items()
                                          if not o.error)}),
        "answers": {answer_key(s): o.text for s, o in sorted(outcomes.items(), key=lambda i: (i[0].client, i[0].index))},
    }


def passed(report: dict) -> bool:
    return (report["whole"] == report["responses"] and not report["errors"] and report["health_after"]
            and report["greedy_identical_to_single_client"] == report["greedy"]
            and report["seeded_reproduced"] == report["seeded"])


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--questions", **SHIPPED_QUESTIONS,
              help="Prompts: the first turn of each question of this Spec-Bench file.")
@click.option("--clients", type=int, default=16, show_default=True)
@click.option("--requests", type=int, default=4, show_default=True, help="Requests per client.")
@click.option("--max-tokens", type=int, default=48, show_default=True)
@click.option("--greedy", is_flag=True, help="Every request greedy (default: every other one sampled, seeded).")
@click.option("--out", default=None, help="Also write the report as JSON here.")
@click.option("--answers-out", default=None, help="Write this run's answers as JSON here (for --compare-answers).")
@click.option("--compare-answers", default=None,
              help="Count the answers identical to another run's (its --answers-out file); every one must be.")
def main(url, questions, clients, requests, max_tokens, greedy, out, answers_out, compare_answers) -> None:
    """Load-test a running kangaroo server; exit 1 unless every check passes."""
    from tqdm import tqdm

    from kangaroo_apps.bench.questions import load_questions

    prompts = [q.turns[0] for q in load_questions(questions)]
    total = clients * requests
    distinct = {(p.prompt, p.temperature, p.seed) for p in plan(prompts, clients, requests, greedy)}
    with tqdm(total=total + len(distinct), desc="load + single-client reruns", unit="req", file=sys.stderr) as bar:
        reference = None
        if compare_answers:
            with open(compare_answers) as handle:
                reference = json.load(handle)
        report = run_load(url, prompts, clients=clients, requests=requests, max_tokens=max_tokens,
                          progress=bar.update, greedy=greedy, reference=reference)
    answers = report.pop("answers")
    if answers_out:
        with open(answers_out, "w") as handle:
            json.dump(answers, handle, indent=1)
    text = json.dumps(report, indent=2)
    click.echo(text)
    if out:
        with open(out, "w") as handle:
            handle.write(text + "\n")
    same = reference is None or report["identical_to_reference"] == report["responses"]
    sys.exit(0 if passed(report) and same else 1)


if __name__ == "__main__":
    main()
