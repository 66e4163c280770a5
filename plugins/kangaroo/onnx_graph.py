"""The Kangaroo adapter as an ONNX graph: exported by the drafter, into the onnx backend's artefact directory.

``adapter.onnx``: ``hidden`` [1, n, d] (layer-l states), ``position_ids`` [1, n], ``attention_bias`` [1, 1, n, T]
(causal, or a token tree's visibility), ``past_key.0`` / ``past_value.0`` [1, past, kvh, hd], ``logit_rows`` [r]
int64 (which of the n rows need draft logits: the last one when drafting a chain, every node of a tree) →
``logits`` [1, r, V] (the drafting head: the next-token draft distributions, -inf outside a draft vocabulary),
``new_key.0`` / ``new_value.0`` [1, n, kvh, hd]. The head's weight is copied into the graph, so the file is usable
alone. The deep-context adapter's graph: see :class:`DeepContextGraph`. ``adapter_manifest.json`` records the base
model, exit layer, adapter key and the validation against eager PyTorch (refused beyond the tolerance, like the backend's graphs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kangaroo_backends.onnx_bundle import atomic_directory, kv_names, versions
from kangaroo_backends.onnx_toolkit import (DEFAULT_OPSET, DEFAULT_TOLERANCE, VALIDATION_CASES, Attention, Rotary,
                                            attention_bias, check_tolerance, dynamic_axes, export_graph, torch_kv,
                                            validate_outputs, validation_tree)
from kangaroo_core.errors import OnnxExportError, OnnxModelError
from kangaroo_core.files import read_json

FORMAT = "kangaroo-onnx-adapter"
FORMAT_VERSION = 2  # 2: masks and logit rows are inputs (token trees)
MANIFEST = "adapter_manifest.json"
GRAPH_FILE = "adapter.onnx"
INPUTS = ["hidden", "position_ids", "attention_bias", *kv_names("past", 1), "logit_rows"]
OUTPUTS = ["logits", *kv_names("new", 1)]
#: the deep-context adapter's graph: side inputs after the KV ones (see :class:`DeepContextGraph`)
DEEP_INPUTS = ["hidden", "position_ids", *kv_names("past", 1), "deep", "known", "latest_deep", "query_rows", "depth",
               "query_bias"]
DEEP_OUTPUTS = OUTPUTS
#: the axes that are not "n" (new rows) or "past"
AXES = {"logit_rows": {0: "rows"}, "logits": {1: "rows"}, "query_rows": {0: "rows"}, "depth": {0: "rows"},
        "query_bias": {2: "rows", 3: "total"}}


def graph_io(adapter) -> tuple[list[str], list[str]]:
    """The input and output names of ``adapter``'s graph."""
    return (DEEP_INPUTS, DEEP_OUTPUTS) if adapter.reads_deep_states else (INPUTS, OUTPUTS)


class AdapterGraph(nn.Module):
    """KangarooAdapter (RMSNorm → attention → residual [→ MLP] → RMSNorm) + the drafting head on the last position."""

    def __init__(self, adapter, shared_head):
        super().__init__()
        self.rotary = Rotary(adapter.rotary_emb)
        self.input_norm, self.output_norm = adapter.input_norm, adapter.output_norm
        self.attn = Attention(adapter.attention, adapter.config)
        self.mlp_norm, self.mlp = (adapter.mlp_norm, adapter.mlp) if adapter.ffn else (None, None)
        self.head = adapter.drafting_head(shared_head)  # shared or own head, restricted to the draft vocabulary if any

    def forward(self, hidden, position_ids, attention_bias, past_key, past_value, logit_rows):
        cos, sin = self.rotary(position_ids)
        attended, k, v = self.attn(self.input_norm(hidden), cos, sin, attention_bias, past_key, past_value)
        out = (hidden + attended)[:, logit_rows]  # only the rows that draft (a chain: the last one)
        if self.mlp is not None:
            out = out + self.mlp(self.mlp_norm(out))
        return self.head(self.output_norm(out)), k, v


