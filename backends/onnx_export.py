"""Export the split target (shallow M[:l], deep M[l:] + final norm, the LM head) to ONNX, and the graph toolkit
drafters use to export their own networks (:class:`Attention`, :class:`Rotary`, :func:`export_graph`,
:func:`validate_outputs`).

Why not optimum's exporters: they export whole ``*ForCausalLM`` models (input_ids → logits); the Kangaroo loop needs
the target split at the exit layer (the deep part takes layer-l *hidden states*, not token ids), so the sub-networks are
wrapped as small ``nn.Module`` s here and exported with ``torch.onnx.export``. A drafter's graph (the Kangaroo
adapter's, :mod:`kangaroo_plugins.kangaroo.onnx_graph`) is the drafter's own business: it is exported by the drafter
plugin into the backend's :meth:`~kangaroo_backends.onnx_backend.OnnxBackend.artifact_dir`.

Graphs (``i`` runs over the graph's own layers, numbered from 0; ``kvh`` KV heads, ``hd`` head dim):

* ``shallow.onnx``: ``input_ids`` [1, n] int64, ``position_ids`` [1, n] int64 (RoPE positions), ``attention_bias``
  [1, 1, n, past+n] float32 (0 where row i may read slot j, the float's minimum elsewhere; ``sliding_bias`` too when
  the graph has sliding-window layers), ``past_key.i`` / ``past_value.i`` [1, past, kvh, hd] → ``hidden`` [1, n, d]
  (layer-l states), ``new_key.i`` / ``new_value.i`` [1, n, kvh, hd].
* ``deep.onnx``: ``hidden`` [1, n, d], ``position_ids``, the biases, the past KV of layers l..L-1 → ``final_hidden``
  [1, n, d] (after the final norm: the LM head's input, and the deep context a drafter may read), ``new_key.i`` /
  ``new_value.i``.
* ``head.onnx``: ``final_hidden`` [1, r, d] → ``logits`` [1, r, V]: run only on the rows whose logits are needed
  (the prefill needs one row, not [prompt, V]).

KV layout is [batch, seq, kv_heads, head_dim] and graphs return only the *new* positions' keys/values: the caller
appends them to its own cache, so a batch-1 cache cropped to its first ``t`` positions is a contiguous prefix (see
:mod:`kangaroo_backends.onnx_backend`). All graphs are float32.

Why the mask is an input (format 3): a token tree's rows see the committed prefix and their own ancestors only, which
no rule on position ids can express (siblings share a position); the caller builds the causal bias of a chain call
(:func:`attention_bias`) or the tree's (:meth:`~kangaroo_core.tree.TreeAttention.additive_mask`), one per layer kind.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kangaroo_backends.families import FULL, SLIDING, family_of, layer_kinds, rotary_embeddings, sliding_window
from kangaroo_backends.kv_cache import causal_mask
from kangaroo_backends.gguf_nbits import rows_at_once, rows_layout
from kangaroo_core.errors import MissingDependencyError, OnnxExportError

MANIFEST = "manifest.json"
FORMAT = "kangaroo-onnx"
FORMAT_VERSION = 3
#: how the graphs are written inside an unchanged interface (2: the lean attention of :class:`Attention`; 3: 4-bit
#: products row by row, :func:`~kangaroo_backends.gguf_nbits.row_by_row`; 4: int8-activation graphs multiply all rows
#: at once, :func:`~kangaroo_backends.gguf_nbits.rows_at_once`; 5: int8-activation exports prefill the prompt in
#: graphs of their own at float32 activations, :data:`PREFILL_ACCURACY_LEVEL`); recorded in the manifest and part of
#: the export cache's key, so a cached export of an older revision is re-exported, while a bundle of an older revision
#: still loads (same inputs and outputs; an older 4-bit bundle runs the target alone only); 6: the metadata marks each
#: layer's attention over the cache (:class:`AttentionCore`), which the CPU runner swaps for an op reading the cache
#: in place (:mod:`kangaroo_backends.ort_attention`)
GRAPH_REVISION = 6
#: the MatMulNBits accuracy level of an int8-activation export's prefill graphs (the prompt's pass, nothing cached
#: yet): float32 activations. Why: onnxruntime's int8-activation kernel is fast for a few rows but slow for hundreds —
#: measured on 2026-12-04's Intel Xeon (2 threads, SmolLM2 shapes, 773 rows): 208-273 G/s at level 4 against
#: 361-373 at level 1 and 415-454 for float32 MatMul; SmolLM2's deep graph prefills a 773-token prompt in 950 ms
#: instead of 1,200 (1 thread: 1,545 instead of 2,126). The prompt's pass is the same pass for the target alone and
#: for Kangaroo (both prefill the same prompt at position 0), so this keeps Kangaroo equal to its target alone; every
#: later pass (one row, or a verify pass) runs the int8 graphs.
PREFILL_ACCURACY_LEVEL = 1
#: the export cache's directory name under ``onnx/``
EXPORT_KEY = f"v{FORMAT_VERSION}.{GRAPH_REVISION}"
DEFAULT_OPSET = 17
#: accepted max |onnx - eager| relative to max(1, max |eager|) per output
DEFAULT_TOLERANCE = 1e-4
#: the same, for graphs whose activations are quantized (MatMulNBits accuracy levels 2-4): lossy by choice, so only a
#: sanity bound; the block mapping itself is what level 1 validates strictly (int8 activations on random inputs:
#: measured 7 % of the output's magnitude on a tiny random model, 27 % through SmolLM2's 28 deep layers)
LOSSY_TOLERANCE = 1.0
WEIGHTS = ("float32", "gguf")
GRAPHS = ("shallow", "deep", "head")
#: the bias input of each layer kind (a graph takes the ones its layers use)
BIAS_INPUTS = {FULL: "attention_bias", SLIDING: "sliding_bias"}
INSTALL_HINT = "pip install 'kangaroo-decoding[onnx]'"


def import_onnxruntime():
    """``onnxruntime``, or a :class:`MissingDependencyError` with the install hint."""
    try:
        import onnxruntime
    except ImportError:
        raise MissingDependencyError(f"the ONNX backend needs onnxruntime: {INSTALL_HINT}") from None
    return onnxruntime


# -- the wrapped sub-networks ---------------------------------------------------------------------------------------
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
    def __init__(self, rotary_emb: nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", rotary_emb.inv_freq.detach().float().clone(), persistent=False)
        self.scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq  # [1, n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


class _Layers(nn.Module):
    """Decoder layers ``first..last-1`` with explicit KV; returns hidden states and the new keys/values of each layer.
    The family decides the norms around the blocks (Gemma 3's sandwich norms) and each layer's RoPE and window."""

    def __init__(self, model, first: int, last: int):
        super().__init__()
        config = model.config
        family = family_of(config)
        layers = model.model.layers[first:last]
        self.kinds = list(layer_kinds(config)[first:last])
        self.bias_kinds = [kind for kind in BIAS_INPUTS if kind in self.kinds]  # the order of the bias inputs
        rotary = rotary_embeddings(model)
        self.rotaries = nn.ModuleDict({kind: Rotary(rotary[kind]) for kind in dict.fromkeys(self.kinds)})
        self.norms1 = nn.ModuleList([layer.input_layernorm for layer in layers])
        self.attns = nn.ModuleList([Attention(layer.self_attn, config) for layer in layers])
        self.norms2 = nn.ModuleList([family.mlp_norm(layer) for layer in layers])
        self.mlps = nn.ModuleList([layer.mlp for layer in layers])
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.post_attn = nn.ModuleList([layer.post_attention_layernorm for layer in layers])
            self.post_mlp = nn.ModuleList([layer.post_feedforward_layernorm for layer in layers])

    def run(self, hidden, position_ids, rest):
        """``rest``: the graph's bias inputs (:attr:`bias_kinds` order), then the past keys/values."""
        grouped = self.attns[0].grouped_bias if len(self.attns) else (lambda bias: bias)
        biases = {kind: grouped(bias) for kind, bias in zip(self.bias_kinds, rest)}  # tiled once, not per layer
        past = rest[len(self.bias_kinds):]
        rope = {kind: rotary(position_ids) for kind, rotary in self.rotaries.items()}
        new = []
        for i, attn in enumerate(self.attns):
            cos, sin = rope[self.kinds[i]]
            attended, k, v = attn(self.norms1[i](hidden), cos, sin, biases[self.kinds[i]], past[2 * i], past[2 * i + 1],
                                 grouped=True)
            if self.sandwich:
                attended = self.post_attn[i](attended)
            hidden = hidden + attended
            mixed = self.mlps[i](self.norms2[i](hidden))
            if self.sandwich:
                mixed = self.post_mlp[i](mixed)
            hidden = hidden + mixed
            new += [k, v]
        return hidden, new


class ShallowGraph(_Layers):
    def __init__(self, model, exit_layer: int):
        super().__init__(model, 0, exit_layer)
        self.embed = model.model.embed_tokens  # Gemma 3's multiplies by sqrt(hidden) itself

    def forward(self, input_ids, position_ids, *rest):
        hidden, new = self.run(self.embed(input_ids), position_ids, rest)
        return (hidden, *new)


class DeepGraph(_Layers):
    def __init__(self, model, exit_layer: int):
        super().__init__(model, exit_layer, model.config.num_hidden_layers)
        self.norm = model.model.norm

    def forward(self, hidden, position_ids, *rest):
        hidden, new = self.run(hidden, position_ids, rest)
        return (self.norm(hidden), *new)


class HeadGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.head = model.lm_head

    def forward(self, final_hidden):
        return self.head(final_hidden)


# -- names and shapes -----------------------------------------------------------------------------------------------
def kv_names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}_{kind}.{i}" for i in range(layers) for kind in ("key", "value")]


