"""The cost policy's options side by side on one backend, and the onnx drafter's deferred key/value rewrite.

``python -m kangaroo_apps.studies.gated_drafts --backend int8 --variants default,gate=false``

Each question's first turn is decoded by the target alone and by Kangaroo with each ``--variants`` entry (the cost
policy's options, ``KEY=VALUE`` joined by ``;``; ``default``: none), in turn, ``--repeats`` times; the median engine
seconds per question and engine give the ratios (× the target alone, per question, per subtask and overall, as
total seconds). Every engine shares one backend, and every output must equal the target alone's. Rounds, drafts,
dropped drafts and accepted drafts are from the last repeat. ``--backend int8`` is the 4-bit GGUF export with int8
activations on onnxruntime, ``torch`` the torch backend.

``--rewrite`` measures the cost curve's rounds (k = 0..3 drafts, and a round whose one draft is dropped) with the
onnx deep-context drafter rewriting verified slots at once (a whole graph run after every verify pass: before
2026-12-07) and deferred to its next run (now), alternating, three curves each; medians.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

from kangaroo_apps.cli_options import parse_key_values
from kangaroo_core.errors import UsageError


def parse_variant(text: str) -> dict:
    """``"gate=false;margin=0"`` → ``{"gate": False, "margin": 0}`` (as ``--policy-option`` parses each item)."""
    if text == "default":
        return {}
    try:
        return parse_key_values(text.split(";"), "--variants")
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from None


def _spec(backend: str, threads: int):
    from kangaroo_core.assembly import EngineSpec

    if backend == "int8":
        return EngineSpec(backend="onnx", backend_options=dict(weights="gguf", accuracy_level=4, threads=threads))
    return EngineSpec(backend="torch")


def compare(questions, backend: str, variants: list[str], repeats: int, threads: int, echo=print) -> dict:
    """Median engine seconds per question for the target alone and each variant; the outputs checked equal."""
    from kangaroo_core.engine import assemble

    spec = _spec(backend, threads)
    first = assemble(spec.replace(policy_options=parse_variant(variants[0])))
    engines = {"alone": assemble(spec.target_alone(), backend=first.backend), variants[0]: first}
    for variant in variants[1:]:
        engines[variant] = assemble(spec.replace(policy_options=parse_variant(variant)), backend=first.backend)
    for engine in engines.values():  # warm-up, not counted
        engine.generate("Hello there", max_new_tokens=16)
    rows = []
    for question in questions:
        ids = first.encode(question.turns[0])
        times, last = {name: [] for name in engines}, {}
        for _ in range(repeats):
            for name, engine in engines.items():
                result = engine.generate_ids(ids, 128)
                times[name].append(result.seconds)
                last[name] = result
        if any(r.token_ids != last["alone"].token_ids for r in last.values()):
            raise RuntimeError(f"question {question.question_id}: an output differs from the target alone's")
        row = {"subtask": question.subtask, "question_id": question.question_id,
               "tokens": len(last["alone"].token_ids),
               "seconds": {name: statistics.median(t) for name, t in times.items()},
               "rounds": {v: [len(last[v].rounds), sum(r.drafted for r in last[v].rounds),
                              sum(r.dropped for r in last[v].rounds), sum(r.accepted for r in last[v].rounds)]
                          for v in variants}}
        rows.append(row)
        echo(line(row, variants))
    return {"backend": backend, "threads": threads, "repeats": repeats, "variants": variants, "questions": rows}


def line(row: dict, variants: list[str]) -> str:
    s = row["seconds"]
    return (f"{row['subtask']} {row['question_id']} {row['tokens']} tokens | " + " | ".join(
        f"{v} x{s['alone'] / s[v]:.2f} (rounds {r[0]}, drafted {r[1]}, dropped {r[2]}, accepted {r[3]})"
        for v, r in ((v, row["rounds"][v]) for v in variants)))


def summary(data: dict) -> str:
    """Per subtask and overall: total target-alone seconds / total variant seconds."""
    variants, out = data["variants"], []
    groups: dict[str, list[dict]] = {}
    for row in data["questions"]:
        groups.setdefault(row["subtask"], []).append(row)
    for name, rows in [*groups.items(), ("overall", data["questions"])]:
        alone = sum(r["seconds"]["alone"] for r in rows)
        out.append(f"{name}: " + " | ".join(f"{v} x{alone / sum(r['seconds'][v] for r in rows):.3f}" for v in variants))
    return "\n".join(out)


def rewrite_curves(threads: int, curves: int = 3) -> dict:
    """Round costs with the onnx deep-context drafter's rewrite at once vs deferred (medians of ``curves`` each)."""
    import torch

    from kangaroo_core.engine import assemble
    from kangaroo_plugins.kangaroo import runners
    from kangaroo_policies.cost_model import measure_costs

    torch.set_num_threads(threads)
    engine = assemble(_spec("int8", threads).replace(policy="threshold"))
    deferred = runners.DeepContextOnnxRunner.observe_deep

    def at_once(self, start, deep):
        deferred(self, start, deep)
        self.catch_up()

    measured = {"at once": [], "deferred": []}
    try:
        for _ in range(curves):
            for name, method in (("at once", at_once), ("deferred", deferred)):
                runners.DeepContextOnnxRunner.observe_deep = method
                curve = measure_costs(engine.backend, engine.drafter, context=300, positions=(1,), repeats=9, rounds=3)
                measured[name].append([*curve.round_ms, curve.dropped_round_ms])
    finally:
        runners.DeepContextOnnxRunner.observe_deep = deferred
    return {name: [statistics.median(c[i] for c in rows) for i in range(5)] for name, rows in measured.items()}


@click.command()
@click.option("--questions", default=None, help="Spec-Bench JSONL (default: the dev questions).")
@click.option("--subtasks", default="mt_bench,translation,summarization,qa,math_reasoning,rag", show_default=True)
@click.option("--per-subtask", type=int, default=None, help="Only the first K questions of each subtask.")
@click.option("--backend", type=click.Choice(["int8", "torch"]), default="int8", show_default=True)
@click.option("--variants", default="default,gate=false", show_default=True,
              help="Comma-separated cost-policy option sets (KEY=VALUE joined by ';', or 'default').")
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--rewrite", is_flag=True, help="Time the onnx drafter's key/value rewrite at once vs deferred instead.")
@click.option("--out", default="gated-drafts.json", show_default=True)
def main(questions, subtasks, per_subtask, backend, variants, repeats, threads, rewrite, out):
    import torch

    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_data import dev_questions

    torch.set_num_threads(threads)
    if rewrite:
        data = rewrite_curves(threads)
        for name, ms in data.items():
            click.echo(f"{name}: round ms k=0..3 " + " ".join(f"{v:.2f}" for v in ms[:4]) + " | × plain "
                       + " ".join(f"{v / ms[0]:.2f}" for v in ms[:4]) + f" | dropped {ms[4]:.2f} ({ms[4] / ms[0]:.2f})")
    else:
        names = [v.strip() for v in variants.split(",")]
        for name in names:  # a typo costs no model load
            parse_variant(name)
        wanted = subtasks.split(",")
        chosen, counts = [], {}
        for q in load_questions(questions or dev_questions()):
            counts[q.subtask] = counts.get(q.subtask, 0) + 1
            if q.subtask in wanted and (per_subtask is None or counts[q.subtask] <= per_subtask):
                chosen.append(q)
        data = compare(chosen, backend, names, repeats, threads, echo=click.echo)
        click.echo(summary(data))
    Path(out).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
