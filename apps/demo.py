"""``kangaroo demo``: the first minute. Kangaroo next to transformers' greedy ``generate`` and next to the same
engine's target alone, on one dev question of each kind (or on your prompt), with the identity check and CR.

It is a small bench run (:mod:`kangaroo_apps.bench.harness`: the model loaded once, a warm-up, the methods
interleaved question by question) printed as one table instead of written to files.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kangaroo_apps.bench.harness import MethodSpec, build_methods, run_bench, summarize
from kangaroo_apps.bench.questions import Question, load_questions
from kangaroo_core.bench_context import BenchContext

#: the bench methods shown: transformers' greedy generate (the identity reference), the engine's target alone, Kangaroo
METHODS = ("hf_vanilla", "vanilla", "kangaroo")


def demo_questions(path: str, prompt: str | None = None) -> list[Question]:
    """Your prompt as one question, else the first question of every subtask in ``path`` (first turn only)."""
    if prompt is not None:
        return [Question("prompt", "your prompt", (prompt,))]
    return [attrs.evolve(q, turns=q.turns[:1]) for q in load_questions(path, limit_per_subtask=1)]


def run_demo(opts, questions: Sequence[Question], *, progress: bool = True) -> dict:
    """Load the engine the flags describe once and measure the three methods; returns the bench summary."""
    backend = opts.backend()
    context = BenchContext(backend, opts.spec())
    specs = [MethodSpec(name, name) for name in METHODS]
    run = run_bench(context, build_methods(specs, context), questions, max_new_tokens=opts.max_new_tokens,
                    progress=progress)
    summary = summarize(run)
    summary["model"], summary["subtasks"] = backend.model_name, run.subtasks
    return summary


def demo_table(summary: dict) -> str:
    """One row per subtask and one overall: tokens/s of each method, Kangaroo's speedups, CR, identity."""
    methods = summary["methods"]
    failed = [f"{label}: {entry['error']}" for label, entry in methods.items() if entry["error"]]
    if failed:
        return "demo: " + "; ".join(failed)
    header = ("| kind | generate tok/s | target alone tok/s | kangaroo tok/s | × generate | × target alone | CR | "
              "identical |")
    lines = [header, "|" + "---|" * 8]
    for key in [*summary["subtasks"], "overall"]:
        row = {name: (methods[name]["overall"] if key == "overall" else methods[name]["per_subtask"][key])
               for name in METHODS}
        mine, alone, hf = row["kangaroo"], row["vanilla"], row["hf_vanilla"]
        checks = (mine["identical_to_vanilla"], mine["identical_to_target_alone"], alone["identical_to_vanilla"])
        same = "n/a (sampling)" if None in checks else "yes" if all(checks) else "NO"
        name = f"**{key}**" if key == "overall" else key
        lines.append(f"| {name} | {hf['tokens_per_second']:.1f} | {alone['tokens_per_second']:.1f} | "
                     f"{mine['tokens_per_second']:.1f} | {mine['tokens_per_second'] / hf['tokens_per_second']:.2f}× | "
                     f"{mine['tokens_per_second'] / alone['tokens_per_second']:.2f}× | "
                     f"{mine['mean_accepted_tokens']:.2f} | {same} |")
    return "\n".join(lines)