def bias_names(kinds) -> list[str]:
    """The bias inputs of a graph whose layers are of these kinds (one per kind, in :data:`BIAS_INPUTS` order)."""
    return [name for kind, name in BIAS_INPUTS.items() if kind in set(kinds)]


def graph_io(name: str, config, exit_layer: int) -> tuple[list[str], list[str]]:
    """Input and output names of one of the backend's graphs for a model of this ``config``."""
    if name == "head":
        return ["final_hidden"], ["logits"]
    num_layers = config.num_hidden_layers
    kinds = {"shallow": layer_kinds(config)[:exit_layer], "deep": layer_kinds(config)[exit_layer:]}[name]
    first = {"shallow": "input_ids", "deep": "hidden"}[name]
    outputs = {"shallow": ["hidden"], "deep": ["final_hidden"]}[name]
    layers = {"shallow": exit_layer, "deep": num_layers - exit_layer}[name]
    return ([first, "position_ids", *bias_names(kinds), *kv_names("past", layers)],
            [*outputs, *kv_names("new", layers)])


def _shapes(names: list[str], dims: dict[str, list]) -> dict[str, list]:
    return {n: dims[n.split(".")[0]] for n in names}


def _dims(d: int, vocab: int, kvh: int, hd: int) -> dict[str, list]:
    kv_past, kv_new = [1, "past", kvh, hd], [1, "n", kvh, hd]
    bias = [1, 1, "n", "total"]
    return {"input_ids": [1, "n"], "position_ids": [1, "n"], "attention_bias": bias, "sliding_bias": bias,
            "hidden": [1, "n", d], "final_hidden": [1, "n", d],
            "logits": [1, "n", vocab], "past_key": kv_past, "past_value": kv_past, "new_key": kv_new,
            "new_value": kv_new}


