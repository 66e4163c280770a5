"""The graph toolkit: the pieces every kangaroo ONNX graph is written, exported and validated with — the split target's
(:mod:`kangaroo_backends.onnx_export`) and the drafters' own (the Kangaroo adapter's,
:mod:`kangaroo_plugins.kangaroo.onnx_graph`).

* modules with explicit KV in/out: :class:`Attention` (any supported family's attention, lean for onnxruntime),
  :class:`AttentionCore` (its part that reads the cache, marked in the graph for
  :mod:`kangaroo_backends.ort_attention`), :class:`Rotary`, :func:`rope`, :func:`rotate_half_matrix`;
* the masks as inputs: :func:`attention_bias`, :func:`graph_biases`;
* export: :func:`export_graph`, :func:`dynamic_axes`, :data:`DEFAULT_OPSET`;
* validation against eager PyTorch: :func:`validate_outputs`, :func:`check_tolerance` (:data:`DEFAULT_TOLERANCE`),
  :func:`validation_tree` (:data:`VALIDATION_CASES`), :func:`torch_kv`, :func:`max_diff`, :func:`cpu_session`;
* :func:`import_onnxruntime`: onnxruntime, or the install hint (:data:`INSTALL_HINT`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kangaroo_backends import ort_attention
from kangaroo_backends.families import SLIDING, sliding_window
from kangaroo_backends.kv_cache import causal_mask
from kangaroo_backends.onnx_bundle import BIAS_INPUTS
from kangaroo_core.errors import MissingDependencyError, OnnxExportError

DEFAULT_OPSET = 17
#: accepted max |onnx - eager| relative to max(1, max |eager|) per output
DEFAULT_TOLERANCE = 1e-4
INSTALL_HINT = "pip install onnxruntime onnx (kangaroo's [onnx] extra)"


def import_onnxruntime():
    """``onnxruntime``, or a :class:`MissingDependencyError` with the install hint."""
    try:
        import onnxruntime
    except ImportError:
        raise MissingDependencyError(f"the ONNX backend needs onnxruntime: {INSTALL_HINT}") from None
    return onnxruntime


# -- modules with explicit KV ---------------------------------------------------------------------------------------
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [..., hd] with ``cos`` / ``sin`` broadcast to it (:class:`Rotary`'s)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R with x @ R == rotate_half(x) == cat(-x[half:], x[:half]) exactly (one ±1 per column, zeros elsewhere): one
    MatMul node in the graph instead of split, negate and concatenate."""
    half = head_dim // 2
    rotate = torch.zeros(head_dim, head_dim)
    rotate[torch.arange(half, head_dim), torch.arange(half)] = -1.0  # column j < half takes -x[j + half]
    rotate[torch.arange(half), torch.arange(half, head_dim)] = 1.0  # column j >= half takes x[j - half]
    return rotate


def attention_bias(n: int, past: int, window: int | None = None, tree=None, device=None) -> torch.Tensor:
    """The additive bias [1, 1, n, past+n] of n new rows after ``past`` cached slots: causal (windowed for a
    sliding layer: a query at position p reads keys at positions > p - ``window``), or ``tree``'s visibility."""
    if tree is not None:
        return tree.additive_mask(past + n, torch.float32, device, window=window)
    mask = causal_mask(n, past, torch.float32, device, window=window)  # the torch backend's own mask
    return torch.zeros(1, 1, n, past + n, device=device) if mask is None else mask  # None: one row sees every key


def graph_biases(config, kinds, n: int, past: int, tree=None, device=None) -> list[torch.Tensor]:
    """The bias inputs of a graph over layers of these ``kinds`` for n new rows after ``past`` slots."""
    window = sliding_window(config)
    return [attention_bias(n, past, window if kind == SLIDING else None, tree, device)
            for kind in BIAS_INPUTS if kind in set(kinds)]


