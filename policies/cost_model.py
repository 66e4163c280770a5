"""The measured cost model of a backend: what verifying n positions and one draft step cost, here and now.

Speculative decoding pays only when a verify pass over k+1 positions costs about one forward: a round that drafts k
tokens at cost ``c_draft`` each and accepts a tokens on average wins when ``(a + 1) * t(1) > k * c_draft + t(k + 1)``.
:func:`measure_costs` measures ``t(n)`` (M[:l] + M[l:] + the head over n new positions after a ``context``-token
prefix, which is what step 1 + step 3 of a round cost together) and ``c_draft`` (one position through M[:l] and the
drafter) on the backend in use. ``kangaroo profile`` prints it; policies and tree sizing can read it
(:attr:`CostCurve.relative`).

Timings are interleaved (every repeat walks all sizes once, in a shuffled order) and reported as medians, so a
machine that slows down mid-run shifts every size alike rather than one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from kangaroo_core.machine import cpu_identity, forced_paths, host_threads
from kangaroo_core.paths import cache_dir

DEFAULT_POSITIONS = (1, 2, 3, 4, 6, 8, 12, 16)
#: the pass sizes measured for the cost-aware policy: one stream's verify passes and a batch's merged ones (up to 8
#: streams of up to 7 rows), interpolated between
CURVE_POSITIONS = (1, 2, 4, 8, 16, 32, 64)
#: the counts of drafting streams whose merged draft step (a batch's draft pass) the cost-aware policy reads,
#: interpolated between
DRAFT_STREAMS = (1, 2, 4, 8)
#: the rows per stream of the batch's merged verify passes the cost-aware policy reads (a round of k drafts verifies
#: k + 1), interpolated between
VERIFY_ROWS = (1, 2, 4, 8)
#: the shorter context whole rounds are measured at too (besides the curve's own), for short prompts' answers
SHORT_CONTEXT = 64
#: names the timings per measured size of the cost-aware policy's curve (default 9)
REPEATS_ENV = "KANGAROO_COST_REPEATS"
#: bumped when what a cached curve holds changes: older files are measured again
COST_VERSION = 8
#: the k of :func:`_time_rounds` for a round whose one draft is dropped unverified (a plain step + one drafter step)
DROPPED = -1


@attrs.frozen
class CostCurve:
    """Median milliseconds per pass; ``verify_ms[i]`` is for ``positions[i]`` new positions after ``context``."""

    backend: str
    kernels: str
    threads: int
    context: int
    positions: tuple[int, ...]
    verify_ms: tuple[float, ...]
    draft_step_ms: float | None
    repeats: int
    #: ``round_ms[k]``: a whole chain round that drafts k tokens, as the engine runs it (k + 1 one-position
    #: shallow passes, k drafter steps, one deep pass over k + 1 positions), timed among rounds drafting k back to
    #: back; empty when not measured
    round_ms: tuple[float, ...] = ()
    #: ``draft_many_ms[i]``: one draft step of ``draft_streams[i]`` streams in a batch (one M[:l] pass over a row per
    #: stream, then the drafter's pass: merged where backend and drafter merge, else one by one); ``(1,)`` alone
    #: where the backend has no stream views or the drafter cannot fork
    draft_streams: tuple[int, ...] = ()
    draft_many_ms: tuple[float, ...] = ()
    #: ``verify_many_ms[i * len(verify_rows) + j]``: a batch's merged verify pass (M[:l] and M[l:]) over
    #: ``verify_rows[j]`` rows of each of ``draft_streams[i]`` streams; empty where streams cannot run together
    verify_rows: tuple[int, ...] = ()
    verify_many_ms: tuple[float, ...] = ()
    #: ``round_ms`` measured again after ``short_context`` tokens (a short context's plain step is cheaper, a draft
    #: step is not: a round's price depends on where it runs); empty when not measured
    short_context: int = 0
    short_round_ms: tuple[float, ...] = ()
    #: a chain round whose drafter proposes one token that is then dropped unverified: the target's plain step and
    #: one drafter step, timed among such rounds back to back; None when not measured
    dropped_round_ms: float | None = None
    #: the drafter's own part of a draft step (no M[:l] pass): the least a dropped draft adds to a round
    advance_ms: float | None = None

    @property
    def relative(self) -> dict[int, float]:
        """t(n) / t(1) per size (1.0 for n = 1)."""
        base = self.verify_ms[self.positions.index(1)] if 1 in self.positions else self.verify_ms[0]
        return {n: ms / base for n, ms in zip(self.positions, self.verify_ms)}

    def table(self) -> str:
        """A Markdown table: positions, ms, ratio to one position."""
        rows = [f"| positions | {' | '.join(str(n) for n in self.positions)} |",
                f"|---|{'---|' * len(self.positions)}",
                f"| ms | {' | '.join(f'{ms:.1f}' for ms in self.verify_ms)} |",
                f"| × one position | {' | '.join(f'{r:.2f}' for r in self.relative.values())} |"]
        head = (f"{self.backend} (kernels: {self.kernels}), {self.threads} thread(s), {self.context}-token context, "
                f"median of {self.repeats}")
        draft = "" if self.draft_step_ms is None else f"\ndraft step (M[:l] + drafter, one position): {self.draft_step_ms:.1f} ms"
        if self.round_ms:
            zero = self.round_ms[0]
            if self.dropped_round_ms is not None:
                draft += (f"\nround whose one draft is dropped unverified: {self.dropped_round_ms:.1f} ms "
                          f"({self.dropped_round_ms / self.round_ms[0]:.2f} × the target's plain step; the "
                          f"drafter's own step alone: {self.advance_ms or 0:.1f} ms)")
            draft += ("\n\n| drafts per round | " + " | ".join(str(k) for k in range(len(self.round_ms))) + " |\n|---|"
                      + "---|" * len(self.round_ms) + "\n| round ms | " + " | ".join(f"{ms:.1f}" for ms in self.round_ms)
                      + " |\n| × the target's plain step | " + " | ".join(f"{ms / zero:.2f}" for ms in self.round_ms) + " |")
        if self.short_round_ms:
            draft += ("\n\n| round ms: context \\ drafts | " + " | ".join(str(k) for k in range(len(self.round_ms)))
                      + " |\n|---|" + "---|" * len(self.round_ms) + "".join(
                          f"\n| {c} | " + " | ".join(f"{ms:.1f}" for ms in rounds) + " |"
                          for c, rounds in ((self.short_context, self.short_round_ms), (self.context, self.round_ms))))
        if len(self.draft_streams) > 1:
            one = self.draft_many_ms[0]
            draft += ("\n\n| streams drafting together | " + " | ".join(str(s) for s in self.draft_streams) + " |\n|---|"
                      + "---|" * len(self.draft_streams) + "\n| draft step ms | "
                      + " | ".join(f"{ms:.1f}" for ms in self.draft_many_ms) + " |\n| × one stream's | "
                      + " | ".join(f"{ms / one:.2f}" for ms in self.draft_many_ms) + " |")
        if self.verify_many_ms:
            per = self.verify_rows
            draft += ("\n\n| verify pass ms: streams \\ rows per stream | " + " | ".join(str(r) for r in per)
                      + " |\n|---|" + "---|" * len(per) + "".join(
                          f"\n| {s} | " + " | ".join(f"{ms:.1f}" for ms in self.verify_many_ms[i * len(per):(i + 1) * len(per)])
                          + " |" for i, s in enumerate(self.draft_streams)))
        return head + "\n\n" + "\n".join(rows) + draft

    def as_dict(self) -> dict:
        return {**attrs.asdict(self), "relative": {str(k): v for k, v in self.relative.items()}}


def _variant(backend) -> str:
    """What decides the backend's kernels: torch's ``kernels``, onnx's ``weights`` (and accuracy level)."""
    if getattr(backend, "kernels", None):
        return str(backend.kernels)
    weights = getattr(backend, "weights", None)
    if weights == "gguf":
        kernel = f", {backend.kernel}" if getattr(backend, "kernel", None) else ""
        return f"gguf weights, accuracy level {backend.accuracy_level}{kernel}"
    return str(weights or "default")