# -- export ---------------------------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    out = {}
    for dist in ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "kangaroo-decoding", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def export_graph(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str], dynamic: dict,
                  opset: int, mark_attention: bool = False) -> None:
    """``torch.onnx.export`` of ``module``; ``mark_attention``: the graph's metadata records where each
    :class:`AttentionCore` 's nodes are and its shapes (graph revision 6; see :mod:`kangaroo_backends.ort_attention`)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                          opset_version=opset, dynamo=False, do_constant_folding=True)
    if mark_attention:
        from kangaroo_backends import ort_attention

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


def torch_kv(cache, layers) -> list[torch.Tensor]:
    """A KVCache's valid keys/values of ``layers`` as graph inputs, [1, seq, kvh, hd]."""
    out = []
    for i in layers:
        k, v = cache.layer(i)
        out += [k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()]
    return out


def max_diff(ort_outputs, references) -> tuple[float, float]:
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
    """An onnxruntime CPU session for validation (quiet)."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3
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


def graph_biases(config, kinds, n: int, past: int, tree=None, device=None) -> list[torch.Tensor]:
    """The bias inputs of a graph over layers of these ``kinds`` for n new rows after ``past`` slots."""
    window = sliding_window(config)
    return [attention_bias(n, past, window if kind == SLIDING else None, tree, device)
            for kind in BIAS_INPUTS if kind in set(kinds)]


def validation_tree():
    """The token tree the exported graphs are validated on: after 5 committed slots, rows at slots 5, 6, 7 where
    slot 6 is a sibling of slot 5 (same position, unseen by it) and slot 7 is slot 5's child."""
    from kangaroo_core.tree import TreeAttention

    return TreeAttention(committed=5, visible=[(5,), (6,), (5, 7)], positions=[5, 5, 6])


VALIDATION_CASES = "past=0,n=4; past=5,n=3; past=5, a 3-node tree"


def _cases(name: str, model, exit_layer: int, seed: int = 0):
    """Random inputs and eager references (TorchBackend) for one graph: a 4-position prefill (no past), a
    3-position step after 5 cached positions, and a 3-node token tree after 5 cached positions."""
    from kangaroo_backends.torch_eager import TorchBackend

    gen = torch.Generator().manual_seed(seed)
    config = model.config
    vocab, d = config.vocab_size, config.hidden_size
    kinds = {"shallow": layer_kinds(config)[:exit_layer], "deep": layer_kinds(config)[exit_layer:]}.get(name, ())
    for past, n, tree in ((0, 4, None), (5, 3, None), (5, 3, validation_tree())):
        backend = TorchBackend(model, SimpleNamespace(eos_token_id=None), exit_layer)
        ids = torch.randint(0, vocab, (past + n,), generator=gen)
        positions = torch.arange(past, past + n)[None] if tree is None else tree.position_ids()[None]
        biases = graph_biases(config, kinds, n, past, tree)
        if name == "shallow":
            if past:
                backend.shallow(ids[:past].tolist(), 0)
            past_kv = torch_kv(backend.cache, range(exit_layer))
            hidden = backend.shallow(ids[past:].tolist(), past, tree=tree)
            yield ([ids[None, past:], positions, *biases, *past_kv],
                   [hidden[None], *[t[:, past:] for t in torch_kv(backend.cache, range(exit_layer))]])
        elif name == "deep":
            states = torch.randn(past + n, d, generator=gen)
            layers = range(exit_layer, backend.num_layers)
            if past:
                backend.deep(states[:past], 0)
            past_kv = torch_kv(backend.cache, layers)
            out = backend.deep(states[past:], past, tree=tree)
            yield ([states[None, past:], positions, *biases, *past_kv],
                   [out.hidden[None], *[t[:, past:] for t in torch_kv(backend.cache, layers)]])
        elif tree is None:
            final = torch.randn(1, n, d, generator=gen)
            with torch.inference_mode():
                yield [final], [model.lm_head(final)]


