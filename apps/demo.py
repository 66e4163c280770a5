"""``kangaroo demo``: the first minute. Kangaroo next to transformers' greedy ``generate`` and next to the same
engine's target alone, on one dev question of each kind (or on your prompt), with the identity check and CR.

It is a small bench run (:mod:`kangaroo_apps.bench.harness`: the model loaded once, a warm-up, the methods
interleaved question by question) printed as one table instead of written to files.
"""

from __future__ import annotations

from collections.abc import Sequence

from kangaroo_apps.bench.harness import MethodSpec, build_methods, run_bench, summarize
from kangaroo_apps.bench.questions import Question
from kangaroo_core.bench_context import BenchContext

#: the bench methods shown: transformers' greedy generate (the identity reference), the engine's target alone, Kangaroo
METHODS = ("hf_vanilla", "vanilla", "kangaroo")


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
    """One row per subtask and one overall: Kangaroo against the same engine's target alone first (what switching
    Kangaroo on buys), CR, then transformers' ``generate`` and the identity check."""
    methods = summary["methods"]
    failed = [f"{label}: {entry['error']}" for label, entry in methods.items() if entry["error"]]
    if failed:
        return "demo: " + "; ".join(failed)
    header = ("| kind | target alone tok/s | kangaroo tok/s | × target alone | CR | generate tok/s | × generate | "
              "identical |")
    lines = [header, "|" + "---|" * 8]
    for key in [*summary["subtasks"], "overall"]:
        row = {name: (methods[name]["overall"] if key == "overall" else methods[name]["per_subtask"][key])
               for name in METHODS}
        mine, alone, hf = row["kangaroo"], row["vanilla"], row["hf_vanilla"]
        name = f"**{key}**" if key == "overall" else key
        lines.append(f"| {name} | {alone['tokens_per_second']:.1f} | {mine['tokens_per_second']:.1f} | "
                     f"{mine['tokens_per_second'] / alone['tokens_per_second']:.2f}× | "
                     f"{mine['mean_accepted_tokens']:.2f} | {hf['tokens_per_second']:.1f} | "
                     f"{mine['tokens_per_second'] / hf['tokens_per_second']:.2f}× | {_identity(row)} |")
    return "\n".join(lines)


def demo_failure(summary: dict) -> str | None:
    """Why the demo must exit non-zero (a method failed, or an answer differs from the target alone's), or None."""
    methods = summary["methods"]
    failed = [f"{label}: {entry['error']}" for label, entry in methods.items() if entry["error"]]
    if failed:
        return "a method failed: " + "; ".join(failed)
    if _identity({name: methods[name]["overall"] for name in METHODS}) == "NO":
        return "Kangaroo's output differs from the target alone's (or ours from transformers') on some answer"
    return None


def _identity(row: dict) -> str:
    mine, alone = row["kangaroo"], row["vanilla"]
    checks = (mine["identical_to_vanilla"], mine["identical_to_target_alone"], alone["identical_to_vanilla"])
    return "n/a (sampling)" if None in checks else "yes" if all(checks) else "NO"