def _context_ids(backend, context: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(backend.vocab_size) for _ in range(context)]


#: rounds timed back to back per k and repeat (the first of them not counted: it follows another k's rounds); plain
#: steps (k = 0) in a longer stretch, the first few not counted: a stretch of them runs as fast as the target alone
#: only once the drafter's sessions have gone quiet
CHAIN, PLAIN_CHAIN, PLAIN_SETTLE = 5, 12, 4


def _time_rounds(backend, drafter, ids: list[int], context: int, k: int, count: int, now) -> list[float]:
    """``count`` chain rounds from position ``context`` that each draft k tokens (greedy drafts, every one accepted;
    k = :data:`DROPPED`: one draft, dropped unverified),
    back to back as the engine runs a stretch of rounds: each starts where the last ended, the drafter catching up
    on the states it has not consumed, as in :meth:`Engine._chain_round`. A round timed alone after other work can
    read far cheaper, against a plain step, than the loop's rounds (docs/benchmarks.md, "Rounds priced as the loop
    runs them"); back to back a plain step costs what the target alone's does."""
    from kangaroo_core.results import DraftStep

    backend.crop(context)
    if drafter is not None:
        drafter.crop(context)
    times, n = [], context
    unseen = None
    for _ in range(count):
        start = now()
        h_last = backend.shallow(ids[n: n + 1], n)
        states, sequence = [h_last], list(ids[: n + 1])
        if drafter is not None:
            unseen = h_last if unseen is None else torch.cat([unseen, h_last])
        for i in range(1 if k == DROPPED else k):
            logits = drafter.advance(sequence, unseen)
            unseen = unseen[:0]
            if logits is None or k == DROPPED:
                break
            step = DraftStep.from_logits(logits, index=i + 1)
            unseen = backend.shallow([step.token], len(sequence))
            sequence.append(step.token)
            states.append(unseen)
        verified = backend.deep(torch.cat(states), n)
        if drafter is not None and drafter.wants_deep_states:
            drafter.observe_deep(n, verified.hidden)
        times.append(now() - start)
        n += len(states)
    return times


def on_host_threads(measure):
    """``measure(backend, ...)`` with torch held to ``backend.host_threads`` (if any), as the loop holds it: an engine
    binds, and its policy or tree measures, outside the loop."""
    @functools.wraps(measure)
    def measured(backend, *args, **kwargs):
        with host_threads(backend):
            return measure(backend, *args, **kwargs)

    return measured


@on_host_threads
def measure_costs(backend, drafter=None, *, context: int = 300, positions: Sequence[int] = DEFAULT_POSITIONS,
                  repeats: int = 15, seed: int = 0, progress=None, rounds: int = 0) -> CostCurve:
    """Measure ``t(n)`` for every size in ``positions`` and, with a bound ``drafter``, one draft step and (``rounds``
    > 0) whole rounds drafting k = 0..rounds tokens: what a round really costs, the interference of the drafter's
    and the target's kernels (caches, thread pools) included."""
    positions = tuple(sorted(set(int(n) for n in positions)))
    if not positions or positions[0] < 1:
        raise ValueError("positions must be positive integers")
    span = max(max(positions), rounds + 1 if drafter is not None else 0)
    if context + span + 1 > backend.max_context:
        raise ValueError(f"context {context} + {span} positions exceeds the model's {backend.max_context}")
    room = backend.max_context - context - 1  # positions a stretch of rounds may fill (fewer rounds in a short model)
    rng = random.Random(seed)
    ids = _context_ids(backend, context + room + 1, seed)
    prefix = ids[:context]
    backend.reset()
    h_prefix = backend.shallow(prefix, 0)
    prefill = backend.deep(h_prefix, 0, rows=[context - 1])
    if drafter is not None:
        drafter.reset()
        if drafter.wants_deep_states:
            drafter.observe_deep(0, prefill.hidden)
        drafter.advance(prefix, h_prefix)
    now = _clock(backend)
    times: dict[int, list[float]] = {n: [] for n in positions}
    draft_times: list[float] = []
    advance_times: list[float] = []
    ks = list(range(rounds + 1)) + [DROPPED] if drafter is not None and rounds > 0 else []
    round_times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):
        rng.shuffle(ks)
        for k in ks:
            count = min(PLAIN_CHAIN if k == 0 else CHAIN, room // max(k + 1, 1))
            skip = min(PLAIN_SETTLE if k == 0 else 1, count - 1)
            round_times[k].extend(_time_rounds(backend, drafter, ids, context, k, count, now)[skip:])
        order = list(positions)
        rng.shuffle(order)
        for n in order:
            backend.crop(context)
            start = now()  # CUDA: clocks read after the queued work
            hidden = backend.shallow(ids[context: context + n], context)
            backend.deep(hidden, context)
            times[n].append(now() - start)
        if drafter is not None:
            backend.crop(context)
            drafter.crop(context)
            start = now()
            hidden = backend.shallow(ids[context: context + 1], context)
            middle = now()
            drafter.advance(ids[: context + 1], hidden)
            draft_times.append(now() - start)
            advance_times.append(now() - middle)
        if progress is not None:
            progress()
    backend.crop(context)
    return CostCurve(
        backend=backend.name, kernels=_variant(backend), threads=_threads(backend),
        context=context, positions=positions,
        verify_ms=tuple(1000 * statistics.median(times[n]) for n in positions),
        draft_step_ms=1000 * statistics.median(draft_times) if draft_times else None, repeats=repeats,
        advance_ms=1000 * statistics.median(advance_times) if advance_times else None,
        round_ms=tuple(1000 * statistics.median(round_times[k]) for k in sorted(round_times) if k != DROPPED),
        dropped_round_ms=1000 * statistics.median(round_times[DROPPED]) if DROPPED in round_times else None)


def _clock(backend):
    """A clock that reads after the queued work (CUDA), else ``time.perf_counter``."""
    if "cuda" in str(getattr(backend, "device", "")):
        return lambda: torch.cuda.synchronize(backend.device) or time.perf_counter()
    return time.perf_counter


@on_host_threads
@torch.inference_mode()
def measure_batch_passes(backend, drafter, *, context: int = 300, streams: Sequence[int] = DRAFT_STREAMS,
                         rows: Sequence[int] = VERIFY_ROWS, repeats: int = 9,
                         seed: int = 0) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """A batch's merged passes on stream views and drafter forks after the same ``context``-token prefix, timed as a
    batch runs them (median milliseconds): for each count in ``streams``, one draft step (one M[:l] pass over a new
    row per stream, :meth:`Backend.shallow_many`, then one drafter pass, :meth:`SelfDrafter.advance_many`); and for
    each (count, rows per stream) in ``streams`` × ``rows`` (row-major), one pass of M[:l] and one of M[l:] over
    that many rows per stream (``shallow_many`` + ``deep_many``: a batch's verify pass, measured as ``t(n)`` is).
    None where the backend has no stream views or the drafter cannot fork (a batch then runs one stream at a
    time)."""
    try:
        views = [backend.stream_view() for _ in range(max(streams))]
        forks = [drafter.fork(view) for view in views]
    except NotImplementedError:
        return None
    ids = _context_ids(backend, context + max(rows), seed)
    prefix = ids[:context]
    for view, fork in zip(views, forks):
        hidden = view.shallow(prefix, 0)
        deep = view.deep(hidden, 0, rows=[context - 1]).hidden
        if fork.wants_deep_states:
            fork.observe_deep(0, deep)
        fork.advance(prefix, hidden)
    now, rng = _clock(backend), random.Random(seed)
    # (streams, 0): a draft step; (streams, rows): a verify pass over that many rows of each stream
    times: dict[tuple[int, int], list[float]] = {(s, r): [] for s in streams for r in (0, *rows)}
    order = list(times)
    for _ in range(repeats):
        rng.shuffle(order)
        for s, r in order:
            for view, fork in zip(views[:s], forks[:s]):
                view.crop(context)
                fork.crop(context)
            start = now()
            hidden = backend.shallow_many([(view, ids[context: context + max(r, 1)], context, None)
                                           for view in views[:s]])
            if r == 0:
                drafter.advance_many([(fork, ids[: context + 1], h) for fork, h in zip(forks[:s], hidden)])
            else:
                backend.deep_many([(view, h, context, None, None) for view, h in zip(views[:s], hidden)])
            times[s, r].append(now() - start)
    ms = {key: 1000 * statistics.median(t) for key, t in times.items()}
    return tuple(ms[s, 0] for s in streams), tuple(ms[s, r] for s in streams for r in rows)


def with_batch_passes(curve: CostCurve, backend, drafter, *, repeats: int) -> CostCurve:
    """``curve`` with a batch's merged draft steps and verify passes measured for :data:`DRAFT_STREAMS` streams
    (only one stream's draft step, the curve's, where the batch cannot run streams together)."""
    measured = measure_batch_passes(backend, drafter, context=curve.context, repeats=repeats)
    if measured is None:
        return attrs.evolve(curve, draft_streams=(1,), draft_many_ms=(curve.draft_step_ms,))
    return attrs.evolve(curve, draft_streams=DRAFT_STREAMS, draft_many_ms=measured[0], verify_rows=VERIFY_ROWS,
                        verify_many_ms=measured[1])


def with_round_contexts(curve: CostCurve, backend, drafter, *, repeats: int) -> CostCurve:
    """``curve`` with its whole rounds measured again after :data:`SHORT_CONTEXT` tokens (a short prompt's answer
    runs there), next to the curve's own context."""
    if not curve.round_ms or curve.context <= SHORT_CONTEXT:
        return curve
    most = len(curve.round_ms) - 1
    short = measure_costs(backend, drafter, context=SHORT_CONTEXT, positions=(1,), repeats=repeats, rounds=most)
    return attrs.evolve(curve, short_context=SHORT_CONTEXT, short_round_ms=short.round_ms)


def cost_key(backend, drafter) -> dict:
    """Everything a measured curve depends on: the machine, the backend and its kernels (their C sources too),
    dtype, threads, the model, its exit layer and the drafter."""
    device = str(getattr(backend, "device", "cpu"))
    if device.startswith("cuda") and torch.cuda.is_available():
        device += ": " + torch.cuda.get_device_name(torch.device(device))
    return {"version": COST_VERSION, "machine": cpu_identity(), "forced_paths": forced_paths(), "device": device, "backend": backend.name, "kernels": _variant(backend),
            "kernel_sources": str(getattr(backend, "kernel_sources", "")),
            "dtype": str(getattr(backend, "dtype", "")), "threads": _threads(backend),
            "spinning": str(getattr(backend, "spinning", "")),
            "model": str(getattr(backend, "fingerprint", backend.model_name)), "exit_layer": backend.exit_layer,
            "drafter": f"{getattr(drafter, 'name', '')}:{getattr(drafter, 'resolved_adapter', '')}"}


def _threads(backend) -> int:
    """The threads a pass runs on: torch's, or for a backend on its own pools (``host_threads`` set: torch is then
    held to those inside the loop) the backend's own (None: onnxruntime's choice, one per core)."""
    if getattr(backend, "host_threads", None) is None:
        return torch.get_num_threads()
    own = getattr(backend, "threads", None)
    if own:
        return own
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cost_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{digest}.json"


def save_costs(curve: CostCurve, key: dict) -> Path:
    path = cost_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "curve": attrs.asdict(curve)}, indent=1) + "\n")
    tmp.replace(path)  # whole or not at all: another process may read it
    return path


def cached_costs(backend, drafter, most: int, *, repeats: int = 9) -> CostCurve:
    """This backend's curve with this drafter — whole rounds of 0..most drafts and passes over CURVE_POSITIONS —
    from the cache when this machine measured it before (``kangaroo profile`` refreshes it), else measured now
    (seconds) and cached."""
    key = cost_key(backend, drafter)
    path = cost_file(key)
    repeats = _repeats(repeats)
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            curve = curve_from_dict(stored["curve"])
            if covers(curve, most, backend.max_context):
                return curve
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure again
    positions = wanted_positions(most, backend.max_context)
    context = max(1, min(300, backend.max_context - max(positions) - 2))
    # whole rounds (what the policy compares) with every repeat; single passes, read only to size a batch's merged
    # pass (tens of ms each on a CPU), with fewer
    curve = measure_costs(backend, drafter, context=context, positions=(1,), repeats=repeats, rounds=most)
    rest = measure_costs(backend, None, context=context, positions=positions[1:], repeats=max(1, repeats // 3))
    curve = attrs.evolve(curve, positions=curve.positions + rest.positions, verify_ms=curve.verify_ms + rest.verify_ms)
    curve = with_batch_passes(curve, backend, drafter, repeats=max(1, repeats // 3))
    curve = with_round_contexts(curve, backend, drafter, repeats=repeats)
    try:
        save_costs(curve, key)
    except OSError:
        pass  # a read-only cache: measured again next time
    return curve


def _repeats(default: int) -> int:
    """``$KANGAROO_COST_REPEATS`` (timings per measured size: fewer for a quick run, e.g. a test suite), else
    ``default``."""
    value = os.environ.get(REPEATS_ENV, "").strip()
    try:
        return max(1, int(value)) if value else default
    except ValueError:
        raise ValueError(f"${REPEATS_ENV} must be a whole number of timings, got {value!r}") from None


def curve_from_dict(data: dict) -> CostCurve:
    return CostCurve(**{**data, **{k: tuple(data.get(k, ())) for k in ("positions", "verify_ms", "round_ms",
                                                                      "draft_streams", "draft_many_ms",
                                                                      "verify_rows", "verify_many_ms",
                                                                      "short_round_ms")}})


def wanted_positions(most: int, max_context: int | None = None) -> list[int]:
    """The pass sizes the cost-aware policy reads (interpolated between them): a stream alone and the merged passes
    of a batch — those up to half the model's context (at least 8)."""
    room = max(8, most + 1, (max_context or 1 << 30) // 2)
    return [n for n in CURVE_POSITIONS if n <= room]


def covers(curve: CostCurve, most: int, max_context: int | None = None) -> bool:
    """Whether ``curve`` has what a policy drafting at most ``most`` tokens per round reads."""
    return (set(wanted_positions(most, max_context)) <= set(curve.positions) and curve.draft_step_ms is not None
            and len(curve.round_ms) >= most + 1 and curve.dropped_round_ms is not None and bool(curve.draft_streams)
            and (bool(curve.short_round_ms) or curve.context <= SHORT_CONTEXT))