def export_onnx(model, out_dir: str | os.PathLike, *, exit_layer: int, fingerprint: str | None = None, model_name: str = "model", opset: int = DEFAULT_OPSET,
                tolerance: float = DEFAULT_TOLERANCE, overwrite: bool = False, quiet: bool = False,
                weights: str = "float32", gguf_path: str | os.PathLike | None = None,
                accuracy_level: int = 1) -> dict[str, Any]:
    """Export the shallow / deep / head graphs of ``model`` (a transformers decoder of a supported family) split at ``exit_layer`` into ``out_dir``.

    Every graph is validated against eager PyTorch before the export is declared good; the export is written to a
    temporary directory and renamed into place, so a failed or refused export leaves nothing behind.
    ``weights="gguf"``: every linear layer then runs ``MatMulNBits`` over the GGUF file's own blocks
    (:mod:`kangaroo_backends.gguf_nbits`; ``model`` must be that file's float32 dequantization, which is what
    :func:`~kangaroo_backends.loading.load_model` gives) and is validated against the float32 model again: at
    ``accuracy_level`` 0/1 to the same tolerance (same weights, float32 activations), above (2 fp16, 3 bf16, 4 int8 activations: lossy)
    to :data:`LOSSY_TOLERANCE`. Returns the manifest.
    """
    import_onnxruntime()
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
    except ImportError:
        raise MissingDependencyError(f"exporting to ONNX needs the onnx package: {INSTALL_HINT}") from None
    from kangaroo_backends.torch_eager import model_fingerprint

    out_dir = Path(out_dir)
    if out_dir.is_file() or (out_dir.exists() and any(out_dir.iterdir()) and not overwrite):
        raise OnnxExportError(f"{out_dir} exists and is not empty")
    num_layers = model.config.num_hidden_layers
    if not 1 <= exit_layer < num_layers:
        raise OnnxExportError(f"exit_layer must be in [1, {num_layers - 1}] for this {num_layers}-layer model, got {exit_layer}")
    if weights not in WEIGHTS:
        raise OnnxExportError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if not 0 <= int(accuracy_level) <= 4:
        raise OnnxExportError(f"accuracy_level must be 0..4, got {accuracy_level!r}")
    nbits = None
    if weights == "gguf":
        from kangaroo_backends.gguf_nbits import read_linear_weights

        if gguf_path is None:
            raise OnnxExportError("weights='gguf' needs the GGUF file the model was loaded from")
        nbits = read_linear_weights(gguf_path, model.config)
    if fingerprint is None:
        fingerprint = model_fingerprint(model)
    model = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    model = model.eval()
    cfg = model.config
    kvh = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dims = _dims(cfg.hidden_size, cfg.vocab_size, kvh, hd)

    with atomic_directory(out_dir) as tmp:
        graphs = {}
        modules = {"shallow": ShallowGraph(model, exit_layer), "deep": DeepGraph(model, exit_layer),
                   "head": HeadGraph(model)}
        for name, module in modules.items():
            inputs, outputs = graph_io(name, cfg, exit_layer)
            n, past = 2, 3
            first = torch.zeros(1, n, dtype=torch.long) if name == "shallow" else torch.randn(1, n, cfg.hidden_size)
            biases = [attention_bias(n, past) for i in inputs if i in BIAS_INPUTS.values()]
            kv = [torch.randn(1, past, kvh, hd) for i in inputs if i.startswith("past_")]
            args = (first,) if name == "head" else (first, torch.arange(past, past + n)[None], *biases, *kv)
            file = tmp / f"{name}.onnx"
            if not quiet:
                print(f"kangaroo: exporting {name}.onnx", file=sys.stderr)
            try:
                export_graph(module.eval(), args, file, inputs, outputs, dynamic_axes(inputs, outputs), opset,
                             mark_attention=name != "head")
            except Exception as exc:
                raise OnnxExportError(f"torch.onnx.export failed for the {name} graph: {exc}") from exc
            check = validate_outputs(file, inputs, _cases(name, model, exit_layer))
            limit = check_tolerance(name, check, tolerance)
            quantized, prefill = None, {}
            if nbits is not None:
                one_by_one = not rows_at_once(accuracy_level)
                # the prefill's own graph, rows at once: at the same level when the other graphs go row by row (see
                # gguf_nbits.row_by_row), at float32 activations when they are int8 ones (PREFILL_ACCURACY_LEVEL)
                prefill_level = accuracy_level if one_by_one else PREFILL_ACCURACY_LEVEL
                if name != "head" and (one_by_one or accuracy_level > prefill_level):
                    prefill_file = tmp / f"{name}.prefill.onnx"
                    _quantize(file, name, model, nbits, exit_layer, num_layers, prefill_level, rows_one_by_one=False,
                              out=prefill_file)
                    check_tolerance(f"{name} (prefill)", validate_outputs(prefill_file, inputs,
                                                                          _cases(name, model, exit_layer)),
                                    _tolerance_at(prefill_level, tolerance))
                    prefill = {"prefill_file": prefill_file.name, "prefill_accuracy_level": int(prefill_level)}
                quantized = _quantize(file, name, model, nbits, exit_layer, num_layers, accuracy_level,
                                      rows_one_by_one=one_by_one)
                check = validate_outputs(file, inputs, _cases(name, model, exit_layer))
                limit = check_tolerance(name, check, _tolerance_at(accuracy_level, tolerance))
            graphs[name] = {
                **({"matmul_nbits": quantized} if quantized else {}),
                **prefill,
                "file": file.name,
                "inputs": _shapes(inputs, dims),
                "outputs": _shapes(outputs, dims),
                "layers": {"shallow": [0, exit_layer], "deep": [exit_layer, num_layers], "head": []}[name],
                "validation": {**check, "tolerance": limit, "cases": VALIDATION_CASES},
            }
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "graph_revision": GRAPH_REVISION,
            "opset": opset,
            "dtype": "float32",
            "weights": weights if nbits is None else {"format": "gguf-matmulnbits", "gguf_file": Path(gguf_path).name,
                                                      "accuracy_level": int(accuracy_level), "rows": rows_layout(accuracy_level)},
            "kv_layout": "[batch, seq, kv_heads, head_dim]; graphs return the new positions' KV only",
            "model_name": model_name,
            "base_model_fingerprint": fingerprint,
            "exit_layer": exit_layer,
            "num_layers": num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "num_key_value_heads": kvh,
            "head_dim": hd,
            "max_position_embeddings": cfg.max_position_embeddings,
            "graphs": graphs,
            "versions": versions(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


#: 8-bit blocks run as MatMulNBits only with int8 activations: onnxruntime 1.32 has no fast 8-bit kernel for float32
#: activations (measured, SmolLM2's 49152 x 576 head, 2 threads: 158 ms, against 3.4 ms as a float32 MatMul)
FLOAT32_ACTIVATION_BITS = (4,)


def _tolerance_at(accuracy_level: int, tolerance: float) -> float:
    """The validation bound of a graph at ``accuracy_level``: strict at float32 activations, a sanity bound above."""
    return tolerance if accuracy_level <= 1 else LOSSY_TOLERANCE


def _quantize(file: Path, name: str, model, nbits: dict, exit_layer: int, num_layers: int, accuracy_level: int,
              rows_one_by_one: bool = True, out: Path | None = None) -> dict:
    """Rewrite one exported graph onto MatMulNBits (into ``out``, default over ``file``); every linear layer of the
    graph must have been replaced (but 8-bit ones at float32 activations, which stay float32 MatMuls over their exact
    dequantization)."""
    from kangaroo_backends.gguf_nbits import quantize_graph

    layers = {"shallow": range(exit_layer), "deep": range(exit_layer, num_layers), "head": ()}[name]
    wanted = {n: w for n, w in nbits.items()
              if (name == "head" and n == "lm_head.weight") or any(n.startswith(f"model.layers.{i}.") for i in layers)}
    expected = 1 if name == "head" else 7 * len(layers)
    if len(wanted) != expected:
        raise OnnxExportError(f"the GGUF file has {len(wanted)} of the {expected} linear weights of the {name} graph")
    kept = {n: w.gguf_type for n, w in wanted.items() if accuracy_level <= 1 and w.bits not in FLOAT32_ACTIVATION_BITS}
    wanted = {n: w for n, w in wanted.items() if n not in kept}
    if not wanted:
        if out is not None:
            shutil.copyfile(file, out)
        done = {"replaced": 0, "types": {}}
    else:
        done = quantize_graph(file, model, wanted, accuracy_level=accuracy_level, rows_one_by_one=rows_one_by_one,
                              out=out)
    if done["replaced"] != len(wanted):
        raise OnnxExportError(f"only {done['replaced']} of the {name} graph's {len(wanted)} linear layers were found "
                              "in the exported graph; export refused")
    return {**done, "accuracy_level": int(accuracy_level), "kept_float32": kept}


@contextlib.contextmanager
def atomic_directory(out_dir: Path):
    """Yield a temporary directory next to ``out_dir`` that replaces it (empty or absent) once the block succeeds;
    a failed or interrupted export leaves nothing behind."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