class DeepContextGraph(nn.Module):
    """The deep-context adapter (:mod:`kangaroo_plugins.kangaroo.deep_context`) for n new positions.

    ``deep`` [1, n, d] and ``known`` [1, n, 1] (1.0 where the position's deep state is verified) make the new
    positions' keys/values; ``latest_deep`` [1, d], ``query_rows`` [r] and ``depth`` [r] (int64) make the queries of
    the rows that draft (a chain: the last row; a tree: every node), which read the keys through ``query_bias``
    [1, 1, r, T] (zeros for a chain: a chain's query reads every key). The runner also calls it to rewrite the
    keys/values of positions whose deep states arrived (logits unused)."""

    def __init__(self, adapter, shared_head):
        super().__init__()
        self.adapter = adapter
        self.head = adapter.drafting_head(shared_head)

    def forward(self, hidden, position_ids, past_key, past_value, deep, known, latest_deep, query_rows, depth,
                query_bias):
        a = self.adapter
        k, v = a.keys_values(a.kv_input(hidden, deep, known), position_ids[0])  # [1, kvh, n, hd]
        keys = torch.cat([past_key.transpose(1, 2), k], dim=2)
        values = torch.cat([past_value.transpose(1, 2), v], dim=2)
        x_q = a.query_input(hidden[:, query_rows], latest_deep[:, None], depth[None])  # [1, r, d]
        out = a.attend_biased(x_q, position_ids[0, query_rows], keys, values, query_bias)
        return self.head(out), k.transpose(1, 2), v.transpose(1, 2)


def _deep_args(adapter, past: int, n: int, gen: torch.Generator, tree=None):
    d = adapter.config.hidden_size
    kvh, hd = adapter.config.num_key_value_heads, adapter.head_dim
    known = (torch.arange(n) < n - 1).float()[None, :, None]  # the last position not yet verified
    if tree is None:
        positions, rows = torch.arange(past, past + n), torch.tensor([n - 1])
        bias = torch.zeros(1, 1, 1, past + n)
    else:
        positions, rows, known = tree.position_ids(), torch.arange(n), torch.zeros(1, n, 1)
        bias = attention_bias(n, past, tree=tree)
    return [torch.randn(1, n, d, generator=gen), positions[None], torch.randn(1, past, kvh, hd, generator=gen),
            torch.randn(1, past, kvh, hd, generator=gen), torch.randn(1, n, d, generator=gen), known,
            torch.randn(1, d, generator=gen), rows, torch.arange(len(rows)) % 3, bias]


def _deep_cases(graph, adapter, seed: int = 0):
    """A 4-position prefill, a 3-position step after 5 cached positions and a 3-node tree after 5, with the eager
    graph's outputs."""
    gen = torch.Generator().manual_seed(seed)
    for past, n, tree in ((0, 4, None), (5, 3, None), (5, 3, validation_tree())):
        args = _deep_args(adapter, past, n, gen, tree)
        with torch.inference_mode():
            refs = list(graph(*args))
        yield args, refs


def _cases(adapter, shared_head, seed: int = 0):
    """A 4-position prefill, a 3-position step after 5 cached positions and a 3-node tree after 5, with the eager
    adapter's outputs."""
    gen = torch.Generator().manual_seed(seed)
    d = adapter.config.hidden_size
    for past, n, tree in ((0, 4, None), (5, 3, None), (5, 3, validation_tree())):
        states = torch.randn(past + n, d, generator=gen)
        cache = adapter.new_cache()
        rows = torch.tensor([n - 1]) if tree is None else torch.arange(n)
        positions = torch.arange(past, past + n) if tree is None else tree.position_ids()
        with torch.inference_mode():
            if past:
                adapter(states[None, :past], 0, cache)
            past_kv = torch_kv(cache, [0])
            out = adapter(states[None, past:], past, cache, tree=tree)
            refs = [adapter.logits(out[:, rows], shared_head), *[t[:, past:] for t in torch_kv(cache, [0])]]
        yield [states[None, past:], positions[None], attention_bias(n, past, tree=tree), *past_kv, rows], refs


