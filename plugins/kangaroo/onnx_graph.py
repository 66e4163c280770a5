"""The Kangaroo adapter as an ONNX graph: exported by the drafter, into the onnx backend's artefact directory.

``adapter.onnx``: ``hidden`` [1, n, d] (layer-l states), ``position_ids`` [1, n], ``past_key.0`` / ``past_value.0``
[1, past, kvh, hd] → ``last_logits`` [1, V] (drafting head on the last position: the next-token draft distribution,
-inf outside a draft vocabulary), ``adapter_hidden`` [1, n, d] (the adapter's states before the head),
``new_key.0`` / ``new_value.0`` [1, n, kvh, hd]. The head's weight is copied into the graph, so the file is usable
alone. ``adapter_manifest.json`` records the base model, exit layer, adapter key and the validation against eager
PyTorch (refused beyond the tolerance, like the backend's graphs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kangaroo_backends.onnx_export import (DEFAULT_OPSET, DEFAULT_TOLERANCE, Attention, Rotary, atomic_directory,
                                           check_tolerance, dynamic_axes, export_graph, kv_names, torch_kv,
                                           validate_outputs, versions)
from kangaroo_core.errors import OnnxExportError, OnnxModelError
from kangaroo_core.files import read_json

FORMAT = "kangaroo-onnx-adapter"
FORMAT_VERSION = 1
MANIFEST = "adapter_manifest.json"
GRAPH_FILE = "adapter.onnx"
INPUTS = ["hidden", "position_ids", *kv_names("past", 1)]
OUTPUTS = ["last_logits", "adapter_hidden", *kv_names("new", 1)]
#: the deep-context adapter's graph: side inputs after the KV ones (see :class:`DeepContextGraph`)
DEEP_INPUTS = [*INPUTS, "deep", "known", "latest_deep", "depth"]
DEEP_OUTPUTS = ["last_logits", *kv_names("new", 1)]


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

    def forward(self, hidden, position_ids, past_key, past_value):
        cos, sin = self.rotary(position_ids)
        attended, k, v = self.attn(self.input_norm(hidden), cos, sin, position_ids, past_key, past_value)
        out = hidden + attended
        if self.mlp is not None:
            out = out + self.mlp(self.mlp_norm(out))
        out = self.output_norm(out)
        return self.head(out[:, -1]), out, k, v


class DeepContextGraph(nn.Module):
    """The deep-context adapter (:mod:`kangaroo_plugins.kangaroo.deep_context`) for n new positions.

    ``deep`` [1, n, d] and ``known`` [1, n, 1] (1.0 where the position's deep state is verified) make the new
    positions' keys/values; ``latest_deep`` [1, d] and ``depth`` [1] (int64) make the last position's query. The
    runner also calls it to rewrite the keys/values of positions whose deep states arrived (logits unused)."""

    def __init__(self, adapter, shared_head):
        super().__init__()
        self.adapter = adapter
        self.head = adapter.drafting_head(shared_head)

    def forward(self, hidden, position_ids, past_key, past_value, deep, known, latest_deep, depth):
        a = self.adapter
        k, v = a.keys_values(a.kv_input(hidden, deep, known), position_ids[0])  # [1, kvh, n, hd]
        keys = torch.cat([past_key.transpose(1, 2), k], dim=2)
        values = torch.cat([past_value.transpose(1, 2), v], dim=2)
        x_q = a.query_input(hidden[:, -1:], latest_deep[:, None], depth[:, None])  # [1, 1, d]
        out = a.attend_all(x_q, position_ids[0, -1:], keys, values)
        return self.head(out[:, -1]), k.transpose(1, 2), v.transpose(1, 2)


def _deep_args(adapter, past: int, n: int, gen: torch.Generator):
    d = adapter.config.hidden_size
    kvh, hd = adapter.config.num_key_value_heads, adapter.head_dim
    known = (torch.arange(n) < n - 1).float()[None, :, None]  # the last position not yet verified
    return [torch.randn(1, n, d, generator=gen), torch.arange(past, past + n)[None], torch.randn(1, past, kvh, hd, generator=gen),
            torch.randn(1, past, kvh, hd, generator=gen), torch.randn(1, n, d, generator=gen), known,
            torch.randn(1, d, generator=gen), torch.tensor([n % 3])]


def _deep_cases(graph, adapter, seed: int = 0):
    """A 4-position prefill and a 3-position step after 5 cached positions, with the eager graph's outputs."""
    gen = torch.Generator().manual_seed(seed)
    for past, n in ((0, 4), (5, 3)):
        args = _deep_args(adapter, past, n, gen)
        with torch.inference_mode():
            refs = list(graph(*args))
        yield args, refs


def _cases(adapter, shared_head, seed: int = 0):
    """A 4-position prefill and a 3-position step after 5 cached positions, with the eager adapter's outputs."""
    gen = torch.Generator().manual_seed(seed)
    d = adapter.config.hidden_size
    for past, n in ((0, 4), (5, 3)):
        states = torch.randn(past + n, d, generator=gen)
        cache = adapter.new_cache()
        with torch.inference_mode():
            if past:
                adapter(states[None, :past], 0, cache)
            past_kv = torch_kv(cache, [0])
            out = adapter(states[None, past:], past, cache)
            refs = [adapter.logits(out[:, -1], shared_head), out, *[t[:, past:] for t in torch_kv(cache, [0])]]
        yield [states[None, past:], torch.arange(past, past + n)[None], *past_kv], refs


def export_adapter_graph(adapter, shared_head, out_dir: Path, *, fingerprint: str, exit_layer: int, key: str,
                         opset: int = DEFAULT_OPSET, tolerance: float = DEFAULT_TOLERANCE, quiet: bool = False) -> dict[str, Any]:
    """Export and validate the adapter graph into ``out_dir`` (atomically); returns its manifest."""
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
            axes = dynamic_axes(inputs, outputs, fixed=("last_logits", "latest_deep", "depth"))
        else:
            graph = AdapterGraph(adapter, shared_head).eval()
            args = (torch.randn(1, 2, cfg.hidden_size), torch.arange(3, 5)[None], torch.randn(1, 3, kvh, hd),
                    torch.randn(1, 3, kvh, hd))
            axes = dynamic_axes(inputs, outputs, fixed=("last_logits",))
        try:
            export_graph(graph, args, file, inputs, outputs, axes, opset)
        except Exception as exc:
            raise OnnxExportError(f"torch.onnx.export failed for the adapter graph: {exc}") from exc
        cases = _deep_cases(graph, adapter) if adapter.reads_deep_states else _cases(adapter, shared_head)
        check = validate_outputs(file, inputs, cases)
        limit = check_tolerance("adapter", check, tolerance)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "file": GRAPH_FILE, "opset": opset,
                    "base_model_fingerprint": fingerprint, "exit_layer": exit_layer, "adapter": key,
                    "architecture": adapter.architecture(), "inputs": inputs, "outputs": outputs,
                    "validation": {**check, "tolerance": limit, "cases": "past=0,n=4; past=5,n=3"},
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
