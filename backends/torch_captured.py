"""The torch backend's captured strategy (``--graphs on``): a preallocated KV cache and passes padded to fixed
widths, replayed as CUDA graphs on CUDA (run eagerly on CPU), see :mod:`kangaroo_backends.graph_passes`.

Mixed into :class:`~kangaroo_backends.torch_backend.TorchBackend`, whose ``_pass`` picks it when ``use_graphs``.
"""

from __future__ import annotations

import torch

from kangaroo_backends.families import SLIDING
from kangaroo_backends.graph_passes import MAX_WIDTH, PassGraph, padded_mask, slots_like, width_for
from kangaroo_core.config import ConfigError

GRAPHS = ("auto", "on", "off")
DEFAULT_CACHE_SIZE = 2048
DEFAULT_GRAPH_ROWS = 8


def check_graph_options(graphs: str, cache_size: int, graph_rows: int) -> dict:
    """The captured path's options, checked in one line each."""
    if graphs not in GRAPHS:
        raise ConfigError(f"graphs must be one of {', '.join(GRAPHS)}, got {graphs!r}")
    if not isinstance(cache_size, int) or cache_size < 2 * MAX_WIDTH:
        raise ConfigError(f"cache_size must be an integer >= {2 * MAX_WIDTH}, got {cache_size!r}")
    if not isinstance(graph_rows, int) or not 1 <= graph_rows <= MAX_WIDTH:
        raise ConfigError(f"graph_rows must be an integer in [1, {MAX_WIDTH}], got {graph_rows!r}")
    return {"graphs": graphs, "cache_size": cache_size, "graph_rows": graph_rows}


class CapturedPasses:
    """Chain passes replayed from one graph per width (two small host copies each: the rows and where they start);
    tree passes padded to a width; a prompt once, eagerly, at its own length."""

    def _chain_fn(self, fn, kinds):
        """``fn`` for a chain pass whose slots, positions and masks are computed from ``start`` on the device (so a
        captured chain pass takes two small copies from the host: its rows and where they start)."""
        def chain(x, start):
            slots = start + torch.arange(x.shape[0], device=self.device)
            keys = torch.arange(self.cache.capacity, device=self.device)[None]
            causal = keys <= slots[:, None]
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            low = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
            masks = {}
            for kind in set(kinds):
                seen = causal & (keys > slots[:, None] - self.window) if kind == SLIDING else causal
                masks[kind] = torch.where(seen, zero, low)[None, None]
            return fn(x, slots, slots[None], **masks)
        return chain

    def _captured_pass(self, part: str, fn, kinds, x: torch.Tensor, start: int, tree) -> tuple[torch.Tensor, ...]:
        """A chain pass: its rows and start copied into its width's graph; a tree pass: padded rows, positions and
        masks; a prompt: once, eagerly, at its own length."""
        n = x.shape[0]
        width = width_for(n, self.graph_rows)
        capture = self.device.type == "cuda"
        if width is not None and tree is None:
            key = (part, width, "chain")
            if key not in self.pass_graphs:
                rows = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=self.device)
                inputs = {"x": rows, "start": slots_like(self.device)}
                self.pass_graphs[key] = PassGraph(self._chain_fn(fn, kinds), inputs, capture=capture)
            return tuple(t[:n] for t in self.pass_graphs[key].run_prefix(x=x, start=torch.tensor([start])))
        slots, position_ids, masks = self._pass_inputs(kinds, n, start, tree)
        if width is None:
            return fn(x, slots, position_ids, **{k: padded_mask(m, n, n, start, self.cache.capacity, self.dtype,
                                                                self.device) for k, m in masks.items()})
        pad = width - n
        inputs = {"ids" if part == "shallow" else "hidden": torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]),
                  "slots": torch.cat([slots, torch.arange(start + n, start + width, device=self.device)]),
                  "position_ids": torch.cat([position_ids[0], slots.new_zeros(pad)])[None],
                  **{k: padded_mask(m, n, width, start, self.cache.capacity, self.dtype, self.device)
                     for k, m in masks.items()}}
        if (part, width) not in self.pass_graphs:
            self.pass_graphs[part, width] = PassGraph(fn, inputs, capture=capture)
        return tuple(t[:n] for t in self.pass_graphs[part, width].run(**inputs))
