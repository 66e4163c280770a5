"""Merged draft steps against the same steps taken one by one, side by side in one process.

``python -m kangaroo_apps.studies.merged_drafts --streams 2,4,8`` (results in ``--out``, default merged-drafts.json)

For each policy and stream count, one engine whose batches run their drafting streams' steps as one pass (the
default) and one built with the drafter option ``merge_steps=false`` (each stream's step on its own, inside the same
draft pass) decode the same questions' first turns, alternating A B B A, greedy. Both drafters are the same
row-exact network, so the comparison isolates the merging; every stream's tokens must be the same in all four runs.
Aggregate tokens/s is all new tokens over the batch's wall time (prefills included).

``--single-stream`` measures what the row-exact drafter costs one stream: the default engine with its drafter's
network on the small-batch kernel (as shipped) against the same network on plain ``nn.Linear`` layers, and the
target alone, per question A B C C B A (total engine seconds each; tokens compared).

``--step-only`` times the draft step itself instead: S forks of the default drafter's runner, each after the same
300-position context, one step of one row each — merged (``advance_many``) against one after another (median of
200 repeats each).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

VARIANTS = {"merged": True, "one_by_one": False}


def run(engine, prompts: list[list[int]], streams: int, max_new_tokens: int) -> dict:
    batch = engine.batch(streams)
    start = time.perf_counter()
    results = batch.generate(prompts, max_new_tokens=max_new_tokens)
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    return {"tokens_per_second": tokens / wall, "draft_passes": batch.kinds["draft"],
            "cr": tokens / max(1, sum(r.num_rounds for r in results)), "token_ids": [r.token_ids for r in results]}


def step_times(engine, sizes, repeats: int = 200) -> list[dict]:
    """Median milliseconds of one draft step for S streams: merged, and one stream after another."""
    import statistics

    runner, backend = engine.drafter.adapter.runner, engine.backend
    backend.reset()  # measuring a cost curve at build time leaves positions in the backend's cache
    ids = list(range(100, 400))
    hidden = backend.shallow(ids, 0)
    deep = backend.deep(hidden, 0, rows=[len(ids) - 1]).hidden

    def ready():
        fork = runner.fork()
        fork.observe_deep(0, deep)
        fork.advance(hidden, 0)
        return fork

    def median_ms(step) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    rows, last = [], hidden[-1:]
    for size in sizes:
        forks = [ready() for _ in range(size)]

        def merged():
            for fork in forks:
                fork.crop(len(ids))
            runner.advance_many([(fork, last, len(ids)) for fork in forks])

        def one_by_one():
            for fork in forks:
                fork.crop(len(ids))
                fork.advance(last, len(ids))

        rows.append({"streams": size, "merged_ms": median_ms(merged), "one_by_one_ms": median_ms(one_by_one)})
        click.echo(f"draft step, {size} streams: merged {rows[-1]['merged_ms']:.2f} ms, one by one "
                   f"{rows[-1]['one_by_one_ms']:.2f} ms", err=True)
    return rows


def single_stream_seconds(engine, target, prompts) -> dict:
    """Engine seconds over ``prompts`` of the shipped drafter, the same drafter on plain linears, and the target."""
    from kangaroo_plugins.kangaroo.runners import DeepContextTorchRunner

    runner = engine.drafter.adapter.runner
    shipped = runner.adapter, runner.head, runner.kernel
    plain = DeepContextTorchRunner(engine.drafter.adapter.adapter, engine.backend.shared_head())
    variants = {"row_kernel": shipped, "plain_linears": (plain.adapter, plain.head, None)}
    seconds = {"row_kernel": 0.0, "plain_linears": 0.0, "target_alone": 0.0}
    ids: dict[str, list] = {name: [] for name in seconds}
    try:
        for prompt in prompts:
            for name in ("row_kernel", "plain_linears", "target_alone", "target_alone", "plain_linears", "row_kernel"):
                if name == "target_alone":
                    result = target.generate_ids(prompt)
                else:
                    runner.adapter, runner.head, runner.kernel = variants[name]
                    result = engine.generate_ids(prompt)
                seconds[name] += result.seconds
                ids[name].append(result.token_ids)
    finally:
        runner.adapter, runner.head, runner.kernel = shipped
    return {"seconds": seconds, "row_kernel_over_plain_time": seconds["row_kernel"] / seconds["plain_linears"],
            "identical": ids["row_kernel"] == ids["plain_linears"] == ids["target_alone"]}


def write(out: Path, results: dict, **info) -> None:
    """The results file: the command, the CPU and the run's settings, then ``results``."""
    from kangaroo_core.machine import cpu_line

    info = {"command": "python -m kangaroo_apps.studies.merged_drafts " + " ".join(sys.argv[1:]), "cpu": cpu_line(),
            **info}
    out.write_text(json.dumps({"info": info, **results}, indent=1) + "\n")
    click.echo(f"wrote {out}", err=True)


