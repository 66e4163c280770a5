"""What differs between the transformers lines this package runs on (4.57.x and 5.x), found by feature, not by
version number, in one place.

========================== ============================================ ============================================
what                       transformers 4.57                            transformers 5.x
========================== ============================================ ============================================
a layer's KV cache keyword ``past_key_values=``                         ``cache=`` (``past_key_values`` deprecated)
``Cache.update`` extras    4th positional ``cache_kwargs`` dict         ``kwargs=`` (the layer's own keyword args)
RoPE base in the config    ``config.rope_theta``                        ``config.rope_parameters["rope_theta"]``
                                                                        (by layer type where RoPE differs per type)
Gemma 3's two RoPEs        ``rotary_emb`` + ``rotary_emb_local``; the   one ``rotary_emb(x, pos, layer_type)``; the
                           layer takes ``position_embeddings_global``   layer takes its own ``position_embeddings``
                           and ``position_embeddings_local``
``DynamicLayer``           ``lazy_initialization(key_states)``          ``lazy_initialization(key_states,
                                                                        value_states)``
========================== ============================================ ============================================

Both lines compute the same numbers from the same weights; only the names moved.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

#: transformers' layer type names (``config.layer_types``)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@functools.cache
def parameters_of(function) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(function).parameters)  # follows a decorator's __wrapped__
    except (TypeError, ValueError):
        return frozenset()


def cache_keyword(module) -> str:
    """The keyword a transformers module (a decoder layer, an attention module, a model) takes its KV cache by:
    ``cache`` (5.x) or ``past_key_values`` (4.x)."""
    return "cache" if "cache" in parameters_of(type(module).forward) else "past_key_values"


def update_kwargs(cache_kwargs: dict | None, extra: dict) -> dict:
    """The per-call extras an attention module hands ``Cache.update``: 4.x passes a ``cache_kwargs`` dict (its
    ``cache_position`` included), 5.x passes the layer's keyword arguments as ``kwargs=`` (what the caller gave the
    layer, so ``cache_position`` when the caller passed one)."""
    if cache_kwargs is not None:
        return cache_kwargs
    return extra.get("kwargs") or {}


def takes_layer_type(rotary: nn.Module) -> bool:
    """Whether a rotary module computes several RoPEs chosen by ``layer_type`` (5.x Gemma 3)."""
    return "layer_type" in parameters_of(type(rotary).forward)


class LayerRotary(nn.Module):
    """One layer type's RoPE of a rotary module that holds several (5.x Gemma 3): ``(x, position_ids) -> cos, sin``
    like every other family's rotary module, with the ``inv_freq`` and ``attention_scaling`` of that type."""

    def __init__(self, rotary: nn.Module, layer_type: str):
        super().__init__()
        self.rotary = rotary
        self.layer_type = layer_type

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.rotary, f"{self.layer_type}_inv_freq")

    @property
    def attention_scaling(self) -> float:
        return getattr(self.rotary, f"{self.layer_type}_attention_scaling", 1.0)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(x, position_ids, self.layer_type)


def rotary_for(rotary: nn.Module, layer_type: str = FULL_ATTENTION) -> nn.Module:
    """``rotary`` as a ``(x, position_ids)`` module: itself, or its ``layer_type`` RoPE where it holds several."""
    return LayerRotary(rotary, layer_type) if takes_layer_type(rotary) else rotary


def rope_theta(config, layer_type: str = FULL_ATTENTION, default: float = 10000.0) -> float:
    """The RoPE base of ``layer_type``'s layers: ``config.rope_theta`` (4.x; Gemma 3's sliding layers:
    ``rope_local_base_freq``) or from ``config.rope_parameters`` (5.x; nested by layer type where the types differ)."""
    local = getattr(config, "rope_local_base_freq", None) if layer_type == SLIDING_ATTENTION else None
    theta = local if local is not None else getattr(config, "rope_theta", None)
    if theta is not None:
        return theta
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params.get("rope_theta", default)


def nested_rope_parameters(config) -> bool:
    """Whether ``config.rope_parameters`` holds one dict per layer type (5.x Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    return isinstance(params, dict) and any(isinstance(params.get(t), dict) for t in (FULL_ATTENTION, SLIDING_ATTENTION))
