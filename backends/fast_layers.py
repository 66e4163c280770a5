"""The torch backend's fast path for verify-sized passes: its own view of the decoder layers, weights shared.

Two changes, both measured (``kangaroo profile``, docs/backends.md), both exact re-orderings of the same arithmetic:

* every ``nn.Linear`` becomes :class:`SmallBatchLinear`: up to 16 rows go through the streaming kernel of
  :mod:`kangaroo_backends.native` (a BLAS GEMM re-packs the weights on every call; the kernel reads them once, 8
  rows at a time per block of weights), more rows through ``F.linear`` (any number in a ragged pass of many
  streams, :func:`~kangaroo_backends.ragged.exact_rows`);
* attention over up to 16 new rows runs the small-batch attention kernel (row-independent: a row's result does not
  depend on the rows that came with it, so a verify pass reproduces the one-position passes bit for bit, as the
  linear kernel does); longer passes (the prompt) and other dtypes run grouped-query SDPA without materialising
  repeated keys/values (transformers copies K/V ``n_rep`` times whenever a mask is passed): the query heads that
  share a KV head are stacked along the query axis, so the KV heads are used as they are.

With both kernels every operation of a pass over n <= 16 rows treats each row alone (the rest is elementwise or
per-row), so on CPU float32 Kangaroo's verify passes compute exactly what the target alone computes one position at
a time: token identity by construction, not only up to near-ties.

The user's model object is never modified: layers are shallow-copied module by module (parameters shared, no weight
copied) and the copies' attention reads its own copy of the config naming the grouped attention function.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kangaroo_backends.native import MAX_ROWS
from kangaroo_backends.ragged import Ragged, exact_rows_on, ragged_attention

#: passes of up to this many rows run the kernels (exact per row): a verify pass of gamma <= 15 drafts or a token tree
#: of up to 16 nodes; longer passes (prompts) run BLAS and SDPA, where a GEMM is efficient
EXACT_ROWS = 2 * MAX_ROWS

GROUPED_ATTENTION = "kangaroo_grouped_sdpa"


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each row computed alone by the streaming kernel where it applies: CPU
    float32, up to :data:`EXACT_ROWS` rows (every row count under :func:`~kangaroo_backends.ragged.exact_rows`); a
    row's result then does not depend on the rows that came with it. Called for every linear layer of every pass:
    the Python around the kernel call is kept to a few attribute reads (no views made per call)."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features
    if (kernel is None or (rows > EXACT_ROWS and not exact_rows_on()) or x.dtype is not torch.float32
            or weight.dtype is not torch.float32 or not x.is_cpu):
        return F.linear(x, weight, bias)
    if not x.is_contiguous():
        x = x.contiguous()
    out_features = weight.shape[0]
    out = x.new_empty((*x.shape[:-1], out_features))
    # every row alone, whatever their number: the kernel takes them 8 at a time over each block of weights
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, in_features, out_features, torch.get_num_threads())
    if bias is not None:
        out += bias
    return out


class SmallBatchLinear(torch.nn.Module):
    """``F.linear`` without bias whose few-row calls run the streaming kernel (weight shared with the original)."""

    def __init__(self, linear: torch.nn.Linear, kernel):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias, self.kernel)


def kernel_attention(kernel, query, key, value, attention_mask, scaling) -> torch.Tensor | None:
    """The small-batch attention kernel's output [b, q, H, d], or None where it does not apply (then SDPA runs).

    Shapes: query [1, H, q, d] (any head and row strides: the projection's [1, q, H, d] output transposed is read
    as it is, not copied); key/value [1, Hkv, k, d] (views of the cache: rows of d contiguous);
    attention_mask additive [1, 1, q, >= k] or None."""
    b, heads, q, d = query.shape
    keys = key.shape[-2]
    if (b != 1 or q > EXACT_ROWS or query.dtype != torch.float32 or key.dtype != torch.float32
            or query.device.type != "cpu" or key.stride()[-2:] != (d, 1) or value.stride() != key.stride()):
        return None
    if query.stride(-1) != 1:
        query = query.contiguous()
    mask = None
    if attention_mask is not None:
        mask = attention_mask[0, 0, :, :keys]
        if mask.dtype != torch.float32 or mask.stride(-1) != 1:
            mask = mask.to(torch.float32).contiguous()
    out = torch.empty(1, q, heads, d, dtype=query.dtype)
    scale = float(scaling) if scaling is not None else d ** -0.5
    if kernel(query.data_ptr(), key.data_ptr(), value.data_ptr(), 0 if mask is None else mask.data_ptr(),
              out.data_ptr(), heads, key.shape[1], q, keys, d, query.stride(1), query.stride(2), key.stride(1),
              key.stride(2), 0 if mask is None else mask.stride(0),
              scale, torch.get_num_threads()) != 0:
        raise MemoryError("small-batch attention: out of memory")
    return out


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention with the query heads of one KV head stacked: [1, H, q, d] -> [1, Hkv, g*q, d];
    a pass over up to 16 rows runs the small-batch attention kernel instead where the attention module has one.

    Shapes: query [b, H, q, d]; key/value [b, Hkv, k, d]; attention_mask additive [b, 1, q, k] or None.
    """
    if isinstance(key, Ragged):  # several streams' rows: each attends over its own cache (kangaroo_backends.ragged)
        return ragged_attention(grouped_sdpa, module, query, key, value, attention_mask, dropout=dropout,
                                scaling=scaling, is_causal=is_causal, **kwargs)
    kernel = getattr(module, "attention_kernel", None)
    if kernel is not None and not dropout and kwargs.get("softcap") is None:
        out = kernel_attention(kernel, query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
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


def _clone(module: torch.nn.Module, kernel, attention_kernel, config) -> torch.nn.Module:
    if isinstance(module, torch.nn.Linear):
        return SmallBatchLinear(module, kernel) if kernel is not None else module
    twin = copy.copy(module)  # shares parameters and buffers; the children dict is replaced below
    twin._modules = {name: _clone(child, kernel, attention_kernel, config) for name, child in module._modules.items()}
    if getattr(module, "config", None) is not None and hasattr(module, "num_key_value_groups"):
        twin.config = config  # the attention module: dispatches on config._attn_implementation
        twin.attention_kernel = attention_kernel  # read by grouped_sdpa
    return twin


def with_row_kernel(module: torch.nn.Module, kernel) -> torch.nn.Module:
    """A copy of ``module`` sharing every weight whose ``nn.Linear`` children run :class:`SmallBatchLinear` (the
    drafter's network: its rows computed alone, so a merged draft step equals each stream's own)."""
    if isinstance(module, torch.nn.Linear):
        return SmallBatchLinear(module, kernel)
    twin = copy.copy(module)
    twin._modules = {name: with_row_kernel(child, kernel) for name, child in module._modules.items()}
    return twin


def fast_layers(layers, kernel, config, attention_kernel=None) -> torch.nn.ModuleList:
    """Copies of ``layers`` sharing every weight, with small-batch linears (if ``kernel``) and grouped attention
    (through the small-batch attention kernel for up to 16 rows, if ``attention_kernel``)."""
    grouped = copy.copy(config)
    grouped._attn_implementation = GROUPED_ATTENTION
    return torch.nn.ModuleList(_clone(layer, kernel, attention_kernel, grouped) for layer in layers)
