"""The corpus on Ray next to the in-process build: the same prompts and settings, answers compared shard by shard,
throughput side by side, and the wall time to start a local Ray instance (docs/scaling.md, "Measured here").

    python -m kangaroo_apps.studies.corpus_ray --count 16 --shard-size 8 --workers 2 --threads-per-worker 1 \\
        --threads 2 --out corpus-ray.json

The in-process build runs in this process at ``--threads`` torch threads; the Ray build on a local instance of
``--workers`` x ``--threads-per-worker`` CPUs started here (its start timed). Model loads are timed apart from
answering: the throughput compared is answer tokens per second of answering (both builds answer the same shards
with the same batch size), and end to end (start, loads and answering).
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import click

from kangaroo_apps.cli_options import SHIPPED_PROMPTS


def _first_prompts(source: Path, count: int, target: Path) -> Path:
    """The first ``count`` usable prompts of ``source``, as a prompts file of their own."""
    from kangaroo_tools.prompts import read_prompts

    keep = {p.id for p in read_prompts(source, warn=lambda _m: None)[:count]}
    lines = []
    for raw in source.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and str(item.get("id")) in keep:
            lines.append(raw)
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


def _records(directory: Path) -> dict:
    from kangaroo_tools.corpus import Corpus, read_shard

    return {name: read_shard(directory / name) for name in Corpus(directory).manifest()["shards"]}


def in_process(model, prompts: Path, settings, directory: Path, threads: int, batch_size: int) -> dict:
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_tools.corpus import Corpus, build

    began = time.perf_counter()
    engine = EngineOptions(model=model, threads=threads).engine(vanilla=True)
    loaded = time.perf_counter()
    summary = build(Corpus(directory), engine, prompts, settings, batch_size=batch_size, progress=False,
                    log=lambda m: print(m, file=sys.stderr))
    done = time.perf_counter()
    tokens = summary["heldout"]["answer_tokens"] + summary["train"]["answer_tokens"]
    return {"threads": threads, "load_seconds": round(loaded - began, 2), "answer_seconds": round(done - loaded, 2),
            "answer_tokens": tokens, "answer_tokens_per_second": round(tokens / (done - loaded), 2),
            "end_to_end_seconds": round(done - began, 2)}


def on_ray(model, prompts: Path, settings, directory: Path, workers: int, threads: int, batch_size: int) -> dict:
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_apps.ray_launch import engine_of, portable
    from kangaroo_tools.corpus import Corpus
    from kangaroo_tools.corpus_ray import build_on_ray
    from kangaroo_tools.ray_cluster import ray_session

    began = time.perf_counter()
    with ray_session("local", num_cpus=workers * threads) as session:
        make_engine = functools.partial(engine_of, portable(EngineOptions(model=model), threads), True)
        summary = build_on_ray(Corpus(directory), make_engine, prompts, settings, workers=workers, threads=threads,
                               batch_size=batch_size, progress=False, log=lambda m: print(m, file=sys.stderr))
        done = time.perf_counter()
    ray = summary["ray"]
    tokens = summary["heldout"]["answer_tokens"] + summary["train"]["answer_tokens"]
    return {"workers": workers, "threads_per_worker": threads, "ray_start_seconds": round(session.seconds, 2),
            "load_seconds": ray["load_seconds"], "answer_seconds": ray["answer_seconds"], "answer_tokens": tokens,
            "answer_tokens_per_second": round(tokens / ray["answer_seconds"], 2),
            "end_to_end_seconds": round(done - began, 2), "shards_redone": ray["shards_redone"]}


@click.command()
@click.option("--prompts", "prompts_file", **SHIPPED_PROMPTS,
              help="Training prompts (never Spec-Bench); the first --count usable ones are answered.")
@click.option("--count", type=int, default=16, show_default=True)
@click.option("--model", default=None, help="As for `kangaroo corpus build` (default: SmolLM2-135M-Instruct).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--heldout-prompts", type=int, default=0, show_default=True,
              help="Held-out prompts (answered one at a time by the engine); 0: training shards only.")
@click.option("--shard-size", type=int, default=8, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="The in-process build's torch threads.")
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--threads-per-worker", type=int, default=1, show_default=True)
@click.option("--ray-first", is_flag=True, help="Run the Ray build first (alternate between runs on a busy machine).")
@click.option("--out", default=None, help="Also write the report as JSON here.")
def main(prompts_file, count, model, max_new_tokens, heldout_prompts, shard_size, batch_size, threads, workers,
         threads_per_worker, ray_first, out) -> None:
    """Build the same small corpus in process and on Ray; exit 1 unless every answer is identical."""
    from kangaroo_tools.corpus import CorpusSettings

    settings = CorpusSettings(max_new_tokens=max_new_tokens, heldout_prompts=heldout_prompts, shard_size=shard_size)
    with tempfile.TemporaryDirectory(prefix="kangaroo-corpus-ray-") as tmp:
        root = Path(tmp)
        prompts = _first_prompts(Path(prompts_file), count, root / "prompts.jsonl")
        runs = {}
        for which in (("ray", "in_process") if ray_first else ("in_process", "ray")):
            print(f"[{which}] building ...", file=sys.stderr)
            if which == "ray":
                runs[which] = on_ray(model, prompts, settings, root / which, workers, threads_per_worker, batch_size)
            else:
                runs[which] = in_process(model, prompts, settings, root / which, threads, batch_size)
        a, b = _records(root / "in_process"), _records(root / "ray")
        pairs = [(x, y) for name in a for x, y in zip(a[name], b.get(name, []))]
        report = {
            "prompts": count, "settings": settings.to_dict(), "batch_size": batch_size, **runs,
            "shards": len(a), "identical_shards": sum(a[n] == b.get(n) for n in a),
            "answers": sum(len(a[n]) for n in a), "identical_answers": sum(x == y for x, y in pairs),
            "throughput_ratio_answering": round(runs["ray"]["answer_tokens_per_second"]
                                                / runs["in_process"]["answer_tokens_per_second"], 3),
            "throughput_ratio_end_to_end": round(runs["in_process"]["end_to_end_seconds"]
                                                 / runs["ray"]["end_to_end_seconds"], 3),
        }
    text = json.dumps(report, indent=2)
    click.echo(text)
    if out:
        Path(out).write_text(text + "\n")
    sys.exit(0 if report["identical_shards"] == report["shards"] == len(b) else 1)


if __name__ == "__main__":
    main()
