"""Attention that reads the KV cache where it lies, for the onnx backend on CPU: an onnxruntime custom op
(``kangaroo.CachedAttention``, ``ort_cached_attention.c``) that replaces each layer's attention nodes (the scope of its
:class:`~kangaroo_backends.onnx_toolkit.AttentionCore`).

Why: the exported graphs are standard ONNX, so each layer's attention concatenates the cached keys/values with the
new ones and transposes them (copies of the whole cache, every layer, every pass). Measured with onnxruntime's
profiler on the 4-bit int8 deep graph (SmolLM2, one-row pass, 1 thread): ``Concat`` + ``Transpose`` 2.3 ms of 19.7 ms
after 300 cached positions, 6.0 ms of 26.0 ms after 800, and the attention's own ``MatMul`` / ``FusedMatMul`` /
``Softmax`` 2.1 → 3.6 ms more. The runner binds ``buffer[:, :past]`` as the past keys and ``buffer[:, past:past+n]``
as the new keys' output (:class:`~kangaroo_backends.onnx_backend.GraphRunner`), so by the time a layer's attention
runs, its keys are one contiguous [past+n, kvh, hd] block already: the op reads them there (when the new keys do
not sit right after the past ones, e.g. a plain ``session.run``, it copies them together first: same result).

The arithmetic is ``small_batch_attention.c``'s: every row computed alone, in a fixed order, so a verify pass gives
each row the bits the one-row pass gives it (what makes Kangaroo on this backend equal to its target alone).

The export marks the attention: :class:`~kangaroo_backends.onnx_toolkit.AttentionCore` is a module of its own, so its
nodes share one scope (``/attns.<i>/core/...``), and the graph's metadata ``kangaroo.attention_core`` lists the
scopes with the heads, KV heads, head size and scale. The graph itself stays standard ONNX, the operations of
revision 5; :func:`swap_attention` replaces each scope's nodes by the custom op when a CPU session is created (the
files on disk are never changed).

Built at first use with the system C compiler into ``$KANGAROO_CACHE_DIR/native/`` (like
:mod:`kangaroo_backends.native`), without OpenMP: the op runs its work items on onnxruntime's own intra-op threads
(``KernelContext_ParallelFor``), so no second thread pool competes for the cores. Without a compiler, or with
``KANGAROO_NATIVE=0``, :func:`library` says why not and the graphs run as exported.
"""

from __future__ import annotations

import ctypes
import functools
import json
from pathlib import Path

from kangaroo_backends import native
from kangaroo_backends.native import build_packaged
from kangaroo_backends.onnx_bundle import BIAS_INPUTS

#: metadata key of an exported graph that marks its attention cores (:func:`mark_attention`)
METADATA_KEY = "kangaroo.attention_core"
DOMAIN = "kangaroo"
OP = "CachedAttention"
SOURCES = ("ort_cached_attention.c", "small_batch_attention.c", "ort_block_matmul.c", "block_matmul.c", "ort_rotary.c")
FLAGS = tuple(flag for flag in native.FLAGS if flag != "-fopenmp")  # the torch kernels' flags, no OpenMP


@functools.lru_cache(maxsize=None)
def library() -> tuple[Path | None, str]:
    """The custom-op library's path, or ``(None, why not)``."""
    return build_packaged(SOURCES, FLAGS, "ort_attention", "the onnxruntime attention op", main=SOURCES[0])


def uses_ops(proto) -> bool:
    """Whether a graph (an ``onnx.ModelProto``) has nodes of kangaroo's domain (``BlockMatMul``, ``CachedAttention``)."""
    return any(node.domain == DOMAIN for node in proto.graph.node)


def register_if_used(path: Path, options) -> bool:
    """Register the ops' library in ``options`` when the graph at ``path`` needs it; an
    :class:`~kangaroo_core.errors.OnnxModelError` in one line when it does and the library cannot be built."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    if not uses_ops(proto):
        return False
    require(path)
    options.register_custom_ops_library(str(library()[0]))
    return True


def require(path: Path) -> None:
    """One line when a graph needing kangaroo's ops cannot have them (no compiler, no AVX2)."""
    from kangaroo_core.errors import OnnxModelError

    built, why = library()
    if built is None:
        raise OnnxModelError(f"{path} runs kangaroo's own kernels, which are not available here: {why}; re-export "
                             "with --onnx-kernel matmulnbits")
    if ctypes.CDLL(str(built)).block_matmul_isa() == 0:  # the op's own copy of the block kernel: no AVX2 path
        raise OnnxModelError(f"{path} runs kangaroo's block kernel, which needs a CPU with AVX2 and FMA; re-export "
                             "with --onnx-kernel matmulnbits")


