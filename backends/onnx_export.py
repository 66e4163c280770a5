"""Export the split target to ONNX: the shallow part M[:l], the deep part M[l:] + final norm, and the LM head, each
validated against eager PyTorch (optionally rewritten onto the GGUF file's own 4-bit blocks) and written as one bundle
(:mod:`kangaroo_backends.onnx_bundle`: the graphs' inputs and outputs, the manifest) with the graph toolkit
(:mod:`kangaroo_backends.onnx_toolkit`).

Why not optimum's exporters: they export whole ``*ForCausalLM`` models (input_ids → logits); the Kangaroo loop needs
the target split at the exit layer (the deep part takes layer-l *hidden states*, not token ids), so the sub-networks are
wrapped as small ``nn.Module`` s here and exported with ``torch.onnx.export``. A drafter's graph (the Kangaroo
adapter's, :mod:`kangaroo_plugins.kangaroo.onnx_graph`) is the drafter's own business: it is exported by the drafter
plugin into the backend's :meth:`~kangaroo_backends.onnx_backend.OnnxBackend.artifact_dir`, with the same toolkit.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kangaroo_backends.families import family_of, layer_kinds, rotary_embeddings
from kangaroo_backends.gguf_nbits import ROW_INDEPENDENT_LEVELS, ROWS, ROWS_AT_ONCE, ROWS_BLOCKS, rows_at_once
from kangaroo_backends.onnx_bundle import (BIAS_INPUTS, FORMAT, FORMAT_VERSION, GRAPH_REVISION, WEIGHTS,
                                           atomic_directory, graph_io, graph_shapes, versions, write_manifest)
from kangaroo_backends.onnx_toolkit import (DEFAULT_OPSET, DEFAULT_TOLERANCE, INSTALL_HINT, Attention, Rotary,
                                            VALIDATION_CASES, attention_bias, check_tolerance, dynamic_axes,
                                            export_graph, graph_biases, import_onnxruntime, torch_kv, validate_outputs,
                                            validation_tree)
from kangaroo_core.errors import MissingDependencyError, OnnxExportError

#: the MatMulNBits accuracy level of an int8-activation export's prefill graphs (the prompt's pass, nothing cached
#: yet): float32 activations. Why: onnxruntime's int8-activation kernel is fast for a few rows but slow for hundreds —
#: measured on 2026-12-04's Intel Xeon (2 threads, SmolLM2 shapes, 773 rows): 208-273 G/s at level 4 against
#: 361-373 at level 1 and 415-454 for float32 MatMul; SmolLM2's deep graph prefills a 773-token prompt in 950 ms
#: instead of 1,200 (1 thread: 1,545 instead of 2,126). The prompt's pass is the same pass for the target alone and
#: for Kangaroo (both prefill the same prompt at position 0), so this keeps Kangaroo equal to its target alone; every
#: later pass (one row, or a verify pass) runs the int8 graphs.
PREFILL_ACCURACY_LEVEL = 1
#: accepted max |onnx - eager| (relative, like :data:`~kangaroo_backends.onnx_toolkit.DEFAULT_TOLERANCE`) for graphs
#: whose activations are quantized (MatMulNBits accuracy levels 2-4): lossy by choice, so only a sanity bound; the
#: block mapping itself is what level 1 validates strictly (int8 activations on random inputs: measured 7 % of the
#: output's magnitude on a tiny random model, 27 % through SmolLM2's 28 deep layers)
LOSSY_TOLERANCE = 1.0


# -- the wrapped sub-networks ---------------------------------------------------------------------------------------
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


# -- export ---------------------------------------------------------------------------------------------------------
def _cases(name: str, model, exit_layer: int, seed: int = 0):
    """Random inputs and eager references (TorchBackend) for one graph: a 4-position prefill (no past), a
    3-position step after 5 cached positions, and a 3-node token tree after 5 cached positions."""
    from kangaroo_backends.torch_backend import TorchBackend

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
                accuracy_level: int = 1, kernel: str = "matmulnbits") -> dict[str, Any]:
    """Export the shallow / deep / head graphs of ``model`` (a transformers decoder of a supported family) split at ``exit_layer`` into ``out_dir``.

    Every graph is validated against eager PyTorch before the export is declared good; the export is written to a
    temporary directory and renamed into place, so a failed or refused export leaves nothing behind.
    ``weights="gguf"``: every linear layer then runs ``MatMulNBits`` over the GGUF file's own blocks
    (:mod:`kangaroo_backends.gguf_nbits`; ``model`` must be that file's float32 dequantization, which is what
    :func:`~kangaroo_backends.loading.load_model` gives) and is validated against the float32 model again: at
    ``accuracy_level`` 0/1 to the same tolerance (same weights, float32 activations), above (2 fp16, 3 bf16, 4 int8 activations: lossy)
    to :data:`LOSSY_TOLERANCE`. ``kernel="blocks"``: kangaroo's block kernel instead of MatMulNBits
    (:mod:`kangaroo_backends.block_weights`: every GGUF type of the shipped models, all rows at once and each row
    exact, int8 activations at level 4, float32 at 0/1; no separate prefill graph). Returns the manifest.
    """
    import_onnxruntime()
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
    except ImportError:
        raise MissingDependencyError(f"exporting to ONNX needs the onnx package: {INSTALL_HINT}") from None
    from kangaroo_backends.torch_backend import model_fingerprint

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
        if kernel not in KERNELS:
            raise OnnxExportError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel == "blocks":
            from kangaroo_backends.block_weights import activations_at, read_block_weights

            activations_at(accuracy_level)  # refuses levels 2 and 3 in one line
            nbits = read_block_weights(gguf_path, model.config)
        else:
            nbits = read_linear_weights(gguf_path, model.config)
    if fingerprint is None:
        fingerprint = model_fingerprint(model)
    model = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    model = model.eval()
    cfg = model.config
    kvh = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dims = {"hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "kv_heads": kvh, "head_dim": hd}

    # int8 activations multiply all rows of a pass in one MatMulNBits call where its kernel is row-exact on this CPU
    # (AVX-512), row by row where it is not (AVX2 alone): gguf_nbits.rows_at_once, measured here once
    int8 = nbits is not None and kernel != "blocks" and int(accuracy_level) in ROW_INDEPENDENT_LEVELS
    at_once = int8 and rows_at_once(accuracy_level, {w.k for w in nbits.values()})
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
                one_by_one = kernel != "blocks" and not at_once
                # the prefill's own graph, rows at once: at float32 activations when the other graphs are int8 ones
                # (PREFILL_ACCURACY_LEVEL; whether they go row by row or not), else at their level (see
                # gguf_nbits.row_by_row)
                prefill_level = PREFILL_ACCURACY_LEVEL if int8 else accuracy_level
                if name != "head" and kernel != "blocks" and (one_by_one or accuracy_level > prefill_level):
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
                "inputs": graph_shapes(inputs, **dims),
                "outputs": graph_shapes(outputs, **dims),
                "layers": {"shallow": [0, exit_layer], "deep": [exit_layer, num_layers], "head": []}[name],
                "validation": {**check, "tolerance": limit, "cases": VALIDATION_CASES},
            }
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "graph_revision": GRAPH_REVISION,
            "opset": opset,
            "dtype": "float32",
            "weights": weights if nbits is None else {
                "format": "gguf-blocks" if kernel == "blocks" else "gguf-matmulnbits", "gguf_file": Path(gguf_path).name,
                "accuracy_level": int(accuracy_level),
                "rows": ROWS_BLOCKS if kernel == "blocks" else ROWS_AT_ONCE if at_once else ROWS},
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
        write_manifest(tmp, manifest)
    return manifest


#: how an export's 4-bit products run: onnxruntime's MatMulNBits, or kangaroo's block kernel (``kangaroo.BlockMatMul``)
KERNELS = ("matmulnbits", "blocks")


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
    kept = {n: w.gguf_type for n, w in wanted.items()  # the block kernel keeps nothing in float32
            if accuracy_level <= 1 and getattr(w, "bits", 4) not in FLOAT32_ACTIVATION_BITS}
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
