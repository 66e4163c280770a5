"""The GGUF file's own quantized blocks as onnxruntime ``MatMulNBits`` weights (no re-quantization).

``MatMulNBits`` (com.microsoft) multiplies activations [.., K] by a weight stored per output row n as ``K / block``
blocks of ``bits``-bit codes q with one scale s and zero point z per block: w = (q − z) · s. GGUF's formats map onto
it block for block (both use blocks of 32 along K):

* ``Q4_1`` (d, m, 32 × 4-bit q; w = d·q + m): 4-bit codes as they are, s = d, z = 0, and the block minimum as a
  separate term: x·w = Σ_blocks d·(q·x_b) + m·Σ x_b, i.e. ``MatMulNBits(x) + MatMul(block sums of x, m)`` (a float
  zero point z = −m/d would fold it in, but sends onnxruntime 1.32 down a path ~10× slower than integer ones);
* ``Q4_0`` (d, 32 × 4-bit q; w = d·(q − 8)): 4-bit codes, s = d, z = 8;
* ``Q8_0`` (d, 32 × int8 q; w = d·q): 8-bit codes q + 128, s = d, z = 128 (exact).

transformers dequantizes the same blocks to float32 (``gguf.dequantize``: d·q + m); the rewritten graph uses exactly
those d·q (a 4-bit integer times a half-precision scale is exact in float32) and m, summed in another order (asserted
in the tests).
Llama's q/k rows are stored permuted for llama.cpp's rotary layout; the same row permutation transformers undoes is
applied to the blocks. Any other quantization type raises :class:`UnsupportedQuantization`, naming it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import numpy as np

from kangaroo_core.errors import KangarooError

BLOCK = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")


class UnsupportedQuantization(KangarooError):
    """A GGUF tensor in a format the MatMulNBits exporter does not map exactly."""


@attrs.frozen(eq=False)
class NBitsWeight:
    """One [N, K] weight in MatMulNBits form: ``codes`` [N, K/32, 32·bits/8] uint8, ``scales`` [N · K/32] float32,
    ``zero_points`` packed uint8 (None: the format's default, 2^(bits−1)), ``mins`` [N, K/32] float32 or None (Q4_1's
    per-block minimum m, added as m·Σ x over the block)."""

    name: str
    gguf_type: str
    bits: int
    n: int
    k: int
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    mins: np.ndarray | None = None

    @property
    def blocks(self) -> int:
        return self.k // BLOCK

    def dequantize(self) -> np.ndarray:
        """The [N, K] float32 weight the rewritten graph computes with, (q − z) · s (+ m) (for tests and checks)."""
        q = self.codes.astype(np.int32)
        if self.bits == 4:
            q = np.stack([q & 0xF, q >> 4], axis=-1).reshape(self.n, self.blocks, BLOCK)
        z = np.float32(2 ** (self.bits - 1))
        if self.zero_points is not None:  # packed like the codes: two 4-bit zero points per byte, low nibble first
            zp = self.zero_points.reshape(self.n, -1).astype(np.int32)
            z = np.stack([zp & 0xF, zp >> 4], axis=-1).reshape(self.n, -1)[:, : self.blocks, None].astype(np.float32)
        w = (q.astype(np.float32) - z) * self.scales.reshape(self.n, self.blocks, 1)
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.n, self.k)


def _halves(raw: np.ndarray, start: int) -> np.ndarray:
    return raw[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _pack4(q: np.ndarray) -> np.ndarray:
    """[.., 32] codes 0..15 in element order → [.., 16] bytes, element 2i in the low nibble (MatMulNBits' order)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def from_gguf_blocks(name: str, gguf_type: str, raw: np.ndarray, n: int, k: int) -> NBitsWeight:
    """Map one GGUF tensor's raw blocks ([N, bytes per row] uint8) onto MatMulNBits."""
    if gguf_type not in SUPPORTED:
        raise UnsupportedQuantization(f"GGUF tensor {name} is {gguf_type}; the 4-bit ONNX export maps "
                                      f"{', '.join(SUPPORTED)} only")
    if k % BLOCK:
        raise UnsupportedQuantization(f"GGUF tensor {name}: K = {k} is not a multiple of {BLOCK}")
    blocks = k // BLOCK
    if gguf_type == "Q8_0":
        b = raw.reshape(n, blocks, 34)
        scales = _halves(b, 0)
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return NBitsWeight(name, gguf_type, 8, n, k, codes, scales.reshape(-1), None)
    if gguf_type == "Q4_0":
        b = raw.reshape(n, blocks, 18)
        scales, qs = _halves(b, 0), b[..., 2:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # ggml: low nibbles are elements 0..15, high 16..31
        return NBitsWeight(name, gguf_type, 4, n, k, _pack4(q), scales.reshape(-1), None)
    b = raw.reshape(n, blocks, 20)  # Q4_1
    d, m, qs = _halves(b, 0), _halves(b, 2), b[..., 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    zero = np.zeros(n * ((blocks + 1) // 2), dtype=np.uint8)  # z = 0 for every block (4-bit, two per byte)
    return NBitsWeight(name, gguf_type, 4, n, k, _pack4(q), d.reshape(-1), zero, m)


def _reverse_permute_rows(n_rows: int, heads: int) -> np.ndarray:
    """Row order transformers applies to llama q/k weights read from GGUF (``_reverse_permute_weights``)."""
    dim = n_rows // heads // 2
    return np.arange(n_rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)


def _permuted(weight: NBitsWeight, order: np.ndarray) -> NBitsWeight:
    blocks = weight.k // BLOCK

    def rows(a):
        return None if a is None else a.reshape(weight.n, blocks)[order].reshape(-1)

    return attrs.evolve(weight, codes=weight.codes[order], scales=rows(weight.scales),
                        zero_points=None if weight.zero_points is None
                        else weight.zero_points.reshape(weight.n, -1)[order].reshape(-1),
                        mins=None if weight.mins is None else weight.mins[order])


LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def read_linear_weights(gguf_path: str | Path, config, convert=None) -> dict:
    """Every linear weight of a Llama GGUF file by its transformers parameter name (``lm_head.weight`` from
    ``output.weight``, or from the tied ``token_embd.weight``), in MatMulNBits form (or ``convert(name, gguf type,
    raw blocks, N, K)``'s, a weight with a ``rows(order)`` method)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    arch = reader.fields.get("general.architecture")
    # only llama-architecture files store q/k rows permuted (transformers' LlamaTensorProcessor); Qwen and Gemma do not
    permuted = arch is None or bytes(arch.parts[-1]).decode() == "llama"
    out: dict[str, NBitsWeight] = {}
    tensors = {t.name: t for t in reader.tensors}
    for tname, tensor in tensors.items():
        parts = tname.split(".")
        if parts[0] == "blk" and parts[2] in LLAMA_NAMES and parts[-1] == "weight":  # Qwen2's biases stay float
            hf = f"model.layers.{parts[1]}.{LLAMA_NAMES[parts[2]]}.weight"
        elif tname == "output.weight" or (tname == "token_embd.weight" and "output.weight" not in tensors):
            hf = "lm_head.weight"
        else:
            continue
        k, n = (int(x) for x in tensor.shape[:2])  # GGUF lists dims innermost first: [K, N]
        weight = (convert or from_gguf_blocks)(tname, tensor.tensor_type.name, np.asarray(tensor.data), n, k)
        if permuted and parts[-2] in ("attn_q", "attn_k"):
            order = _reverse_permute_rows(n, heads if parts[-2] == "attn_q" else kv_heads)
            weight = _permuted(weight, order) if convert is None else weight.rows(order)
        out[hf] = weight
    return out


# -- rewriting an exported float32 graph ----------------------------------------------------------------------------
def _digest(array: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


#: how a rewritten graph multiplies several rows (recorded in the manifest; bundles without it are refused for drafting)
ROWS = "one MatMulNBits call per row (Scan); the prefill in its own graph"
#: the same, for int8 activations: one MatMulNBits call for all rows, each row computed alone by the kernel itself
ROWS_AT_ONCE = "MatMulNBits over all rows at once (its int8-activation kernel computes each row alone)"
#: accuracy levels whose MatMulNBits *can* give a row the same bits whatever rows come with it: int8 activations,
#: quantized per row and block, integer block dot products (exact), their scaled sum in one order per row. Whether it
#: does depends on the CPU, so it is measured where the graphs run (:func:`row_difference`): on CPUs with AVX-512
#: (onnxruntime 1.32: 4- and 8-bit blocks of 32, with and without zero points, 1..300 rows, 1 and 2 threads) every row
#: of a multi-row call equals the one-row call bit for bit; on AVX2 without AVX-512 the 4-bit kernel does not — MLAS's
#: ``SQ4BitGemmKernel_BlkSum_CompInt8_avx2`` sends one row to ``SQ4BitGemmM1Kernel_CompInt8_avx2`` (zero points
#: subtracted inside each block's dot product) and two or more to ``SQ4BitGemmKernel_CompInt8_avx2`` plus a float GEMM
#: of the activations' block sums by the weights' (the zero points' term added afterwards): the same sum in another
#: order, ~3e-7 relative apart (measured under ``qemu-x86_64 -cpu EPYC-Rome``; its 8-bit kernel stays row-exact).
#: Levels 0/1 (float32 activations) differ from two rows on everywhere (~2e-6 relative).
ROW_INDEPENDENT_LEVELS = (4,)


#: the same, on kangaroo's block kernel (:mod:`kangaroo_backends.block_weights`): every block read once for all rows,
#: each row computed exactly as alone
ROWS_BLOCKS = "kangaroo.BlockMatMul over all rows at once (each row computed as alone)"


#: the manifest "rows" values whose graphs reproduce one-position passes row by row (older 4-bit bundles have none)
EXACT_LAYOUTS = (ROWS, ROWS_AT_ONCE, ROWS_BLOCKS)

#: what :func:`row_difference` multiplies: (bits, zero points given) of the exported products (Q4_0, Q4_1, Q8_0)
PROBED_FORMATS = ((4, False), (4, True), (8, False))
#: intra-op thread counts it runs each product at (onnxruntime splits a product's columns over its threads, and its
#: rows only in slices of 128, so a verify pass's rows are never split)
PROBED_THREADS = (1, 2)
PROBED_ROWS = 8  # a one-row call against calls of 2..8 rows
PROBED_COLUMNS = 80  # output columns (not a multiple of 32 or 64: a partial tile too)


def linear_ks(config) -> tuple[int, ...]:
    """The K (input sizes) of a decoder's linear layers: the hidden size (q/k/v, gate/up, the LM head), the attention
    output's (heads × head size, o_proj) and the MLP's (down_proj), those that are whole blocks of 32."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    ks = {config.hidden_size, heads * head_dim, getattr(config, "intermediate_size", config.hidden_size)}
    return tuple(sorted(k for k in ks if k % BLOCK == 0))


@functools.cache
def _row_difference(level: int, bits: int, zero_points: bool, k: int, threads: int) -> str | None:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(k * 31 + bits)
    n, blocks = PROBED_COLUMNS, k // BLOCK
    codes = rng.integers(0, 256, (n, blocks, BLOCK * bits // 8), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, n * blocks).astype(np.float32)
    inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S")]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, n * ((blocks + 1) // 2), dtype=np.uint8), "Z"))
    node = helper.make_node("MatMulNBits", ["A", "B", "S"] + (["Z"] if zero_points else []), ["Y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = (rng.standard_normal((PROBED_ROWS, k)) * rng.uniform(0.1, 10, (PROBED_ROWS, 1))).astype(np.float32)
    alone = np.concatenate([session.run(None, {"A": x[i:i + 1]})[0] for i in range(PROBED_ROWS)])
    for rows in range(2, PROBED_ROWS + 1):
        together = session.run(None, {"A": x[:rows]})[0]
        differ = np.flatnonzero((together.view(np.uint32) != alone[:rows].view(np.uint32)).any(axis=1))
        if differ.size:
            return (f"{bits}-bit blocks{' with zero points' if zero_points else ''}, K = {k}, {threads} "
                    f"thread{'s' * (threads > 1)}: row {differ[0]} of a {rows}-row call differs from its one-row call")
    return None


def row_difference(accuracy_level: int, ks) -> str | None:
    """None when, on this CPU, onnxruntime's MatMulNBits at ``accuracy_level`` gives every row of a call over several
    rows the bits of its own one-row call, for each format of :data:`PROBED_FORMATS`, K in ``ks`` and thread count of
    :data:`PROBED_THREADS` (random weights and activations, 1 against 2..8 rows); else the first difference, in words.
    Measured once per process (milliseconds: one small product each)."""
    for k in sorted(set(ks)):
        for bits, zero_points in PROBED_FORMATS:
            for threads in PROBED_THREADS:
                found = _row_difference(int(accuracy_level), bits, zero_points, int(k), threads)
                if found:
                    return found
    return None


def rows_at_once(accuracy_level: int, ks) -> bool:
    """Whether graphs at ``accuracy_level`` may multiply all rows in one MatMulNBits call and stay exact per row on
    this CPU (products of input sizes ``ks``): int8 activations (:data:`ROW_INDEPENDENT_LEVELS`) where the kernel is
    measured row-exact here (:func:`row_difference`)."""
    return int(accuracy_level) in ROW_INDEPENDENT_LEVELS and row_difference(accuracy_level, ks) is None


def row_by_row(helper, inputs: list[str], attributes: dict, y: str, stem: str, k: int, n: int) -> list:
    """Nodes computing ``y`` [1, r, N] = MatMulNBits(``inputs``) for each row of ``inputs[0]`` [1, r, K] on its own
    (a ``Scan`` over the rows; the weights stay outer-scope initializers, packed once).

    Why: onnxruntime's MatMulNBits takes another kernel for two or more rows (it dequantizes, then runs a GEMM) whose
    results differ from the one-row kernel's in the last bits (measured: ~5e-7 relative at accuracy level 1). A
    verify pass must reproduce the target alone's one-token passes bit for bit, so its rows go through the one-row
    kernel. Cost: r one-row products instead of one r-row product (the weights are streamed r times), which is why
    the prefill runs a graph of its own (``<name>.prefill.onnx``, plain products: the same pass for the target alone
    and for every drafter); one-row passes run that graph too, its one-row product being the ``Scan``'s row bit for
    bit (asserted). Measured, and not used: choosing between the two inside one graph (``If``) kept onnxruntime from
    packing the weights (20x slower). Int8 activations (accuracy level 4) need none of this where that kernel computes
    each row alone (:data:`ROW_INDEPENDENT_LEVELS`: CPUs with AVX-512), so those graphs multiply all rows at once and
    verify cheaply; on a CPU where it does not (AVX2 without AVX-512) they go row by row too (:func:`rows_at_once`).
    """
    from onnx import TensorProto

    x, weights = inputs[0], inputs[1:]
    body = helper.make_graph(
        [helper.make_node("Unsqueeze", [f"{stem}.row", f"{stem}.axis0"], [f"{stem}.row2"]),
         helper.make_node("MatMulNBits", [f"{stem}.row2", *weights], [f"{stem}.y2"], name=f"{stem}.nbits",
                          domain="com.microsoft", **attributes),
         helper.make_node("Squeeze", [f"{stem}.y2", f"{stem}.axis0"], [f"{stem}.y1"])],
        f"{stem}.per_row",
        [helper.make_tensor_value_info(f"{stem}.row", TensorProto.FLOAT, [k])],
        [helper.make_tensor_value_info(f"{stem}.y1", TensorProto.FLOAT, [n])])
    return [helper.make_node("Squeeze", [x, f"{stem}.axis0"], [f"{stem}.rows"]),  # [1, r, K] -> [r, K]
            helper.make_node("Scan", [f"{stem}.rows"], [f"{stem}.ys"], body=body, num_scan_inputs=1),
            helper.make_node("Unsqueeze", [f"{stem}.ys", f"{stem}.axis0"], [y])]


def stacked(weights: list[NBitsWeight]) -> NBitsWeight | None:
    """The weights of several products of one input as one [ΣN, K] weight (rows stacked in order), or None when
    their formats differ. Each output column still reads only its own row's blocks, so the stacked product gives the
    separate products' columns (up to the kernel's blocking: the exported graphs are validated against the eager
    model, and a pass's rows against one-position passes, in the tests)."""
    first = weights[0]
    same = all(w.gguf_type == first.gguf_type and w.bits == first.bits and w.k == first.k
               and (w.zero_points is None) == (first.zero_points is None) and (w.mins is None) == (first.mins is None)
               for w in weights)
    if len(weights) < 2 or not same:
        return None

    def cat(arrays):
        return np.ascontiguousarray(np.concatenate(arrays, axis=0))

    return NBitsWeight(
        name="+".join(w.name for w in weights), gguf_type=first.gguf_type, bits=first.bits,
        n=sum(w.n for w in weights), k=first.k, codes=cat([w.codes for w in weights]),
        scales=cat([w.scales for w in weights]),
        zero_points=None if first.zero_points is None else cat([w.zero_points for w in weights]),
        mins=None if first.mins is None else cat([w.mins for w in weights]))


def quantize_graph(path: str | Path, model, weights: dict, *, accuracy_level: int = 0,
                   rows_one_by_one: bool = True, out: str | Path | None = None) -> dict:
    """Replace, in the ONNX file at ``path``, every ``MatMul`` by a float32 weight of ``model`` that ``weights`` holds
    with ``MatMulNBits`` over that weight's GGUF blocks; returns ``{"replaced": n, "types": {gguf type: n}}``.
    The result is written to ``out`` (default: over ``path``), so two graphs can be made from one float32 file without
    a float32 copy of it on disk.

    Weights are recognised by value (torch exports ``x @ W^T`` with the transposed weight as an initializer), so the
    rewrite needs no knowledge of the exporter's initializer names. ``accuracy_level`` 0 computes in float32 (the
    file's weights, float32 activations); 4 quantizes activations to int8 per block (faster, lossy).
    ``rows_one_by_one`` computes every product row by row (:func:`row_by_row`), so a pass over n positions reproduces
    n one-position passes; without it (the prefill graph) the rows are multiplied at once.
    Products of the same input (q/k/v, gate/up) become one ``MatMulNBits`` over their stacked blocks and a ``Split``
    (:func:`stacked`): a one-token pass is ~2,000 small onnxruntime nodes, and each costs microseconds of dispatch.

    ``weights`` of :class:`~kangaroo_backends.block_weights.BlockWeight` (any weight with ``onnx_node`` and ``stack``)
    become ``kangaroo.BlockMatMul`` nodes instead (kangaroo's block kernel: all rows at once, each row exact; int8
    activations at level 4, float32 below), stacked the same way; ``rows_one_by_one`` does not apply to them.
    """
    import onnx
    from onnx import helper, numpy_helper

    params = dict(model.named_parameters(remove_duplicate=False))
    by_digest = {}
    for name, weight in weights.items():
        by_digest[_digest(params[name].detach().float().t().numpy())] = (name, weight)
    proto = onnx.load(str(path))
    graph = proto.graph
    initializers = {init.name: init for init in graph.initializer}
    found: dict[int, NBitsWeight] = {}  # node index -> its weight
    for index, node in enumerate(graph.node):
        init = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        hit = by_digest.get(_digest(numpy_helper.to_array(init))) if init is not None and len(init.dims) == 2 else None
        if hit is None:
            continue
        name, weight = hit
        if tuple(init.dims) != (weight.k, weight.n):
            raise UnsupportedQuantization(f"{path}: weight {name} has shape {tuple(init.dims)} in the graph, "
                                          f"[{weight.k}, {weight.n}] in the GGUF file")
        found[index] = weight
    by_input: dict[str, list[int]] = {}
    for index in found:
        by_input.setdefault(graph.node[index].input[0], []).append(index)
    counts: dict[str, int] = {}
    new_inits, nodes = [], []

    def emit(x: str, weight, outputs: list[str], splits: list[int]) -> None:
        """MatMulNBits (+ Q4_1's minimum term) of ``x`` by ``weight``, into ``outputs`` (split along N by ``splits``)."""
        if hasattr(weight, "onnx_node"):
            return emit_blocks(x, weight, outputs, splits)
        stem = f"nbits.{weight.name}"
        new_inits.extend([numpy_helper.from_array(weight.codes, f"{stem}.codes"),
                          numpy_helper.from_array(weight.scales, f"{stem}.scales")])
        inputs = [x, f"{stem}.codes", f"{stem}.scales"]
        if weight.zero_points is not None:
            new_inits.append(numpy_helper.from_array(weight.zero_points, f"{stem}.zero_points"))
            inputs.append(f"{stem}.zero_points")
        whole = outputs[0] if len(outputs) == 1 else f"{stem}.stacked"
        product = whole if weight.mins is None else f"{stem}.scaled"
        attributes = dict(K=weight.k, N=weight.n, bits=weight.bits, block_size=BLOCK, accuracy_level=int(accuracy_level))
        if rows_one_by_one:
            new_inits.append(numpy_helper.from_array(np.array([0], dtype=np.int64), f"{stem}.axis0"))
            nodes.extend(row_by_row(helper, inputs, attributes, product, stem, weight.k, weight.n))
        else:
            nodes.append(helper.make_node("MatMulNBits", inputs, [product], name=f"{stem}.nbits", domain="com.microsoft",
                                          **attributes))
        if weight.mins is not None:  # + m · (sum of x over each block): [1, n, K] -> [1, n, K/32] @ [K/32, N]
            new_inits.extend([
                numpy_helper.from_array(np.array([0, 0, weight.blocks, BLOCK], dtype=np.int64), f"{stem}.split"),
                numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{stem}.last"),
                numpy_helper.from_array(np.ascontiguousarray(weight.mins.T), f"{stem}.mins")])
            nodes.extend([helper.make_node("Reshape", [x, f"{stem}.split"], [f"{stem}.blocked"]),
                          helper.make_node("ReduceSum", [f"{stem}.blocked", f"{stem}.last"], [f"{stem}.sums"], keepdims=0),
                          helper.make_node("MatMul", [f"{stem}.sums", f"{stem}.mins"], [f"{stem}.offset"]),
                          helper.make_node("Add", [f"{stem}.scaled", f"{stem}.offset"], [whole])])
        if len(outputs) > 1:
            new_inits.append(numpy_helper.from_array(np.array(splits, dtype=np.int64), f"{stem}.parts"))
            nodes.append(helper.make_node("Split", [whole, f"{stem}.parts"], outputs, axis=-1))

    def emit_blocks(x: str, weight, outputs: list[str], splits: list[int]) -> None:
        stem = f"blocks.{weight.name}"
        whole = outputs[0] if len(outputs) == 1 else f"{stem}.stacked"
        node, inits = weight.onnx_node(x, whole, accuracy_level, stem)
        nodes.append(node)
        new_inits.extend(inits)
        if len(outputs) > 1:
            new_inits.append(numpy_helper.from_array(np.array(splits, dtype=np.int64), f"{stem}.parts"))
            nodes.append(helper.make_node("Split", [whole, f"{stem}.parts"], outputs, axis=-1))

    for index, node in enumerate(graph.node):
        if index not in found:
            nodes.append(node)
            continue
        group = by_input[node.input[0]]
        stack = type(found[index]).stack if hasattr(found[index], "onnx_node") else stacked
        merged = stack([found[i] for i in group])
        if merged is None:  # alone (or formats that cannot stack): its own product
            emit(node.input[0], found[index], list(node.output), [])
        elif index == group[0]:  # the whole group at its first member (they all read the same input)
            emit(node.input[0], merged, [graph.node[i].output[0] for i in group], [found[i].n for i in group])
        counts[found[index].gguf_type] = counts.get(found[index].gguf_type, 0) + 1
    replace_nodes(proto, nodes, new_inits)
    onnx.save(proto, str(path if out is None else out))
    return {"replaced": sum(counts.values()), "types": counts, "rows_one_by_one": rows_one_by_one}


def replace_nodes(proto, nodes: list, new_inits: list) -> None:
    """Give ``proto``'s graph these ``nodes``, keep the initializers they still read, add ``new_inits``, and import
    every custom domain they use (opset 1)."""
    from onnx import helper

    graph = proto.graph
    used = {i for node in nodes for i in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    for domain in {node.domain for node in nodes if node.domain not in ("", "ai.onnx")}:
        if not any(op.domain == domain for op in proto.opset_import):
            proto.opset_import.append(helper.make_opsetid(domain, 1))
