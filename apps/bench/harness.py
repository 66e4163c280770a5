"""The interleaved bench run and its metrics.

Every method answers the same question turns in the same run. For each question turn every method runs once, in an
order rotated from turn to turn, so machine drift (thermal, other jobs) hits all methods alike; a warm-up generation
per method comes first and is not counted. Multi-turn (MT-bench) items: the second turn follows the model's own first
answer — the reference's (``hf_vanilla``) answer, so every method sees the very same second-turn prompt.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import attrs

from kangaroo_core.bench_context import BenchContext
from kangaroo_core.interfaces import BenchMethod, MethodResult
from kangaroo_apps.bench.questions import Question, subtasks_in_order
from kangaroo_core.errors import UsageError
from kangaroo_core.metrics import compression_rate, ctar, mean_drafted
from kangaroo_core.plugins import get_registry

REFERENCE = "hf_vanilla"
#: CTAR(w) is reported for w = 1..CTAR_WINDOWS (paper Fig. 2).
CTAR_WINDOWS = 6
#: The keys every per-subtask / overall entry of results.json has.
METRIC_KEYS = ("new_tokens", "seconds", "tokens_per_second", "mean_accepted_tokens", "ctar", "identical_to_vanilla",
               "identical_turns", "identical_to_target_alone", "identical_to_target_alone_turns", "mean_drafted",
               "draft_share", "verify_share", "draft_ms", "runs")


@attrs.frozen
class MethodSpec:
    """One column of the bench: a label (key in results.json), a registered method name and its options."""

    label: str
    name: str
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Record:
    label: str
    subtask: str
    question_id: str
    turn: int
    repeat: int
    result: MethodResult
    identical: bool | None
    #: equal to the method's own target alone (``BenchMethod.target_alone``) on this turn; None: not in the run
    same_as_target_alone: bool | None = None


@attrs.define
class BenchRun:
    labels: list[str]
    subtasks: list[str]
    records: list[Record]
    errors: dict[str, str]
    greedy: bool


def known_methods() -> list[str]:
    """Registered bench methods, ordered by their ``rank`` (the built-ins first), then by name."""
    registry = get_registry()
    return sorted(registry.names("bench_method"), key=lambda n: (registry.resolve("bench_method", n).rank, n))


def parse_methods(text: str | None) -> list[MethodSpec]:
    """``--methods a,b``; None: every registered method. The reference ``hf_vanilla`` is always measured (first)."""
    known = known_methods()
    names = known if text is None else [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--methods is empty")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown bench method(s) {', '.join(unknown)}; known bench methods: {', '.join(known)}")
    names = [REFERENCE] + [n for n in dict.fromkeys(names) if n != REFERENCE]
    return [MethodSpec(n, n) for n in names]


def build_methods(specs: Sequence[MethodSpec], context: BenchContext) -> list[tuple[str, BenchMethod]]:
    registry = get_registry()
    return [(s.label, registry.create("bench_method", s.name, context.config, s.options)) for s in specs]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def rotate(items: list[str], k: int) -> list[str]:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def run_bench(context: BenchContext, methods: list[tuple[str, BenchMethod]], questions: Sequence[Question], *,
              max_new_tokens: int, repeats: int = 1, warmup: bool = True, progress: bool = True,
              desc: str = "bench") -> BenchRun:
    """Measure every method on every question turn, interleaved; a failing method is reported, not fatal (``desc``:
    the progress bar's label)."""
    from tqdm import tqdm

    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {repeats}")
    labels = [label for label, _ in methods]
    by_label = dict(methods)
    errors: dict[str, str] = {}
    for label, method in methods:
        try:
            method.prepare(context)
        except Exception as exc:  # reported in results.json; the other methods keep going
            errors[label] = f"prepare: {_one_line(exc)}"
    if warmup:
        messages = [{"role": "user", "content": questions[0].turns[0]}]
        for label in labels:
            if label not in errors:
                try:
                    by_label[label].run(messages, min(8, max_new_tokens))
                except Exception as exc:
                    errors[label] = f"warm-up: {_one_line(exc)}"

    greedy = context.config.sampling.greedy
    by_name: dict[str, str] = {}  # registered name -> the first label running it
    for label, method in methods:
        by_name.setdefault(method.name, label)
    target_alone = {label: by_name[method.target_alone] for label, method in methods
                    if by_name.get(method.target_alone, label) != label}
    reference_tokens: dict[tuple[str, int], list[int]] = {}
    records: list[Record] = []
    total = sum(len(q.turns) for q in questions) * len(labels) * repeats
    step = 0
    with tqdm(total=total, desc=desc, unit="gen", file=sys.stderr, disable=not progress, dynamic_ncols=True) as bar:
        for repeat in range(repeats):
            for question in questions:
                history: list[dict[str, str]] = []
                for turn, text in enumerate(question.turns, start=1):
                    messages = history + [{"role": "user", "content": text}]
                    results: dict[str, MethodResult] = {}
                    for label in rotate(labels, step):
                        if label not in errors:
                            bar.set_postfix_str(f"{question.subtask} #{question.question_id} turn {turn}: {label}",
                                                refresh=False)
                            try:
                                results[label] = by_label[label].run(messages, max_new_tokens)
                            except Exception as exc:
                                errors[label] = (f"{question.subtask} question {question.question_id} turn {turn}: "
                                                 f"{_one_line(exc)}")
                        bar.update(1)
                    step += 1
                    key = (question.question_id, turn)
                    if REFERENCE in results and key not in reference_tokens:
                        reference_tokens[key] = results[REFERENCE].token_ids
                    for label, result in results.items():
                        ref = reference_tokens.get(key)
                        identical = (result.token_ids == ref) if greedy and ref is not None else None
                        alone = results.get(target_alone.get(label, ""))
                        same = (result.token_ids == alone.token_ids) if greedy and alone is not None else None
                        records.append(Record(label, question.subtask, question.question_id, turn, repeat, result,
                                              identical, same))
                    # the conversation continues with the reference's answer (else the first method that answered)
                    source = next((l for l in [REFERENCE, *labels] if l in results), None)
                    if source is None:
                        break
                    answer = context.tokenizer.decode(results[source].token_ids, skip_special_tokens=True)
                    history = messages + [{"role": "assistant", "content": answer}]
    return BenchRun(labels, subtasks_in_order(list(questions)), records, errors, greedy)


# -- metrics -----------------------------------------------------------------------------------------------------------
def metrics(records: Sequence[Record], greedy: bool) -> dict[str, Any]:
    """Pooled metrics of a set of generations (tokens/s = all tokens / all seconds, as Spec-Bench)."""
    results = [r.result for r in records]
    new_tokens = sum(len(r.token_ids) for r in results)
    seconds = sum(r.seconds for r in results)
    out: dict[str, Any] = {k: None for k in METRIC_KEYS}
    out.update(new_tokens=new_tokens, seconds=seconds, runs=len(results),
               tokens_per_second=new_tokens / seconds if seconds > 0 else None)
    if results and all(r.rounds is not None for r in results):
        rounds = [rnd for r in results for rnd in r.rounds]
        if rounds:
            out["mean_accepted_tokens"] = compression_rate(rounds)
            out["ctar"] = ctar(rounds, CTAR_WINDOWS)
            out["mean_drafted"] = mean_drafted(rounds)
            draft = sum(x.draft_seconds for x in rounds)
            verify = sum(x.verify_seconds for x in rounds)
            if draft + verify > 0:
                out["draft_share"], out["verify_share"] = draft / (draft + verify), verify / (draft + verify)
            drafted = sum(x.drafted for x in rounds)
            if drafted:  # the drafter's cost per drafted token in the loop (its catch-up steps included)
                out["draft_ms"] = 1000 * draft / drafted
    elif results and all(r.target_passes for r in results):
        generated = sum(r.generated_tokens if r.generated_tokens is not None else len(r.token_ids) for r in results)
        out["mean_accepted_tokens"] = generated / sum(r.target_passes for r in results)
    if greedy and results and all(r.identical is not None for r in records):
        out["identical_to_vanilla"] = all(r.identical for r in records)
        out["identical_turns"] = sum(bool(r.identical) for r in records)  # of `runs`: how often, not only whether
    if greedy and results and all(r.same_as_target_alone is not None for r in records):
        out["identical_to_target_alone"] = all(r.same_as_target_alone for r in records)
        out["identical_to_target_alone_turns"] = sum(bool(r.same_as_target_alone) for r in records)  # of `runs`
    return out


def summarize(run: BenchRun, baseline: str = REFERENCE) -> dict[str, Any]:
    """``{"methods": {label: {"per_subtask", "overall", "error"}}, "speedup": {label: {subtask, "overall"}},
    "baseline": label}``: speedups are tokens/s ratios to the ``baseline`` method (default ``hf_vanilla``)."""
    methods: dict[str, Any] = {}
    for label in run.labels:
        error = run.errors.get(label)
        mine = [] if error else [r for r in run.records if r.label == label]
        per = {s: metrics([r for r in mine if r.subtask == s], run.greedy) for s in run.subtasks}
        methods[label] = {"per_subtask": per, "overall": metrics(mine, run.greedy), "error": error}
    speedup: dict[str, Any] = {}
    ref = methods.get(baseline)
    for label, entry in methods.items():
        row = {}
        for scope in [*run.subtasks, "overall"]:
            mine = entry["overall"] if scope == "overall" else entry["per_subtask"][scope]
            base = None if ref is None else (ref["overall"] if scope == "overall" else ref["per_subtask"][scope])
            tps, base_tps = mine["tokens_per_second"], base and base["tokens_per_second"]
            row[scope] = tps / base_tps if tps and base_tps else None
        speedup[label] = row
    return {"methods": methods, "speedup": speedup, "baseline": baseline}
