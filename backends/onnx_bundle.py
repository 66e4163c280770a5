"""The onnx backend's bundle format: what an export directory holds, by name — its constants, the graphs' input and
output names and shapes, the manifest (written by :mod:`kangaroo_backends.onnx_export`, read and checked here for
:mod:`kangaroo_backends.onnx_backend`), and the atomic directory an export is written through.

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
(:func:`~kangaroo_backends.onnx_toolkit.attention_bias`) or the tree's
(:meth:`~kangaroo_core.tree.TreeAttention.additive_mask`), one per layer kind.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from kangaroo_backends.families import FULL, SLIDING, layer_kinds
from kangaroo_backends.gguf_nbits import EXACT_LAYOUTS
from kangaroo_core.errors import OnnxModelError
from kangaroo_core.files import read_json

MANIFEST = "manifest.json"
FORMAT = "kangaroo-onnx"
FORMAT_VERSION = 3
#: how the graphs are written inside an unchanged interface (2: the lean attention of
#: :class:`~kangaroo_backends.onnx_toolkit.Attention`; 3: 4-bit products row by row,
#: :func:`~kangaroo_backends.gguf_nbits.row_by_row`; 4: int8-activation graphs multiply all rows at once,
#: :func:`~kangaroo_backends.gguf_nbits.rows_at_once`; 5: int8-activation exports prefill the prompt in graphs of their
#: own at float32 activations, :data:`~kangaroo_backends.onnx_export.PREFILL_ACCURACY_LEVEL`); recorded in the manifest
#: and part of the export cache's key, so a cached export of an older revision is re-exported, while a bundle of an
#: older revision still loads (same inputs and outputs; an older 4-bit bundle runs the target alone only); 6: the
#: metadata marks each layer's attention over the cache (:class:`~kangaroo_backends.onnx_toolkit.AttentionCore`), which
#: the CPU runner swaps for an op reading the cache in place (:mod:`kangaroo_backends.ort_attention`)
GRAPH_REVISION = 6
#: the export cache's directory name under ``onnx/``
EXPORT_KEY = f"v{FORMAT_VERSION}.{GRAPH_REVISION}"
WEIGHTS = ("float32", "gguf")
GRAPHS = ("shallow", "deep", "head")
#: the bias input of each layer kind (a graph takes the ones its layers use)
BIAS_INPUTS = {FULL: "attention_bias", SLIDING: "sliding_bias"}


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


def graph_shapes(names: list[str], *, hidden: int, vocab: int, kv_heads: int, head_dim: int) -> dict[str, list]:
    """The manifest's shape of each of these graph inputs or outputs (``"n"``, ``"past"``, ``"total"``: dynamic)."""
    kv_past, kv_new = [1, "past", kv_heads, head_dim], [1, "n", kv_heads, head_dim]
    bias = [1, 1, "n", "total"]
    dims = {"input_ids": [1, "n"], "position_ids": [1, "n"], "attention_bias": bias, "sliding_bias": bias,
            "hidden": [1, "n", hidden], "final_hidden": [1, "n", hidden],
            "logits": [1, "n", vocab], "past_key": kv_past, "past_value": kv_past, "new_key": kv_new,
            "new_value": kv_new}
    return {n: dims[n.split(".")[0]] for n in names}


# -- the manifest ---------------------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    """The installed versions of the packages an export depends on (recorded in its manifest)."""
    out = {}
    for dist in ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "kangaroo-decoding", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write ``manifest`` as the export's :data:`MANIFEST` in ``directory``."""
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


#: manifest key -> type every manifest must have (checked before anything is read from it)
MANIFEST_TYPES = {"base_model_fingerprint": str, "exit_layer": int, "num_layers": int, "hidden_size": int,
                  "vocab_size": int, "num_key_value_heads": int, "head_dim": int, "max_position_embeddings": int,
                  "graphs": dict}


def graph_file(directory: Path, manifest: dict, name: str, manifest_path: Path, key: str = "file",
               optional: bool = False) -> Path | None:
    """The file of graph ``name`` named by the manifest (``key``: ``file``, or ``prefill_file`` — a 4-bit export's
    prefill graph, ``None`` when absent and ``optional``), which must stay inside the export's directory."""
    entry = manifest["graphs"].get(name)
    if optional and isinstance(entry, dict) and key not in entry:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get(key), str):
        raise OnnxModelError(f"{manifest_path} lists no {name} graph")
    path = (directory / entry[key]).resolve()
    if path.parent != directory.resolve():
        raise OnnxModelError(f"{manifest_path}: the {name} graph's file {entry[key]!r} is outside {directory}")
    if not path.is_file() and optional:
        raise OnnxModelError(f"{manifest_path}: the {name} graph's file {entry[key]!r} is missing; re-export")
    return path


def read_manifest(directory: Path, *, fingerprint: str, exit_layer: int) -> dict:
    """The export's manifest, checked (keys, types, graph files) against the loaded model and exit layer."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise OnnxModelError(f"{directory} is not a kangaroo ONNX export (no {MANIFEST}); export one with `kangaroo export-onnx`")
    manifest = read_json(path, OnnxModelError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise OnnxModelError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} manifest (format version {version!r}); "
                             f"re-export with `kangaroo export-onnx`")
    for key, kind in MANIFEST_TYPES.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise OnnxModelError(f"{path}: '{key}' is missing or not a {kind.__name__}")
    if manifest["base_model_fingerprint"] != fingerprint:
        raise OnnxModelError(
            f"ONNX export {directory} was made for base model {manifest['base_model_fingerprint']}, "
            f"not for the loaded model {fingerprint}"
        )
    if manifest["exit_layer"] != exit_layer:
        raise OnnxModelError(f"ONNX export {directory} is split at exit layer {manifest['exit_layer']}, but exit layer {exit_layer} was requested")
    for name in GRAPHS:
        graph_file(Path(directory), manifest, name, path)
    return manifest


def export_weights(manifest: dict) -> tuple[str, int]:
    """``("float32", 0)`` or ``("gguf", accuracy level)`` for an export's manifest (older exports: float32)."""
    weights = manifest.get("weights", "float32")
    if isinstance(weights, dict):
        return "gguf", int(weights.get("accuracy_level", 0))
    return "float32", 0


def export_kernel(manifest: dict) -> str | None:
    """How an export's 4-bit products run: ``blocks`` (kangaroo's block kernel), ``matmulnbits``, or None (float32)."""
    weights = manifest.get("weights", "float32")
    if not isinstance(weights, dict):
        return None
    return "blocks" if weights.get("format") == "gguf-blocks" else "matmulnbits"


def rows_exact(manifest: dict) -> bool:
    """Whether a pass over n positions reproduces n one-position passes bit for bit: float32 MatMuls always do
    (measured, every n); 4-bit ones when exported row by row (graph revision 3 on) or, at int8 activations, with
    rows at once (revision 4 on: that kernel computes each row alone)."""
    weights = manifest.get("weights", "float32")
    return not isinstance(weights, dict) or weights.get("rows") in EXACT_LAYOUTS


# -- writing an export ----------------------------------------------------------------------------------------------
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