@click.command()
@click.option("--streams", default="2,4,8", show_default=True, help="Stream counts, comma-separated.")
@click.option("--policies", default="threshold,cost", show_default=True, help="Stopping policies, comma-separated.")
@click.option("--limit-per-subtask", default=2, show_default=True, help="Dev questions per subtask.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("merged-drafts.json"),
              show_default=True, help="Results file (JSON).")
@click.option("--step-only", is_flag=True, help="Time one draft step for 1 and each stream count instead.")
@click.option("--single-stream", is_flag=True, help="Compare the row-exact drafter with plain linears, one stream.")
def main(streams: str, policies: str, limit_per_subtask: int, max_new_tokens: int, threads: int, out: Path,
         step_only: bool, single_stream: bool) -> None:
    import torch

    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_data import dev_questions

    torch.set_num_threads(threads)
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    if step_only:
        with torch.inference_mode():
            rows = step_times(Engine.build(config=config), [1, *(int(s) for s in streams.split(","))])
        return write(out, {"steps": rows}, threads=threads)
    if single_stream:
        questions = load_questions(dev_questions(), limit_per_subtask)
        report = {}
        for policy in policies.split(","):
            engine = Engine.build(policy=policy, config=config)
            target = Engine.build(drafter=None, config=config)
            prompts = [engine.encode(q.turns[0]) for q in questions]
            report[policy] = single_stream_times = single_stream_seconds(engine, target, prompts)
            click.echo(f"{policy}: row kernel / plain linears time {single_stream_times['row_kernel_over_plain_time']:.3f}, "
                       f"identical {single_stream_times['identical']}", err=True)
        return write(out, {"single_stream": report}, questions=len(questions), max_new_tokens=max_new_tokens,
                     threads=threads)
    rows = []
    for policy in policies.split(","):
        engines = {name: Engine.build(policy=policy, config=config, drafter_options={"merge_steps": merge})
                   for name, merge in VARIANTS.items()}
        first = engines["merged"]
        prompts = [first.encode(q.turns[0]) for q in load_questions(dev_questions(), limit_per_subtask)]
        for engine in engines.values():
            engine.generate_many(prompts[:2], max_batch=2, max_new_tokens=16)  # warm-up, not measured
        for n in (int(s) for s in streams.split(",")):
            runs = {name: [] for name in VARIANTS}
            for name in ("merged", "one_by_one", "one_by_one", "merged"):
                runs[name].append(run(engines[name], prompts, n, max_new_tokens))
            speeds = {name: sum(r["tokens_per_second"] for r in rs) / len(rs) for name, rs in runs.items()}
            ids = [r["token_ids"] for rs in runs.values() for r in rs]
            row = {"policy": policy, "streams": n, **{f"{k}_tokens_per_second": v for k, v in speeds.items()},
                   "merged_over_one_by_one": speeds["merged"] / speeds["one_by_one"],
                   "each_run_tokens_per_second": {k: [r["tokens_per_second"] for r in rs] for k, rs in runs.items()},
                   "draft_passes": runs["merged"][0]["draft_passes"], "identical": all(i == ids[0] for i in ids)}
            rows.append(row)
            click.echo(f"{policy:>9} {n} streams: merged {speeds['merged']:.1f} tok/s, one by one "
                       f"{speeds['one_by_one']:.1f} tok/s ({row['merged_over_one_by_one']:.3f}x), identical "
                       f"{row['identical']}", err=True)
    write(out, {"rows": rows}, questions=len(prompts), max_new_tokens=max_new_tokens, threads=threads)


if __name__ == "__main__":
    main()