class AttentionCore(nn.Module):
    """softmax(scale * q k^T + bias) v of the new rows over the cached and the new keys: the part of an attention
    that reads the cache. Its own module, so its nodes share one scope in the exported graph (``/attns.<i>/core/...``,
    recorded in the graph's metadata): the graph is standard ONNX everywhere, and a runtime may swap those nodes for
    its own kernel (:mod:`kangaroo_backends.ort_attention`: one that reads the cache where it lies instead of
    concatenating it).

    Inputs: ``q`` [1, n, H, hd] (after RoPE), ``k_new`` / ``v_new`` [1, n, kvh, hd], ``past_key`` / ``past_value``
    [1, past, kvh, hd], ``bias`` [1, 1, rep*n, T] (the grouped bias: row g*n + i is row i's). Output [1, n, H*hd].
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        self.heads, self.kv_heads, self.rep, self.head_dim, self.scaling = (heads, kv_heads, heads // kv_heads,
                                                                            head_dim, scaling)

    def forward(self, q, k_new, v_new, past_key, past_value, bias):
        heads, kv_heads, rep, hd = self.heads, self.kv_heads, self.rep, self.head_dim
        k = torch.cat([past_key, k_new], dim=1)  # [1, T, kvh, hd]
        v = torch.cat([past_value, v_new], dim=1)
        # head h = kv*rep + g (transformers' repeat_kv order) → [1, kvh, rep, n, hd] → [1, kvh, rep*n, hd]
        q = q.view(1, -1, kv_heads, rep, hd).permute(0, 2, 3, 1, 4).reshape(1, kv_heads, -1, hd)
        scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * self.scaling  # [1, kvh, rep*n, T]
        probs = torch.softmax(scores + bias, dim=-1)
        out = torch.matmul(probs, v.transpose(1, 2))  # [1, kvh, rep*n, hd]
        return out.view(1, kv_heads, rep, -1, hd).permute(0, 3, 1, 2, 4).reshape(1, -1, heads * hd)


class Attention(nn.Module):
    """A decoder attention (any family: the module's own projections, ``q_norm``/``k_norm`` where it has them, its
    ``scaling``) with explicit KV in/out ([1, seq, kvh, hd]) and an additive ``bias`` [1, 1, n, T] (causal or a
    token tree's, windowed for a sliding layer: see :func:`attention_bias`).

    Written for a lean graph (revision 2, measured: onnxruntime spends a few microseconds per node whatever it
    computes): batch 1 and the head sizes are Python constants, so no reshape asks the graph for a shape, and the
    ``rep`` query heads that share a KV head are stacked along the query axis ([1, kvh, rep*n, hd]) so the keys and
    values are used as they are, never expanded ``rep`` times. Each score is the same dot product as before.
    """

    def __init__(self, attn: nn.Module, config):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3, Gemma 3
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.rep = self.heads // self.kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.register_buffer("rotate_half", rotate_half_matrix(self.head_dim), persistent=False)
        self.core = AttentionCore(self.heads, self.kv_heads, self.head_dim, self.scaling)

    def grouped_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """[1, 1, n, T] → [1, 1, rep*n, T]: row g*n + i is query i's (the stacked query order); a graph with many
        layers tiles each bias once and passes ``grouped=True``."""
        return bias.repeat(1, 1, self.rep, 1) if self.rep > 1 else bias

    def forward(self, x, cos, sin, bias, past_key, past_value, grouped: bool = False):
        heads, kv_heads, hd = self.heads, self.kv_heads, self.head_dim
        q = self.q_proj(x).view(1, -1, heads, hd)  # [1, n, H, hd]
        k_new = self.k_proj(x).view(1, -1, kv_heads, hd)  # [1, n, kvh, hd]
        v_new = self.v_proj(x).view(1, -1, kv_heads, hd)
        if self.q_norm is not None:  # per-head RMSNorm (over hd) before RoPE
            q, k_new = self.q_norm(q), self.k_norm(k_new)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [1, n, 1, hd]
        q = q * cos + torch.matmul(q, self.rotate_half) * sin  # RoPE
        k_new = k_new * cos + torch.matmul(k_new, self.rotate_half) * sin
        attended = self.core(q, k_new, v_new, past_key, past_value, bias if grouped else self.grouped_bias(bias))
        return self.o_proj(attended), k_new, v_new


class Rotary(nn.Module):
    """A rotary embedding module's ``inv_freq`` and scaling as graph constants: ``position_ids`` [1, n] → cos, sin
    [1, n, hd]."""

    def __init__(self, rotary_emb: nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", rotary_emb.inv_freq.detach().float().clone(), persistent=False)
        self.scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq  # [1, n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


# -- export ---------------------------------------------------------------------------------------------------------
def export_graph(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str], dynamic: dict,
                  opset: int, mark_attention: bool = False) -> None:
    """``torch.onnx.export`` of ``module``; ``mark_attention``: the graph's metadata records where each
    :class:`AttentionCore` 's nodes are and its shapes (graph revision 6; see :mod:`kangaroo_backends.ort_attention`)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                          opset_version=opset, dynamo=False, do_constant_folding=True)
    if mark_attention:
        ort_attention.mark_attention(path, [m for m in module.modules() if isinstance(m, AttentionCore)])


def dynamic_axes(inputs: list[str], outputs: list[str], fixed: tuple[str, ...] = (),
                 special: dict[str, dict[int, str]] | None = None) -> dict[str, dict[int, str]]:
    """Axis 1 is ``past`` for past KV, ``n`` (new positions) for everything else but the ``fixed`` names; the bias
    inputs [1, 1, n, total]; ``special``: other names' own axes."""
    axes = {}
    for name in inputs + outputs:
        base = name.split(".")[0]
        if special and name in special:
            axes[name] = special[name]
        elif base in ("past_key", "past_value"):
            axes[name] = {1: "past"}
        elif base in BIAS_INPUTS.values():
            axes[name] = {2: "n", 3: "total"}
        elif base not in fixed:
            axes[name] = {1: "n"}
    return axes


# -- validation against eager PyTorch -------------------------------------------------------------------------------
def torch_kv(cache, layers) -> list[torch.Tensor]:
    """A KVCache's valid keys/values of ``layers`` as graph inputs, [1, seq, kvh, hd]."""
    out = []
    for i in layers:
        k, v = cache.layer(i)
        out += [k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()]
    return out


def max_diff(ort_outputs, references) -> tuple[float, float]:
    """The largest |onnx − eager| over the outputs and the largest reference magnitude (at least 1); infinite when
    the two differ in which values are finite."""
    diff, scale = 0.0, 1.0
    for got, ref in zip(ort_outputs, references):
        ref = ref.detach().float().cpu()
        if tuple(got.shape) != tuple(ref.shape):
            raise OnnxExportError(f"exported graph output shape {tuple(got.shape)} != eager {tuple(ref.shape)}")
        got = torch.from_numpy(got)
        finite = torch.isfinite(ref)  # -inf logits outside a draft vocabulary must stay exactly -inf
        if not torch.equal(finite, torch.isfinite(got)):
            return float("inf"), 1.0
        if finite.any():
            diff = max(diff, float((got[finite] - ref[finite]).abs().max()))
            scale = max(scale, float(ref[finite].abs().max()))
    return diff, scale


def cpu_session(path: Path):
    """An onnxruntime CPU session for validation (quiet); a graph with kangaroo's own ops gets their library."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    from kangaroo_backends import ort_attention

    ort_attention.register_if_used(path, options)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def validate_outputs(path: Path, inputs: list[str], cases) -> dict[str, Any]:
    """Run the exported graph on each ``(feed, references)`` case; the worst max |onnx − eager| and the largest
    reference magnitude (the tolerance is relative to it)."""
    session = cpu_session(path)
    worst, scale = 0.0, 1.0
    for feed, refs in cases:
        got = session.run(None, {k: v.detach().cpu().numpy() for k, v in zip(inputs, feed)})
        diff, ref_scale = max_diff(got, refs)
        worst, scale = max(worst, diff), max(scale, ref_scale)
    return {"max_abs_diff": worst, "max_abs_reference": scale}


def check_tolerance(name: str, check: dict[str, Any], tolerance: float) -> float:
    """The absolute limit for ``check``; an :class:`OnnxExportError` when the graph is off by more."""
    limit = tolerance * check["max_abs_reference"]
    if not check["max_abs_diff"] <= limit:
        raise OnnxExportError(f"the exported {name} graph differs from eager PyTorch by {check['max_abs_diff']:.3g} "
                              f"(> tolerance {limit:.3g}); export refused")
    return limit


def validation_tree():
    """The token tree the exported graphs are validated on: after 5 committed slots, rows at slots 5, 6, 7 where
    slot 6 is a sibling of slot 5 (same position, unseen by it) and slot 7 is slot 5's child."""
    from kangaroo_core.tree import TreeAttention

    return TreeAttention(committed=5, visible=[(5,), (6,), (5, 7)], positions=[5, 5, 6])


#: the validation cases every graph is checked on (recorded in its manifest): a prefill, a step after a cached
#: prefix, and :func:`validation_tree`
VALIDATION_CASES = "past=0,n=4; past=5,n=3; past=5, a 3-node tree"