def counters() -> dict[str, int]:
    """How many of the op's calls read the cache in place and how many copied it together first (process-wide)."""
    path, _ = library()
    if path is None:
        return {"in_place": 0, "copied": 0}
    lib = ctypes.CDLL(str(path))  # the same handle onnxruntime opened: one set of counters
    return {name: ctypes.c_long.in_dll(lib, f"kangaroo_attention_{name}").value for name in ("in_place", "copied")}


def mark_attention(path: Path, cores) -> None:
    """Record in an exported graph's metadata the node scope of each attention core (``/attns.<i>/core``: the
    exporter names every node of a module after the module's path) and their shapes. A graph whose cores differ in
    shape, or whose nodes do not show one scope per core, is left unmarked and runs as exported."""
    import onnx

    specs = {(c.heads, c.kv_heads, c.head_dim, float(c.scaling)) for c in cores}
    if len(specs) != 1:
        return
    heads, kv_heads, head_dim, scale = specs.pop()
    proto = onnx.load(str(path))
    scopes = list(dict.fromkeys(node.name[: node.name.index("/core/") + 5] for node in proto.graph.node
                                if "/core/" in node.name))
    if len(scopes) != len(cores):
        return
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(
        {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "scale": scale, "scopes": scopes})
    onnx.save(proto, str(path))


def swap_attention(proto) -> int:
    """Replace the nodes of every attention core of a marked graph (an ``onnx.ModelProto``, changed in place) by one
    custom-op node each; returns how many cores were replaced (0: not a marked graph, left as it is).

    A core's inputs are recognised by name, not position: ``past_key.i`` / ``past_value.i`` are graph inputs,
    ``new_key.i`` / ``new_value.i`` graph outputs, the bias a bias input (or its per-group tiling: the op reads the
    untiled one), the query the remaining one; constants (initializers) are the core's own."""
    from onnx import helper

    spec = {p.key: p.value for p in proto.metadata_props}.get(METADATA_KEY)
    if spec is None:
        return 0
    spec = json.loads(spec)
    graph = proto.graph
    graph_inputs = {i.name for i in graph.input}
    graph_outputs = {o.name for o in graph.output}
    constants = {i.name for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    biases = set(BIAS_INPUTS.values())

    def untiled(name: str) -> str | None:
        while name not in graph_inputs:  # back through the per-group tiling (bias.repeat: Expand, Tile)
            node = producer.get(name)
            if node is None or node.op_type not in ("Expand", "Tile"):
                return None
            name = node.input[0]
        return name if name in biases else None

    nodes = list(graph.node)
    for scope in spec["scopes"]:
        members = [i for i, node in enumerate(nodes) if node.name.startswith(scope + "/")]
        inside = {out for i in members for out in nodes[i].output}
        read_outside = {name for i, node in enumerate(nodes) if i not in members for name in node.input} | graph_outputs
        external = [name for i in members for name in nodes[i].input
                    if name and name not in inside and name not in constants]
        results = [name for name in inside if name in read_outside]
        roles = {}
        for name in dict.fromkeys(external):
            base = name.split(".")[0]
            if base in ("past_key", "past_value") and name in graph_inputs:
                roles[base] = name
            elif base in ("new_key", "new_value") and name in graph_outputs:
                roles[base] = name
            elif untiled(name) is not None:
                roles["bias"] = untiled(name)
            else:
                roles.setdefault("query", []).append(name)
        if not members or len(roles) != 6 or len(roles["query"]) != 1 or len(results) != 1:
            raise ValueError(f"cannot read the attention at {scope}: inputs {external}, outputs {results}")
        node = helper.make_node(
            OP, [roles["query"][0], roles["new_key"], roles["new_value"], roles["past_key"], roles["past_value"],
                 roles["bias"]], results, name=f"{scope}/{OP}", domain=DOMAIN,
            heads=int(spec["heads"]), kv_heads=int(spec["kv_heads"]), head_dim=int(spec["head_dim"]),
            scale=float(spec["scale"]))
        at = next(i for i in members if results[0] in nodes[i].output)  # where the core's result was made
        nodes = [node if i == at else n for i, n in enumerate(nodes) if i == at or i not in members]
    del graph.node[:]
    graph.node.extend(_live(nodes, graph_outputs))
    if not any(o.domain == DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(spec["scopes"])


def _live(nodes: list, outputs: set[str]) -> list:
    """The nodes whose outputs something still reads (the per-group bias tiling the op no longer needs goes)."""
    while True:
        used = outputs | {name for node in nodes for name in node.input}
        kept = [node for node in nodes if any(out in used for out in node.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept
