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

import hashlib
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from kangaroo_core.machine import cpu_identity
from kangaroo_core.paths import cache_dir

DEFAULT_POSITIONS = (1, 2, 3, 4, 6, 8, 12, 16)


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


def measure_costs(backend, drafter=None, *, context: int = 300, positions: Sequence[int] = DEFAULT_POSITIONS,
                  repeats: int = 15, seed: int = 0, progress=None) -> CostCurve:
    """Measure ``t(n)`` for every size in ``positions`` and, with a bound ``drafter``, one draft step."""
    positions = tuple(sorted(set(int(n) for n in positions)))
    if not positions or positions[0] < 1:
        raise ValueError("positions must be positive integers")
    if context + max(positions) + 1 > backend.max_context:
        raise ValueError(f"context {context} + {max(positions)} positions exceeds the model's {backend.max_context}")
    rng = random.Random(seed)
    ids = _context_ids(backend, context + max(positions) + 1, seed)
    prefix = ids[:context]
    backend.reset()
    h_prefix = backend.shallow(prefix, 0)
    prefill = backend.deep(h_prefix, 0, rows=[context - 1])
    if drafter is not None:
        drafter.reset()
        if drafter.wants_deep_states:
            drafter.observe_deep(0, prefill.hidden)
        drafter.advance(prefix, h_prefix)
    now = (lambda: torch.cuda.synchronize(backend.device) or time.perf_counter()) if "cuda" in str(getattr(backend, "device", "")) else time.perf_counter
    times: dict[int, list[float]] = {n: [] for n in positions}
    draft_times: list[float] = []
    for _ in range(repeats):
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
            drafter.advance(ids[: context + 1], hidden)
            draft_times.append(now() - start)
        if progress is not None:
            progress()
    backend.crop(context)
    return CostCurve(
        backend=backend.name, kernels=_variant(backend), threads=torch.get_num_threads(),
        context=context, positions=positions,
        verify_ms=tuple(1000 * statistics.median(times[n]) for n in positions),
        draft_step_ms=1000 * statistics.median(draft_times) if draft_times else None, repeats=repeats)


def cost_key(backend, drafter) -> dict:
    """Everything a measured curve depends on: the machine, the backend and its kernels, dtype, threads, the model,
    its exit layer and the drafter."""
    device = str(getattr(backend, "device", "cpu"))
    if device.startswith("cuda") and torch.cuda.is_available():
        device += ": " + torch.cuda.get_device_name(torch.device(device))
    return {"machine": cpu_identity(), "device": device, "backend": backend.name, "kernels": _variant(backend),
            "dtype": str(getattr(backend, "dtype", "")), "threads": torch.get_num_threads(),
            "model": str(getattr(backend, "fingerprint", backend.model_name)), "exit_layer": backend.exit_layer,
            "drafter": f"{getattr(drafter, 'name', '')}:{getattr(drafter, 'resolved_adapter', '')}"}


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


def cached_costs(backend, drafter, positions: Sequence[int], *, repeats: int = 9) -> CostCurve:
    """This backend's curve for these positions with this drafter: from the cache when this machine measured it
    before (``kangaroo profile`` refreshes it), else measured now (seconds) and cached."""
    key = cost_key(backend, drafter)
    path = cost_file(key)
    wanted = set(positions)
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            data = stored["curve"]
            curve = CostCurve(**{**data, "positions": tuple(data["positions"]), "verify_ms": tuple(data["verify_ms"])})
            if wanted <= set(curve.positions) and curve.draft_step_ms is not None:
                return curve
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure again
    context = max(1, min(300, backend.max_context - max(wanted) - 2))
    curve = measure_costs(backend, drafter, context=context, positions=sorted(wanted), repeats=repeats)
    try:
        save_costs(curve, key)
    except OSError:
        pass  # a read-only cache: measured again next time
    return curve
