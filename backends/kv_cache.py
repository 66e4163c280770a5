"""A growable, preallocated KV cache that can be cropped in O(1).

transformers' attention layers only call ``cache.update(key, value, layer_idx, ...)`` (4.x: a ``cache_kwargs`` dict
after the index; 5.x: ``kwargs=``, the layer's keyword arguments); this class
implements that call with buffers that double when full, so appending one position does not copy the cache and
rolling back after rejected drafts only moves a length pointer.
"""

from __future__ import annotations

import torch


def check_start(what: str, start: int, length: int) -> None:
    """Positions are explicit: a call must append right after what the cache holds."""
    if start != length:
        raise RuntimeError(f"{what}: asked to write at position {start}, but the cache holds {length} positions")


class KVCache:
    """Keys/values for ``num_layers`` layers, shapes [1, kv_heads, capacity, head_dim]."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256,
                 device: torch.device | str = "cpu"):
        self.num_layers = num_layers
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs=None, **extra):
        start, n = self.lengths[layer_idx], key.shape[-2]
        end = start + n
        if end > self.keys[layer_idx].shape[-2]:
            self._grow(layer_idx, end)
        self.keys[layer_idx][:, :, start:end] = key
        self.values[layer_idx][:, :, start:end] = value
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def _grow(self, layer_idx: int, needed: int) -> None:
        capacity = self.keys[layer_idx].shape[-2]
        while capacity < needed:
            capacity *= 2
        for store in (self.keys, self.values):
            old = store[layer_idx]
            new = torch.empty((*old.shape[:2], capacity, old.shape[-1]), dtype=old.dtype, device=old.device)
            new[:, :, : self.lengths[layer_idx]] = old[:, :, : self.lengths[layer_idx]]
            store[layer_idx] = new

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer (O(1): only the length pointers move)."""
        self.lengths = [min(n, length) for n in self.lengths]

    def keep(self, positions) -> None:
        """Keep exactly these positions (ascending) of every layer, compacted to the front; a prefix is a crop."""
        positions = list(positions)
        prefix = next((i for i, p in enumerate(positions) if p != i), len(positions))
        if prefix == len(positions):
            return self.crop(len(positions))
        for i in range(self.num_layers):
            valid = [p for p in positions if p < self.lengths[i]]
            # only what moves is copied: slots before the first gap stay where they are
            moved = next((j for j, p in enumerate(valid) if p != j), len(valid))
            if moved < len(valid):
                index = torch.as_tensor(valid[moved:], dtype=torch.long, device=self.keys[i].device)
                for store in (self.keys, self.values):
                    store[i][:, :, moved: len(valid)] = store[i].index_select(2, index)
            self.lengths[i] = len(valid)

    def reset(self) -> None:
        self.lengths = [0] * self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid keys and values of one layer (views)."""
        end = self.lengths[layer_idx]
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]


def causal_mask(query_len: int, past_len: int, dtype: torch.dtype, device=None,
                window: int | None = None) -> torch.Tensor | None:
    """Additive mask [1, 1, q, past+q] letting query i see keys 0..past+i; None for one query (sees all).

    ``window`` (sliding-window layers): query i, at position past+i, sees only keys at positions > past+i - window
    (transformers' ``sliding_window_overlay``); the cache keeps every key, the mask hides the old ones."""
    total = past_len + query_len
    if window is not None and total <= window:
        window = None  # nothing is old enough to hide
    if query_len == 1 and window is None:
        return None
    blocked = torch.ones(query_len, total, dtype=torch.bool, device=device).triu(past_len + 1)
    if window is not None:
        blocked |= torch.ones(query_len, total, dtype=torch.bool, device=device).tril(past_len - window)
    mask = torch.zeros(query_len, total, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)
    return mask[None, None]
