"""How the cost policy prices a round in a batch, side by side in one process: all streams drafting together, the
others waiting, and the batched target alone.

``python -m kangaroo_apps.studies.batch_pricing --streams 2,4,8`` (results in ``--out``, default batch-pricing.json)

For each stream count, three engines decode the same questions' first turns as one batch, greedy, in the order
A B C C B A: the target alone, the cost policy with ``batch=wait`` (a stream prices its drafts as if the other
streams drafted nothing and waited for its draft steps: the earlier model) and with ``batch=together`` (every stream
drafting k, each draft step the batch's merged one: the default). Every stream's tokens must be the same in all six
runs. Aggregate tokens/s is all new tokens over the batch's wall time (prefills included); CR is new tokens per
verify pass.
"""

from __future__ import annotations

import click

from kangaroo_apps.studies.merged_drafts import run, write

ORDER = ("target_alone", "wait", "together", "together", "wait", "target_alone")


@click.command()
@click.option("--streams", default="2,4,8", show_default=True, help="Stream counts, comma-separated.")
@click.option("--limit-per-subtask", default=2, show_default=True, help="Dev questions per subtask.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default="batch-pricing.json", show_default=True,
              help="Results file (JSON).")
def main(streams: str, limit_per_subtask: int, max_new_tokens: int, threads: int, out: str) -> None:
    from pathlib import Path

    import torch

    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_data import dev_questions

    torch.set_num_threads(threads)
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    engines = {"target_alone": Engine.build(drafter=None, config=config),
               **{name: Engine.build(policy="cost", config=config, policy_options={"batch": name})
                  for name in ("wait", "together")}}
    prompts = [engines["together"].encode(q.turns[0]) for q in load_questions(dev_questions(), limit_per_subtask)]
    for engine in engines.values():
        engine.generate_many(prompts[:2], max_batch=2, max_new_tokens=16)  # warm-up, not measured
    rows = []
    for n in (int(s) for s in streams.split(",")):
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for name in ORDER:
            runs[name].append(run(engines[name], prompts, n, max_new_tokens))
        speed = {name: sum(r["tokens_per_second"] for r in rs) / len(rs) for name, rs in runs.items()}
        ids = [r["token_ids"] for rs in runs.values() for r in rs]
        row = {"streams": n, **{f"{name}_tokens_per_second": v for name, v in speed.items()},
               **{f"{name}_over_target_alone": speed[name] / speed["target_alone"] for name in ("wait", "together")},
               **{f"{name}_cr": runs[name][0]["cr"] for name in ("wait", "together")},
               "each_run_tokens_per_second": {k: [r["tokens_per_second"] for r in rs] for k, rs in runs.items()},
               "identical": all(i == ids[0] for i in ids)}
        rows.append(row)
        click.echo(f"{n} streams: target alone {speed['target_alone']:.1f} tok/s, wait "
                   f"{row['wait_over_target_alone']:.3f}x (CR {row['wait_cr']:.2f}), together "
                   f"{row['together_over_target_alone']:.3f}x (CR {row['together_cr']:.2f}), identical "
                   f"{row['identical']}", err=True)
    write(Path(out), {"rows": rows}, questions=len(prompts), max_new_tokens=max_new_tokens, threads=threads)


if __name__ == "__main__":
    main()
