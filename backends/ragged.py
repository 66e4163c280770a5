"""Ragged passes: the rows of several streams in one pass of the torch backend (vLLM's flattened batch).

The rows of all streams are laid end to end as one sequence [1, N, d]: every linear layer reads its weights once
for all of them, and each row is still computed alone (the small-batch kernel in chunks of 8 rows, see
:func:`exact_rows`). Attention is the only step that mixes rows, so it runs stream by stream: each stream's rows
write their keys/values into that stream's own cache and attend over it with their own mask, exactly as in a
pass of that stream alone. On CPU float32 a stream's tokens are therefore bit for bit what it decodes alone,
whatever shares its passes: batch invariance by construction.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import attrs
import torch

_EXACT = threading.local()


@contextlib.contextmanager
def exact_rows():
    """Within: the small-batch linear kernel runs every row count (chunks of 8 rows, each row alone), not only
    passes of up to 16 rows; a ragged pass of many streams must compute each row as its stream's pass would."""
    _EXACT.on = True
    try:
        yield
    finally:
        _EXACT.on = False


def exact_rows_on() -> bool:
    return getattr(_EXACT, "on", False)


@attrs.frozen
class Ragged:
    """One tensor per stream, and the row range [lo, hi) of each stream in the pass."""

    bounds: tuple[tuple[int, int], ...]
    parts: tuple


class RaggedCache:
    """What the layers see as ``past_key_values`` in a ragged pass: each stream's rows go to that stream's cache,
    and attention receives each stream's keys/values (:class:`Ragged`) to attend over stream by stream."""

    def __init__(self, caches: Sequence, bounds: Sequence[tuple[int, int]]):
        self.caches, self.bounds = list(caches), tuple(bounds)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs=None, **extra):
        keys, values = [], []
        for cache, (lo, hi) in zip(self.caches, self.bounds):
            k, v = cache.update(key[:, :, lo:hi], value[:, :, lo:hi], layer_idx, cache_kwargs, **extra)
            keys.append(k)
            values.append(v)
        return Ragged(self.bounds, tuple(keys)), Ragged(self.bounds, tuple(values))


def ragged_attention(attend, module, query, key: Ragged, value: Ragged, mask: Ragged, **kwargs):
    """``attend`` (an attention function [1, H, q, d] → [1, q, H, d]) stream by stream over a ragged pass."""
    outs = [attend(module, query[:, :, lo:hi], k, v, m, **kwargs)[0]
            for (lo, hi), k, v, m in zip(key.bounds, key.parts, value.parts, mask.parts)]
    return torch.cat(outs, dim=1), None
