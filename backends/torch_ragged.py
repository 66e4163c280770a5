"""The torch backend's ragged strategy: a view per stream (its own KV cache), and the pending passes of many streams
run as one pass over their rows laid end to end (vLLM's flattened batch), see :mod:`kangaroo_backends.ragged`.

Mixed into :class:`~kangaroo_backends.torch_backend.TorchBackend`; :class:`~kangaroo_core.batching.Batch` calls it.
"""

from __future__ import annotations

import copy

import torch

from kangaroo_backends.fast_layers import EXACT_ROWS
from kangaroo_backends.kv_cache import check_start
from kangaroo_backends.ragged import Ragged, RaggedCache, exact_rows
from kangaroo_core.interfaces import DeepOutput


class RaggedPasses:
    """Stream views, and their rows in one ragged pass where every row comes out as its stream alone computes it."""

    def stream_view(self) -> "RaggedPasses":
        view = copy.copy(self)  # layers, weights and options shared
        view.cache, view.pass_graphs = self._new_cache(), {}
        return view

    def _ragged(self, parts) -> bool:
        """Whether these parts run as one ragged pass: only where every row is computed alone whatever the pass
        holds (the small-batch kernels: CPU float32), every part a chain or tree of at most 16 rows (a longer one,
        a prompt, runs alone as its stream would run it). Elsewhere (a GPU's GEMMs may round a row differently
        beside other rows) each stream's pass runs on its own: still continuous batching, not yet merged."""
        return (len(parts) > 1 and self.kernels == "small-batch" and not self.use_graphs
                and all(len(p[1]) <= EXACT_ROWS for p in parts))

    def _ragged_pass(self, layers, kinds, hidden: torch.Tensor, parts) -> torch.Tensor:
        """``hidden`` [N, d]: the rows of ``parts`` (view, rows, start, tree) end to end, through ``layers``."""
        bounds, lo = [], 0
        for _, rows, _, _ in parts:
            bounds.append((lo, lo + len(rows)))
            lo += len(rows)
        inputs = [view._pass_inputs(kinds, len(rows), start, tree) for view, rows, start, tree in parts]
        slots = torch.cat([i[0] for i in inputs])
        position_ids = torch.cat([i[1] for i in inputs], dim=1)
        masks = {kind: Ragged(tuple(bounds), tuple(i[2][kind] for i in inputs)) for kind in set(kinds)}
        cache = RaggedCache([view.cache for view, *_ in parts], bounds)
        with exact_rows():
            return self._run_layers(layers, kinds, hidden[None], slots, position_ids, masks, cache)[0]

    @torch.inference_mode()
    def shallow_many(self, parts):
        if not self._ragged(parts):
            return super().shallow_many(parts)
        for view, ids, start, _ in parts:
            check_start("shallow", start, view.cache.lengths[0])
        ids = torch.as_tensor([t for _, part_ids, _, _ in parts for t in part_ids], dtype=torch.long,
                              device=self.device)
        out = self._ragged_pass(self.shallow_layers, self.shallow_kinds, self.embed_tokens(ids[None])[0], parts)
        return list(out.split([len(p[1]) for p in parts]))

    @torch.inference_mode()
    def deep_many(self, parts):
        plain = [(view, hidden, start, tree) for view, hidden, start, _, tree in parts]
        if not self._ragged(plain):
            return super().deep_many(parts)
        for view, _, start, _, _ in parts:
            check_start("deep", start, view.cache.lengths[self.exit_layer])
        out = self.final_norm(self._ragged_pass(self.deep_layers, self.deep_kinds,
                                                torch.cat([p[1] for p in parts]), plain))
        states = out.split([p[1].shape[0] for p in parts])
        picked = [s if rows is None else s[list(rows)] for s, (_, _, _, rows, _) in zip(states, parts)]
        with exact_rows():
            logits = self.lm_head(torch.cat(picked)).split([p.shape[0] for p in picked])
        return [DeepOutput(logits=lg, hidden=st) for lg, st in zip(logits, states)]
