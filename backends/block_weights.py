"""GGUF blocks repacked for kangaroo's own block kernel (``block_matmul.c``): every block read once for all the rows of
a pass, each row computed exactly as it would be alone.

Why not ``MatMulNBits``: at int8 activations (accuracy level 4) onnxruntime computes each row of a multi-row product
alone, streaming the weights once per row, so a verify pass over 8 rows costs 1.75 one-row passes (docs/backends.md)
and a round of speculation is spent on verifying it. It also maps only Q4_0, Q4_1 and Q8_0 exactly (Gemma 3's Q4_K,
Q5_0 and Q6_K have no ``MatMulNBits`` form). Here a column's block is unpacked once into a register and multiplied
by every row's activations (see the C source).

Two families hold every format the shipped models use, each value exactly the float32 transformers' dequantization
gives (``gguf.quants.dequantize``; asserted in the tests):

* ``q4`` — 4-bit codes q in 0..15 (16 bytes a block of 32: element j in the low nibble of byte j, element j + 16 in
  the high one; GGUF's own order for Q4_0/Q4_1), a float32 scale s and offset m per block: w = s·q + m.
  Q4_0: s = d, m = −8d. Q4_1: s = d, m = m. Q4_K: per sub-block of 32, s = d·sc, m = −dmin·mn.
* ``q8`` — int8 codes, a float32 scale per ``sub`` (32 or 16) elements: w = s·q. Q8_0: q, d. Q5_0: q − 16, d.
  Q6_K: q − 32, d·sc per 16.

Q5_0 is stored a byte per code (the kernel has no 5-bit unpacking): 36 bytes a block against GGUF's 22.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import attrs
import numpy as np

from kangaroo_backends.gguf_nbits import BLOCK, UnsupportedQuantization, replace_nodes

#: the custom op running the kernel in onnxruntime (``ort_block_matmul.c``, built with ``ort_cached_attention.c``)
DOMAIN, OP = "kangaroo", "BlockMatMul"
#: GGUF block types this module repacks
SUPPORTED = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0")
FAMILIES = {"q4": 0, "q8": 1}
ACTIVATIONS = {"int8": 0, "float32": 1}
#: the kernel's instruction sets by the number block_matmul_isa() returns
ISAS = {0: "none", 1: "avx2", 2: "avx512-vnni"}
#: caps the kernel's path (:func:`requested_isa`)
ISA_ENV = "KANGAROO_ISA"
SUPER = 256  # elements per K-quant super-block


@attrs.frozen(eq=False)
class BlockWeight:
    """One [N, K] weight in a kernel family (see the module doc): ``codes`` [N, K/32, 16 or 32] uint8, ``scales``
    [N, K/sub] float32, ``mins`` [N, K/32] float32 (``q4`` only)."""

    name: str
    gguf_type: str
    family: str
    sub: int
    n: int
    k: int
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None

    @property
    def blocks(self) -> int:
        return self.k // BLOCK

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.mins) if a is not None)

    def values(self) -> np.ndarray:
        """[N, K/32, 32] the integer codes q, as float32."""
        if self.family == "q4":
            c = self.codes.reshape(self.n, self.blocks, 16)
            return np.concatenate([c & 0xF, c >> 4], axis=-1).astype(np.float32)
        return self.codes.reshape(self.n, self.blocks, 32).view(np.int8).astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """The [N, K] float32 weight the kernel's float32 path multiplies by (s·q + m in float32; s·q exact here)."""
        q = self.values()
        if self.family == "q4":
            w = q * self.scales.reshape(self.n, self.blocks, 1) + self.mins.reshape(self.n, self.blocks, 1)
        else:
            w = q.reshape(self.n, -1, self.sub) * self.scales.reshape(self.n, -1, 1)
        return w.reshape(self.n, self.k).astype(np.float32)

    def onnx_node(self, x: str, output: str, accuracy_level: int, stem: str) -> tuple[object, list]:
        """The graph rewrite's hook (:func:`~kangaroo_backends.gguf_nbits.quantize_graph`): see :func:`block_node`."""
        return block_node(x, self, output, activations_at(accuracy_level), stem)

    @staticmethod
    def stack(weights: list["BlockWeight"]) -> "BlockWeight | None":
        return stacked(weights)

    def rows(self, order: np.ndarray) -> "BlockWeight":
        """The same weight with its output rows in ``order`` (llama's q/k rows are stored permuted)."""
        def pick(a):
            return None if a is None else np.ascontiguousarray(a.reshape(self.n, -1)[order].reshape(a.shape))

        return attrs.evolve(self, codes=pick(self.codes), scales=pick(self.scales), mins=pick(self.mins))


