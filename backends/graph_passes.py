"""The torch backend's captured decode path: a preallocated KV cache and passes of fixed shapes.

A pass over n rows is padded to a *width* (the smallest power of two >= n, at least ``min_rows``, at most
:data:`MAX_WIDTH`); every pass of one width has the same shapes (its rows, the whole cache as keys), so on CUDA it
is captured once as a CUDA graph and replayed (one launch instead of hundreds: a small model's eager pass is bound by
launches, not by the GPU). On CPU the very same code runs eagerly: that is what CI checks for identity. Longer passes
(prompts) run once, eagerly, at their exact length.

Why passes are padded to a common width rather than run at their own length: a GPU matmul may pick another kernel
(and round differently) for 1 row than for 8, but it computes each row of a fixed shape the same way whatever the
other rows hold. With the target alone and the verify passes of a chain both 8 rows wide, verifying reproduces the
one-token passes bit for bit, which is what makes Kangaroo lossless on a GPU in bfloat16 too.

Padded rows are harmless: they sit in the slots after the real rows (no real row sees them, the next pass
overwrites them), the cache starts zeroed and masks are finite, so no NaN can leak through a zero weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kangaroo_backends.hf_compat import update_kwargs
from kangaroo_backends.kv_cache import KVCache

#: the widest captured pass; longer ones (prompts) run eagerly at their own length
MAX_WIDTH = 64


class StaticKVCache(KVCache):
    """Keys/values of every layer preallocated at ``capacity`` slots; a pass writes its rows at the slots named by
    ``cache_position`` and attends over the whole buffer (its mask hides what it must not see).

    ``update`` is pure tensor work, so it can be captured in a graph; the host-side lengths are set by the backend
    after each pass (:meth:`advance`), never inside a captured call."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int,
                 device: torch.device | str = "cpu"):
        super().__init__(num_layers, kv_heads, head_dim, dtype, capacity=capacity, device=device)
        for store in (self.keys, self.values):
            for buffer in store:
                buffer.zero_()  # finite everywhere: a masked slot's weight is 0, and 0 * NaN would not be
        self.capacity = capacity

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs=None, **extra):
        slots = update_kwargs(cache_kwargs, extra)["cache_position"]
        self.keys[layer_idx].index_copy_(2, slots, key)
        self.values[layer_idx].index_copy_(2, slots, value)
        return self.keys[layer_idx], self.values[layer_idx]

    def advance(self, layers: range, length: int) -> None:
        """Record that ``layers`` now hold ``length`` valid positions."""
        for i in layers:
            self.lengths[i] = length

    def _grow(self, layer_idx: int, needed: int) -> None:
        raise RuntimeError(f"the static KV cache holds {self.capacity} positions; {needed} asked")


def width_for(n: int, min_rows: int) -> int | None:
    """The padded width of a pass over ``n`` rows, or None for a pass run at its own length."""
    if n > MAX_WIDTH:
        return None
    width = max(1, min_rows)
    while width < n:
        width *= 2
    return min(width, MAX_WIDTH) if width >= n else None


class PassGraph:
    """One pass function at one width: static input buffers, and on CUDA the captured graph that reads them.

    ``run(**inputs)`` copies the inputs into the static buffers and replays (CUDA) or calls the function (CPU);
    the outputs are fresh tensors (a replay overwrites the graph's own output buffers)."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: dict[str, torch.Tensor], capture: bool):
        self.fn = fn
        self.static = {name: torch.zeros_like(value) for name, value in inputs.items()}
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def run(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for name, value in inputs.items():
            self.static[name].copy_(value)
        return self._replay()

    def run_prefix(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`run` with each input copied into the leading rows of its buffer (the rest keeps the previous
        pass's values: finite, and in rows whose results are dropped)."""
        for name, value in inputs.items():
            self.static[name][: value.shape[0]].copy_(value)
        return self._replay()

    def _replay(self) -> tuple[torch.Tensor, ...]:
        if not self.capture:
            return self.fn(**self.static)
        if self.graph is None:
            self._capture()  # the warm-up writes the same rows to the same slots as the replay: idempotent
        self.graph.replay()
        return tuple(out.clone() for out in self.outputs)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (kernel selection, workspace allocation)
            for _ in range(2):
                self.fn(**self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.fn(**self.static)


def slots_like(device) -> torch.Tensor:
    """The buffer of a chain pass's first slot (one long)."""
    return torch.zeros(1, dtype=torch.long, device=device)


def padded_mask(mask: torch.Tensor | None, rows: int, width: int, start: int, capacity: int,
                dtype: torch.dtype, device) -> torch.Tensor:
    """An additive mask [1, 1, width, capacity] from a pass's own mask [1, 1, rows, start+rows] (None: every row
    sees everything before it, a one-row pass): slots past the pass are hidden; padded row r sees slot start+r."""
    low = torch.finfo(dtype).min
    out = torch.full((width, capacity), low, dtype=dtype, device=device)
    if mask is None:
        out[:rows, : start + rows] = 0
    else:
        out[:rows, : mask.shape[-1]] = mask[0, 0]
    pad = torch.arange(rows, width, device=device)
    out[pad, start + pad] = 0
    return out[None, None]
