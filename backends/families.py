"""Decoder families: the one small description per transformers architecture that the split backends, the adapter and
the ONNX export read, instead of a copy of the backend per family.

What differs between the supported families, and where each difference is handled:

========== ====================================================================================================
family     what the split has to know
========== ====================================================================================================
llama      the reference layout: pre-norm attention + MLP, one rotary embedding, full causal attention
mistral    Llama's layout; every layer attends within ``sliding_window`` positions when the config sets one
qwen2      Llama's layout with q/k/v biases (carried by the linear modules); ``layer_types`` may mark sliding layers
qwen3      Qwen2's layout plus an RMSNorm on every head's queries and keys before RoPE (``q_norm`` / ``k_norm``)
gemma3     ``q_norm`` / ``k_norm``; sandwich norms (post-attention, pre- and post-feed-forward); sliding layers use
           their own RoPE base (transformers 4.x: the ``rotary_emb_local`` module; 5.x: ``rotary_emb``'s
           ``sliding_attention`` type) and a window; embeddings scaled by sqrt(hidden) inside the embedding module;
           RMSNorm computes ``x * (1 + w)``; attention scaled by ``query_pre_attn_scalar``
========== ====================================================================================================

Everything else is read from the model's own modules (``attn.scaling``, the norm and MLP modules as they are), so a
family is a name, the transformers module its classes live in, and two layout flags.
"""

from __future__ import annotations

import copy
import functools
import importlib

import attrs

from kangaroo_backends.hf_compat import (FULL_ATTENTION, SLIDING_ATTENTION, nested_rope_parameters, parameters_of,
                                         rotary_for)
from kangaroo_core.errors import ModelLoadError

FULL, SLIDING = "full", "sliding"


@attrs.frozen
class Family:
    """How one transformers decoder family is laid out."""

    name: str
    #: ``config.model_type`` values of this family
    model_types: tuple[str, ...]
    #: where its classes live and their prefix: ``transformers.models.<module>.modeling_<module>.<Prefix>Attention``
    module: str
    prefix: str
    #: Gemma 3: post-attention / pre- and post-feed-forward norms around the two blocks
    sandwich_norms: bool = False
    #: Gemma 3: sliding layers use another RoPE base (4.x: ``model.model.rotary_emb_local``; 5.x: the
    #: ``sliding_attention`` type of ``model.model.rotary_emb``)
    local_rotary: bool = False

    def module_class(self, part: str) -> type:
        """The family's own class for ``part`` (``Attention``, ``RMSNorm``, ``MLP``, ``RotaryEmbedding``)."""
        module = importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")
        return getattr(module, f"{self.prefix}{part}")

    @property
    def layer_takes_both_ropes(self) -> bool:
        """Whether a decoder layer takes both RoPEs and picks its own (transformers 4.x Gemma 3:
        ``position_embeddings_global`` / ``_local``) rather than only its kind's (``position_embeddings``)."""
        return self.local_rotary and _takes_both_ropes(self)

    def layer_rope_kwargs(self, full, sliding, kind: str) -> dict:
        """The rotary keyword arguments a decoder layer of this family takes (cos/sin pairs per layer kind)."""
        if self.layer_takes_both_ropes:
            return {"position_embeddings_global": full, "position_embeddings_local": sliding}
        return {"position_embeddings": sliding if kind == SLIDING else full}

    def mlp_norm(self, layer):
        """The norm in front of a layer's MLP (Gemma 3's pre-feed-forward norm; Llama's post-attention norm)."""
        return layer.pre_feedforward_layernorm if self.sandwich_norms else layer.post_attention_layernorm


@functools.cache
def _takes_both_ropes(family: Family) -> bool:
    return "position_embeddings_global" in parameters_of(family.module_class("DecoderLayer").forward)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "llama", "Llama"),
    Family("mistral", ("mistral",), "mistral", "Mistral"),
    Family("qwen2", ("qwen2",), "qwen2", "Qwen2"),
    Family("qwen3", ("qwen3",), "qwen3", "Qwen3"),
    Family("gemma3", ("gemma3_text",), "gemma3", "Gemma3", sandwich_norms=True, local_rotary=True),
)
SUPPORTED = tuple(t for family in FAMILIES for t in family.model_types)


class UnsupportedArchitectureError(ModelLoadError):
    """A model whose architecture has no family description."""


def family_of(config) -> Family:
    """The family of a transformers config, or a one-line refusal naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            break
    else:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, cap, None) is not None:
            raise UnsupportedArchitectureError(f"{model_type} with {cap}={getattr(config, cap)} is not supported "
                                               "(the split graphs do not soft-cap)")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(f"{model_type} with bidirectional attention is not a causal decoder")
    return family


def layer_kinds(config) -> tuple[str, ...]:
    """``full`` or ``sliding`` for every decoder layer (``layer_types`` where the config has them, else Mistral's
    rule: every layer slides when ``sliding_window`` is set)."""
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(SLIDING if t == "sliding_attention" else FULL for t in types)
    window = getattr(config, "sliding_window", None)
    return (SLIDING if window else FULL,) * config.num_hidden_layers


def sliding_window(config) -> int | None:
    """The window of the sliding layers (a query at position q sees keys at positions > q - window), or None."""
    return getattr(config, "sliding_window", None) if SLIDING in layer_kinds(config) else None


def adapter_config(config, exit_layer: int | None):
    """The config of a one-layer block built like layer ``exit_layer`` (its attention kind and RoPE), attending over
    the whole context: the adapter drafts, so a window would only hide context it may use."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    kind = layer_kinds(config)[exit_layer] if exit_layer is not None else FULL
    if getattr(config, "layer_types", None):
        one.layer_types = ["full_attention"]
    if hasattr(one, "sliding_window"):
        one.sliding_window = None
    if family_of(config).local_rotary and kind == SLIDING:
        if nested_rope_parameters(config):  # 5.x: the sliding layers' RoPE becomes the one full layer's
            local = copy.deepcopy(config.rope_parameters[SLIDING_ATTENTION])
            one.rope_parameters = {FULL_ATTENTION: local, SLIDING_ATTENTION: copy.deepcopy(local)}
        else:  # 4.x: as Gemma3TextModel builds rotary_emb_local
            one.rope_theta = config.rope_local_base_freq
            one.rope_scaling = {"rope_type": "default"}
    return one


def rotary_embeddings(model) -> dict[str, object]:
    """The model's rotary modules by layer kind, each ``(x, position_ids) -> (cos, sin)`` with its ``inv_freq``."""
    inner = model.model
    if not family_of(model.config).local_rotary:
        return {FULL: inner.rotary_emb, SLIDING: inner.rotary_emb}
    local = getattr(inner, "rotary_emb_local", None)  # transformers 4.x
    if local is not None:
        return {FULL: inner.rotary_emb, SLIDING: local}
    return {FULL: rotary_for(inner.rotary_emb, FULL_ATTENTION), SLIDING: rotary_for(inner.rotary_emb, SLIDING_ATTENTION)}