def activations_at(accuracy_level: int) -> str:
    """The kernel's activations for a MatMulNBits-style accuracy level: 4 int8; 0 and 1 float32 (2 and 3, half
    precisions, have no block-kernel form)."""
    level = int(accuracy_level)
    if level == 4:
        return "int8"
    if level in (0, 1):
        return "float32"
    raise UnsupportedQuantization(f"the block kernel computes at accuracy level 0/1 (float32 activations) or 4 (int8), "
                                  f"not {level}")


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _pack4(q: np.ndarray) -> np.ndarray:
    """[.., 32] codes 0..15 → [.., 16] bytes: element j low nibble, element j + 16 high nibble."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def from_gguf(name: str, gguf_type: str, raw: np.ndarray, n: int, k: int) -> BlockWeight:
    """Repack one GGUF tensor's raw blocks ([N, bytes per row] uint8) into a kernel family."""
    if gguf_type not in SUPPORTED:
        raise UnsupportedQuantization(f"GGUF tensor {name} is {gguf_type}; kangaroo's block kernel reads "
                                      f"{', '.join(SUPPORTED)} only")
    blocks = k // BLOCK
    if k % (SUPER if gguf_type.endswith("_K") else BLOCK):
        raise UnsupportedQuantization(f"GGUF tensor {name} ({gguf_type}): K = {k} is not a multiple of its block")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)

    def q4(codes, s, m):
        return BlockWeight(name, gguf_type, "q4", BLOCK, n, k, np.ascontiguousarray(codes.reshape(n, blocks, 16)),
                           np.ascontiguousarray(s.reshape(n, blocks), dtype=np.float32),
                           np.ascontiguousarray(m.reshape(n, blocks), dtype=np.float32))

    def q8(values, s, sub):
        codes = np.ascontiguousarray(values.astype(np.int8).reshape(n, blocks, 32)).view(np.uint8)
        return BlockWeight(name, gguf_type, "q8", sub, n, k, codes,
                           np.ascontiguousarray(s.reshape(n, k // sub), dtype=np.float32))

    if gguf_type == "Q4_0":
        b = raw.reshape(n, blocks, 18)
        d = _f16(b[..., 0:2])
        return q4(b[..., 2:], d, -8 * d)
    if gguf_type == "Q4_1":
        b = raw.reshape(n, blocks, 20)
        return q4(b[..., 4:], _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    if gguf_type == "Q8_0":
        b = raw.reshape(n, blocks, 34)
        return q8(b[..., 2:].view(np.int8), _f16(b[..., 0:2]), BLOCK)
    if gguf_type == "Q5_0":
        b = raw.reshape(n, blocks, 22)
        high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # bit j: element j's fifth bit
        qs = b[..., 6:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (high << 4)
        return q8(q.astype(np.int16) - 16, _f16(b[..., 0:2]), BLOCK)
    from gguf.quants import Q4_K

    supers = k // SUPER
    if gguf_type == "Q4_K":
        b = raw.reshape(n, supers, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        s = d[..., None] * sc.reshape(n, supers, 8).astype(np.float32)
        m = -(dmin[..., None] * mn.reshape(n, supers, 8).astype(np.float32))
        qs = b[..., 16:].reshape(n, supers, 4, 32)  # chunk c: low nibbles sub-block 2c, high nibbles 2c + 1
        values = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, blocks, 32)
        return q4(_pack4(values), s, m)
    # Q6_K: ql [128], qh [64], scales [16] int8, d
    b = raw.reshape(n, supers, 210)
    ql, qh = b[..., :128], b[..., 128:192]
    sc, d = b[..., 192:208].view(np.int8).astype(np.float32), _f16(b[..., 208:210])
    low = (ql.reshape(n, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
    high = (qh.reshape(n, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = (low.reshape(n, supers, 2, 4, 32) | (high.reshape(n, supers, 2, 4, 32) << 4)).astype(np.int16) - 32
    return q8(q.reshape(n, k), (d[..., None] * sc).reshape(n, -1), 16)


def read_block_weights(gguf_path, config) -> dict[str, BlockWeight]:
    """Every linear weight of a GGUF file by its transformers parameter name, repacked (see
    :func:`~kangaroo_backends.gguf_nbits.read_linear_weights`, which this shares its tensor walk with)."""
    from kangaroo_backends.gguf_nbits import read_linear_weights

    return read_linear_weights(gguf_path, config, convert=from_gguf)


def stacked(weights: list[BlockWeight]) -> BlockWeight | None:
    """Several weights of one input as one (columns stacked in order), or None when their families differ."""
    first = weights[0]
    if len(weights) < 2 or any((w.family, w.sub, w.k) != (first.family, first.sub, first.k) for w in weights):
        return None

    def cat(arrays):
        return np.ascontiguousarray(np.concatenate(arrays, axis=0))

    return BlockWeight("+".join(w.name for w in weights), "+".join(dict.fromkeys(w.gguf_type for w in weights)),
                       first.family, first.sub, sum(w.n for w in weights), first.k, cat([w.codes for w in weights]),
                       cat([w.scales for w in weights]),
                       None if first.mins is None else cat([w.mins for w in weights]))


# -- graphs ---------------------------------------------------------------------------------------------------------
def block_node(x: str, weight: BlockWeight, output: str, activations: str, stem: str) -> tuple[object, list]:
    """The ``kangaroo.BlockMatMul`` node computing ``output`` = ``x`` · ``weight``ᵀ, and its initializers."""
    from onnx import helper, numpy_helper

    mins = weight.mins if weight.mins is not None else np.zeros(0, dtype=np.float32)
    inits = [numpy_helper.from_array(weight.codes.reshape(-1), f"{stem}.codes"),
             numpy_helper.from_array(weight.scales.reshape(-1), f"{stem}.scales"),
             numpy_helper.from_array(mins.reshape(-1), f"{stem}.mins")]
    node = helper.make_node(OP, [x, f"{stem}.codes", f"{stem}.scales", f"{stem}.mins"], [output],
                            name=f"{stem}.matmul", domain=DOMAIN, family=FAMILIES[weight.family], sub=weight.sub,
                            N=weight.n, K=weight.k, activations=ACTIVATIONS[activations])
    return node, inits


def quantize_float_products(path, activations: str) -> int:
    """Rewrite, in the ONNX file at ``path``, every ``MatMul`` by a float32 weight (an initializer [K, N], K a multiple
    of 32) as ``BlockMatMul`` over that weight quantized to Q8_0 (gguf's own quantizer); returns how many.

    For a drafter's own float32 weights (the adapter, its draft head) on a backend running the block kernel: the
    draft step then streams a quarter of the bytes. Drafts may change slightly (never the output: the verifier
    decides every token)."""
    import onnx
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    for node in graph.node:  # weights the exporter left as Constant nodes (e.g. a draft head built by indexing)
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            inits.setdefault(node.output[0], node.attribute[0].t)
    nodes, added, done = [], [], 0
    for node in graph.node:
        init = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if init is None or len(init.dims) != 2 or init.dims[0] % BLOCK or init.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        w = np.ascontiguousarray(numpy_helper.to_array(init).T)  # [N, K]
        raw = quantize(w, GGMLQuantizationType.Q8_0)
        packed = from_gguf(init.name, "Q8_0", raw, w.shape[0], w.shape[1])
        new, new_inits = block_node(node.input[0], packed, node.output[0], activations, f"blocks.q8.{done}")
        nodes.append(new)
        added.extend(new_inits)
        done += 1
    if not done:
        return 0
    replace_nodes(proto, nodes, added)
    onnx.save(proto, str(path))
    return done


# -- the kernel, called directly (tests, checks) ----------------------------------------------------------------------
SOURCES = ("block_matmul.c",)


@functools.lru_cache(maxsize=None)
def library() -> tuple[ctypes.CDLL | None, str]:
    """The kernel built alone (no onnxruntime), or ``(None, why not)``."""
    from kangaroo_backends import native

    flags = tuple(f for f in native.FLAGS if f != "-fopenmp")
    path, why = native.build_packaged(SOURCES, flags, "block_matmul", "the block kernel")
    if path is None:
        return None, why
    lib = ctypes.CDLL(str(path))
    lib.block_matmul.restype = ctypes.c_int
    lib.block_matmul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                                 ctypes.c_void_p]
    lib.block_matmul_force_isa.argtypes = [ctypes.c_int]
    return lib, ""


def requested_isa() -> str | None:
    """The path ``$KANGAROO_ISA`` caps the kernel at (``avx2``, ``avx512-vnni``; None: unset or ``auto``, the best the
    CPU has); any other value is a :class:`~kangaroo_core.config.ConfigError` in one line. With ``avx2`` a CPU with
    AVX-512 runs the kernel — the directly called one and the onnxruntime op — on the AVX2 path, as a CPU without
    AVX-512 would (read by the C side when the kernel picks its path, ``block_matmul.c``)."""
    want = os.environ.get(ISA_ENV, "").strip()
    if want in ("", "auto"):
        return None
    if want not in ISAS.values() or want == "none":
        from kangaroo_core.config import ConfigError

        raise ConfigError(f"{ISA_ENV} must be auto, avx2 or avx512-vnni, got {want!r}")
    return want


def isa() -> str:
    """The instruction set the kernel runs on this CPU (``none``: no AVX2, the block kernel refuses), at most the one
    ``$KANGAROO_ISA`` names (:func:`requested_isa`)."""
    requested_isa()
    lib, _ = library()
    return "none" if lib is None else ISAS[lib.block_matmul_isa()]


def available_isas() -> list[str]:
    """Every path the kernel can run on this CPU (``avx2``, then ``avx512-vnni`` where the CPU has it and
    ``$KANGAROO_ISA`` allows it): what the tests run the kernel on, each in turn."""
    best = isa()
    return [] if best == "none" else ["avx2"] + (["avx512-vnni"] if best == "avx512-vnni" else [])


def _libraries() -> list:
    """The kernel's loaded copies: the directly called library, and the onnxruntime op's (the handle onnxruntime
    opens is the same one: one path, one loaded object) where it can be built."""
    from kangaroo_backends import ort_attention

    lib, why = library()
    if lib is None:
        raise RuntimeError(why)
    found = [lib]
    op_path, _ = ort_attention.library()
    if op_path is not None:
        op = ctypes.CDLL(str(op_path))
        op.block_matmul_force_isa.argtypes = [ctypes.c_int]
        found.append(op)
    return found


def force_isa(name: str | None) -> None:
    """Run the kernel — called directly and as the onnxruntime op — on ``name`` (``avx2``, ``avx512-vnni``, or
    ``none``: the refusal of a CPU without AVX2; None: back to :func:`isa`'s choice); ValueError above what this CPU
    has (or ``$KANGAROO_ISA`` allows)."""
    code = -1 if name is None else {v: k for k, v in ISAS.items()}[name]
    libraries = _libraries()
    if any(lib.block_matmul_force_isa(code) != 0 for lib in libraries):
        for lib in libraries:
            lib.block_matmul_force_isa(-1)
        capped = f" ({ISA_ENV}={requested_isa()})" if requested_isa() else ""
        raise ValueError(f"this CPU has no {name}{capped}")


@contextlib.contextmanager
def forced_isa(name: str):
    """The kernel on ``name`` inside the block (:func:`force_isa`), back to the automatic choice after it."""
    force_isa(name)
    try:
        yield
    finally:
        force_isa(None)


def matmul(weight: BlockWeight, x: np.ndarray, activations: str = "int8") -> np.ndarray:
    """x [rows, K] float32 · weight^T → [rows, N] through the kernel, on the calling thread."""
    lib, why = library()
    if lib is None:
        raise RuntimeError(why)
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], weight.n), dtype=np.float32)
    status = lib.block_matmul(FAMILIES[weight.family], weight.sub, weight.n, weight.k, weight.codes.ctypes.data,
                              weight.scales.ctypes.data, None if weight.mins is None else weight.mins.ctypes.data,
                              ACTIVATIONS[activations], x.ctypes.data, x.shape[0], y.ctypes.data)
    if status == -1:
        raise RuntimeError("kangaroo's block kernel needs a CPU with AVX2 and FMA")
    if status:
        raise ValueError(f"block kernel refused the call ({status})")
    return y
