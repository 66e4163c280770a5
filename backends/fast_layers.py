"""The torch backend's fast path for verify-sized passes: its own view of the decoder layers, weights shared.

Two changes, both measured (``kangaroo profile``, docs/backends.md), both exact re-orderings of the same arithmetic:

* every ``nn.Linear`` becomes :class:`SmallBatchLinear`: up to 8 rows go through the streaming kernel of
  :mod:`kangaroo_backends.native` (a BLAS GEMM re-packs the weights on every call; the kernel reads them once), more
  rows through ``F.linear``;
* attention runs grouped-query SDPA without materialising repeated keys/values (transformers copies K/V ``n_rep``
  times whenever a mask is passed, i.e. on every multi-position pass): the query heads that share a KV head are
  stacked along the query axis, so the KV heads are used as they are.

The user's model object is never modified: layers are shallow-copied module by module (parameters shared, no weight
copied) and the copies' attention reads its own copy of the config naming the grouped attention function.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kangaroo_backends.native import MAX_ROWS

GROUPED_ATTENTION = "kangaroo_grouped_sdpa"


class SmallBatchLinear(torch.nn.Module):
    """``F.linear`` without bias whose few-row calls run the streaming kernel (weight shared with the original)."""

    def __init__(self, linear: torch.nn.Linear, kernel):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        self.kernel(flat.data_ptr(), self.weight.data_ptr(), out.data_ptr(), rows, self.in_features,
                    self.out_features, torch.get_num_threads())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention with the query heads of one KV head stacked: [1, H, q, d] -> [1, Hkv, g*q, d].

    Shapes: query [b, H, q, d]; key/value [b, Hkv, k, d]; attention_mask additive [b, 1, q, k] or None.
    """
    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    stacked = query.reshape(b, kv_heads, groups * q, d)  # head h = kv*groups + g, so this is a view
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
        mask = mask.expand(b, 1, q, key.shape[-2]).repeat(1, 1, groups, 1)  # row g*q + i is query i's row
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=False)
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa)


def _clone(module: torch.nn.Module, kernel, config) -> torch.nn.Module:
    if isinstance(module, torch.nn.Linear):
        return SmallBatchLinear(module, kernel) if kernel is not None else module
    twin = copy.copy(module)  # shares parameters and buffers; the children dict is replaced below
    twin._modules = {name: _clone(child, kernel, config) for name, child in module._modules.items()}
    if getattr(module, "config", None) is not None and hasattr(module, "num_key_value_groups"):
        twin.config = config  # the attention module: dispatches on config._attn_implementation
    return twin


def fast_layers(layers, kernel, config) -> torch.nn.ModuleList:
    """Copies of ``layers`` sharing every weight, with small-batch linears (if ``kernel``) and grouped attention."""
    grouped = copy.copy(config)
    grouped._attn_implementation = GROUPED_ATTENTION
    return torch.nn.ModuleList(_clone(layer, kernel, grouped) for layer in layers)