def export_adapter_graph(adapter, shared_head, out_dir: Path, *, fingerprint: str, exit_layer: int, key: str,
                         opset: int = DEFAULT_OPSET, tolerance: float = DEFAULT_TOLERANCE, quiet: bool = False,
                         blocks: str | None = None) -> dict[str, Any]:
    """Export and validate the adapter graph into ``out_dir`` (atomically); returns its manifest. ``blocks``
    (``int8`` / ``float32``: a backend on kangaroo's block kernel at those activations): the graph's float32 products
    then run on that kernel over Q8_0 blocks of their weights
    (:func:`~kangaroo_backends.block_weights.quantize_float_products`), checked against eager PyTorch to a sanity
    bound only (drafts, not outputs, depend on it)."""
    adapter = adapter.float().eval()
    shared_head = shared_head.float()
    cfg = adapter.config
    kvh = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if not quiet:
        print(f"kangaroo: exporting the adapter graph once to {out_dir}", file=sys.stderr)
    inputs, outputs = graph_io(adapter)
    with atomic_directory(out_dir) as tmp:
        file = tmp / GRAPH_FILE
        if adapter.reads_deep_states:
            graph = DeepContextGraph(adapter, shared_head).eval()
            args = tuple(_deep_args(adapter, 3, 2, torch.Generator().manual_seed(1)))
            axes = dynamic_axes(inputs, outputs, fixed=("latest_deep",), special=AXES)
        else:
            graph = AdapterGraph(adapter, shared_head).eval()
            args = (torch.randn(1, 2, cfg.hidden_size), torch.arange(3, 5)[None], attention_bias(2, 3),
                    torch.randn(1, 3, kvh, hd), torch.randn(1, 3, kvh, hd), torch.tensor([1]))
            axes = dynamic_axes(inputs, outputs, special=AXES)
        try:
            export_graph(graph, args, file, inputs, outputs, axes, opset)
        except Exception as exc:
            raise OnnxExportError(f"torch.onnx.export failed for the adapter graph: {exc}") from exc
        cases = _deep_cases(graph, adapter) if adapter.reads_deep_states else _cases(adapter, shared_head)
        check = validate_outputs(file, inputs, cases)
        limit = check_tolerance("adapter", check, tolerance)
        quantized = {}
        if blocks is not None:
            from kangaroo_backends.block_weights import quantize_float_products
            from kangaroo_backends.onnx_export import LOSSY_TOLERANCE

            quantized = {"block_kernel": {"products": quantize_float_products(file, blocks), "weights": "Q8_0",
                                          "activations": blocks}}
            check = validate_outputs(file, inputs, cases)
            limit = check_tolerance("adapter (Q8_0 blocks)", check, LOSSY_TOLERANCE)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "file": GRAPH_FILE, "opset": opset, **quantized,
                    "base_model_fingerprint": fingerprint, "exit_layer": exit_layer, "adapter": key,
                    "architecture": adapter.architecture(), "inputs": inputs, "outputs": outputs,
                    "validation": {**check, "tolerance": limit, "cases": VALIDATION_CASES},
                    "versions": versions()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_adapter_manifest(directory: Path, *, fingerprint: str, exit_layer: int, key: str) -> dict[str, Any]:
    """The adapter graph's manifest, checked against the loaded model, exit layer and adapter."""
    path = directory / MANIFEST
    manifest = read_json(path, OnnxModelError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise OnnxModelError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} manifest; delete {directory} to re-export")
    expected = {"base_model_fingerprint": fingerprint, "exit_layer": exit_layer, "adapter": key, "file": GRAPH_FILE}
    for field, value in expected.items():
        if manifest.get(field) != value:
            raise OnnxModelError(f"adapter graph {directory} has {field} {manifest.get(field)!r}, expected {value!r}")
    return manifest
