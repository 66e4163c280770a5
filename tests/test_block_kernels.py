"""kangaroo's block kernel (``block_matmul.c``): GGUF blocks repacked exactly, products against a plain reference,
every row exact whatever rows come with it, both instruction sets, the onnxruntime op, and the 4-bit backend on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

from kangaroo_backends import block_weights  # noqa: E402
from kangaroo_backends.block_weights import SOURCES, UnsupportedQuantization, from_gguf  # noqa: E402

if block_weights.library()[0] is None or block_weights.isa() == "none":
    pytest.skip(f"the block kernel cannot run here: {block_weights.library()[1] or 'no AVX2'}", allow_module_level=True)

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0]
#: instruction sets this CPU can run the kernel on (avx512-vnni implies avx2; KANGAROO_ISA=avx2 leaves avx2 alone):
#: every test of the kernel's arithmetic runs on each
ISAS = block_weights.available_isas()


def weight(qtype, n=37, k=None, seed=0):
    """A random [n, k] weight quantized to ``qtype`` (k: 288 = 9 blocks, a tail group of one; 512 for K-quants),
    with one flat block (Q4_1 / Q4_K then store d = 0), repacked; and the float32 values gguf dequantizes it to."""
    k = k or (512 if qtype.name.endswith("_K") else 288)
    rng = np.random.default_rng(seed)
    if qtype.name.endswith("_K"):  # gguf-py cannot quantize K-quants: random blocks with sane half-precision scales
        raw = k_quant_blocks(qtype, n, k, rng)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[1, 32:64] = 0.25
        raw = quants.quantize(w, qtype)
    return from_gguf("t", qtype.name, raw, n, k), quants.dequantize(raw, qtype).reshape(n, k)


def k_quant_blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """[n, k/256 · block bytes] random Q4_K / Q6_K blocks: random codes and sub-scales, d (and dmin) small halves."""
    supers = n * k // 256

    def halves(scale):
        return (rng.uniform(0.5, 1.0, (supers, 1)) * scale).astype(np.float16).view(np.uint8)

    if qtype == QT.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        body = rng.integers(0, 256, (supers, 140), dtype=np.uint8)
        blocks = np.concatenate([halves(0.01), halves(0.005), body], axis=1)
    else:  # Q6_K: ql 128, qh 64, 16 int8 scales, d
        body = rng.integers(0, 256, (supers, 192), dtype=np.uint8)
        scales = rng.integers(-64, 64, (supers, 16)).astype(np.int8).view(np.uint8)
        blocks = np.concatenate([body, scales, halves(0.002)], axis=1)
    return blocks.reshape(n, -1)


def int8_reference(x: np.ndarray) -> np.ndarray:
    """Activations as the int8 path sees them: per row and block of 32, q = round-half-even(x / (amax / 127))."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.rint(blocks * inv)
    return (q * d).reshape(x.shape).astype(np.float64)


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_blocks_dequantize_exactly_as_gguf(qtype):
    packed, reference = weight(qtype)
    np.testing.assert_array_equal(packed.dequantize(), reference)  # bit for bit: what transformers loads
    assert packed.family == ("q4" if qtype.name.startswith("Q4") else "q8")
    assert packed.sub == (16 if qtype == QT.Q6_K else 32)


def test_other_types_and_ragged_sizes_are_refused_in_one_line():
    with pytest.raises(UnsupportedQuantization, match=r"^GGUF tensor w is Q5_K; kangaroo's block kernel reads .*only$"):
        from_gguf("w", "Q5_K", np.zeros((2, 176), np.uint8), 2, 256)
    with pytest.raises(UnsupportedQuantization, match=r"K = 288 is not a multiple of its block"):
        from_gguf("w", "Q4_K", np.zeros((2, 144), np.uint8), 2, 288)
    with pytest.raises(UnsupportedQuantization, match="accuracy level 0/1 .* or 4 .*not 2"):
        block_weights.activations_at(2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_products_match_the_dequantized_reference_and_every_row_is_exact(qtype, isa):
    """float32 activations: the product of the exact dequantized weight (float64 reference) to float32 rounding;
    int8: the same with the activations quantized as the kernel does. Any n rows give each row the bits of its
    one-row call; 1..16 rows (two tiles of 8, the few-rows and the rows-in-lanes paths)."""
    packed, reference = weight(qtype)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, packed.k)).astype(np.float32)
    x[3, :32] = 0.0  # a block of zero activations (scale 0)
    block_weights.force_isa(isa)
    try:
        for activations in ("float32", "int8"):
            alone = np.stack([block_weights.matmul(packed, x[i:i + 1], activations)[0] for i in range(16)])
            for rows in range(1, 17):
                together = block_weights.matmul(packed, x[:rows], activations)
                np.testing.assert_array_equal(together.view(np.uint32), alone[:rows].view(np.uint32))
            xs = x.astype(np.float64) if activations == "float32" else int8_reference(x)
            expected = xs @ reference.astype(np.float64).T
            scale = np.abs(expected).max()
            assert np.abs(alone - expected).max() <= 2e-6 * scale * np.sqrt(packed.k / 32)
    finally:
        block_weights.force_isa(None)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_two_instruction_sets_agree_bit_for_bit(qtype):
    if len(ISAS) < 2:
        pytest.skip(f"the kernel has one path here, {ISAS[0]} (no AVX-512 VNNI, or KANGAROO_ISA=avx2)")
    packed, _ = weight(qtype, n=19)
    x = np.random.default_rng(2).standard_normal((11, packed.k)).astype(np.float32)
    results = []
    for isa in ISAS:
        block_weights.force_isa(isa)
        results.append([block_weights.matmul(packed, x, a) for a in ("int8", "float32")])
    block_weights.force_isa(None)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_kernel_without_avx2_refuses_in_one_line():
    """On a CPU without AVX2 the kernel has no path: the call says so (forced here: the C side's own refusal)."""
    block_weights.force_isa("none")
    try:
        with pytest.raises(RuntimeError, match="^kangaroo's block kernel needs a CPU with AVX2 and FMA$"):
            block_weights.matmul(weight(QT.Q8_0)[0], np.ones((1, 288), np.float32))
    finally:
        block_weights.force_isa(None)
    if block_weights.isa() == "avx2":  # and nothing above the CPU's own set can be forced
        with pytest.raises(ValueError, match="this CPU has no avx512-vnni"):
            block_weights.force_isa("avx512-vnni")


def _op_graph(packed, activations: str, rows_dim="rows"):
    from onnx import TensorProto, helper, numpy_helper

    mins = packed.mins if packed.mins is not None else np.zeros(0, np.float32)
    node = helper.make_node(block_weights.OP, ["x", "codes", "scales", "mins"], ["y"], domain=block_weights.DOMAIN,
                            family=block_weights.FAMILIES[packed.family], sub=packed.sub, N=packed.n, K=packed.k,
                            activations=block_weights.ACTIVATIONS[activations])
    graph = helper.make_graph(
        [node], "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows_dim, packed.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows_dim, packed.n])],
        [numpy_helper.from_array(packed.codes.reshape(-1), "codes"),
         numpy_helper.from_array(packed.scales.reshape(-1), "scales"), numpy_helper.from_array(mins, "mins")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(block_weights.DOMAIN, 1)])


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q6_K, QT.Q8_0])
def test_the_onnxruntime_op_gives_the_kernels_bits_on_any_thread_count_and_path(qtype, tmp_path):
    """The op in onnxruntime gives the directly called kernel's bits at 1 and 2 threads, on each path the CPU has
    (forced in the op's own loaded library), and the paths give the same bits."""
    import onnxruntime as ort

    from kangaroo_backends import ort_attention

    packed, _ = weight(qtype, n=300)  # 19 chunks of 16 columns over the threads
    x = np.random.default_rng(3).standard_normal((1, 9, packed.k)).astype(np.float32)
    for activations in ("int8", "float32"):
        path = tmp_path / f"{activations}.onnx"
        onnx.save(_op_graph(packed, activations), str(path))
        sessions = []
        for threads in (1, 2):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            assert ort_attention.register_if_used(path, options)
            sessions.append(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
        first = None
        for isa in ISAS:
            with block_weights.forced_isa(isa):
                direct = block_weights.matmul(packed, x[0], activations)
                for session in sessions:
                    (y,) = session.run(None, {"x": x})
                    np.testing.assert_array_equal(y[0].view(np.uint32), direct.view(np.uint32), err_msg=isa)
            first = direct if first is None else first
            np.testing.assert_array_equal(direct.view(np.uint32), first.view(np.uint32), err_msg=isa)
        with block_weights.forced_isa("none"):  # the forcing reaches the op: with no path it refuses the call
            with pytest.raises(Exception, match="BlockMatMul: refused the call"):
                sessions[0].run(None, {"x": x})


def test_kangaroo_isa_runs_the_avx2_path_on_any_cpu_and_other_values_are_refused(tmp_path):
    """KANGAROO_ISA=avx2 (read when the kernel picks its path) gives a process the AVX2 path whatever the CPU has,
    with the bits this process gets from that path (under an emulator, the child runs natively: the same bits
    from a real CPU and an emulated one); an unknown value is refused in one line."""
    import os
    import subprocess
    import sys

    packed, _ = weight(QT.Q4_1)
    x = np.random.default_rng(4).standard_normal((11, packed.k)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "codes.npy", packed.codes)
    np.save(tmp_path / "scales.npy", packed.scales)
    np.save(tmp_path / "mins.npy", packed.mins)
    script = (
        "import sys, attrs, numpy as np\n"
        "from kangaroo_backends import block_weights as b\n"
        "from kangaroo_core.config import ConfigError\n"
        "try:\n"
        "    print(b.isa(), b.available_isas())\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc); sys.exit(0)\n"
        f"d = {str(tmp_path)!r}\n"
        f"w = b.BlockWeight('t', 'Q4_1', 'q4', 32, {packed.n}, {packed.k}, np.load(d + '/codes.npy'), "
        "np.load(d + '/scales.npy'), np.load(d + '/mins.npy'))\n"
        "for a in ('int8', 'float32'): np.save(f'{d}/{a}.npy', b.matmul(w, np.load(d + '/x.npy'), a))\n")

    def run(value):
        env = {**os.environ, block_weights.ISA_ENV: value}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run("avx2") == "avx2 ['avx2']"
    with block_weights.forced_isa("avx2"):
        for activations in ("int8", "float32"):
            here = block_weights.matmul(packed, x, activations)
            np.testing.assert_array_equal(np.load(tmp_path / f"{activations}.npy").view(np.uint32), here.view(np.uint32))
    assert run("avx512") == "refused: KANGAROO_ISA must be auto, avx2 or avx512-vnni, got 'avx512'"


def test_kangaroo_march_builds_the_kernels_for_another_cpu(monkeypatch, tmp_path):
    """KANGAROO_MARCH=x86-64-v3 builds for any CPU with AVX2 instead of this one (an emulated CPU's, whose compiler
    runs natively): another library than the -march=native one, one build whatever the CPU, and it runs (no AVX-512
    outside the kernel's own AVX-512 functions, which the path choice keeps from a CPU without it)."""
    import ctypes
    from importlib import resources

    from kangaroo_backends import native

    cc = native.compiler()
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    flags = tuple(f for f in native.FLAGS if f != "-fopenmp")
    sources = {name: resources.files("kangaroo_backends").joinpath(name).read_bytes() for name in SOURCES}
    here = native.build_library(cc, sources, flags, "block_matmul")
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.target_flags(flags) == tuple("-march=x86-64-v3" if f == "-march=native" else f for f in flags)
    portable = native.build_library(cc, sources, flags, "block_matmul")
    assert portable != here and portable.is_file()
    monkeypatch.setattr(native, "cpu_identity", lambda: "another CPU|avx2")
    assert native.build_library(cc, sources, flags, "block_matmul") == portable
    lib = ctypes.CDLL(str(portable))
    assert block_weights.ISAS[lib.block_matmul_isa()] == block_weights.isa()


def test_a_cpu_without_avx2_is_refused_in_one_line(tmp_path):
    from kangaroo_backends import onnx_backend, ort_attention
    from kangaroo_core.config import ConfigError
    from kangaroo_core.errors import OnnxModelError

    with block_weights.forced_isa("none"):  # what block_matmul_isa() says on such a CPU, in both loaded copies
        with pytest.raises(ConfigError, match=r"^kernel=blocks: kangaroo's block kernel is not available: this CPU "
                                              r"has no AVX2 and FMA$"):
            onnx_backend.resolve_kernel("blocks", onnx_backend.PROVIDERS["cpu"], 4)
        assert onnx_backend.resolve_kernel("auto", onnx_backend.PROVIDERS["cpu"], 4) == "matmulnbits"  # falls back
        with pytest.raises(OnnxModelError, match="needs a CPU with AVX2 and FMA; re-export with --onnx-kernel "
                                                 "matmulnbits"):
            ort_attention.require(tmp_path / "deep.onnx")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from test_gguf_nbits import write_tiny_gguf

    from kangaroo_apps.testing import tiny_llama

    model = tiny_llama(5, vocab=96, hidden=64, layers=3, heads=4, kv_heads=2, dtype=torch.float32,
                       tie_word_embeddings=False, init_std=0.3)
    return model, write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("level", [1, 4])
def test_the_4_bit_backend_on_the_block_kernel_is_lossless(tiny_gguf, tmp_path, level):
    """The export multiplies every linear layer on the block kernel (no MatMulNBits, no Scan, no prefill graph); a
    pass over n positions gives the logits of n one-position passes bit for bit, and Kangaroo equals its target
    alone; at float32 activations that is transformers' greedy output too."""
    from test_gguf_nbits import kangaroo_equals_target_alone

    from kangaroo_apps.testing import TinyTokenizer, check_rows_exact, hf_greedy
    from kangaroo_backends.gguf_nbits import ROWS_BLOCKS
    from kangaroo_backends.onnx_backend import OnnxBackend

    model, path = tiny_gguf
    backend = OnnxBackend(model, TinyTokenizer(96, model.generation_config.eos_token_id), 1, "tiny", provider="cpu",
                          threads=2, weights="gguf", accuracy_level=level, gguf_path=path, kernel="blocks")
    backend.export_dir = lambda: tmp_path / "export"  # not the user's cache
    backend._ensure()
    manifest = backend.manifest
    assert manifest["weights"]["format"] == "gguf-blocks" and manifest["weights"]["rows"] == ROWS_BLOCKS
    assert not any("prefill_file" in graph for graph in manifest["graphs"].values())
    ops = {node.op_type for name in ("shallow", "deep", "head")
           for node in onnx.load(str(tmp_path / "export" / f"{name}.onnx")).graph.node}
    assert block_weights.OP in ops and not ops & {"MatMulNBits", "Scan"}
    assert {p.name for p in backend.swapped} == {"shallow.onnx", "deep.onnx"}  # attention in place, beside the kernel
    check_rows_exact(backend, [7, 1, 30], [5, 17, 3, 88, 41, 9, 60, 2], splits=[(1, 7), (8,), (3, 5)])
    # each path the CPU has (forced in the op's library while the sessions run): rows exact, and the same logits
    passes = []
    for isa in ISAS:
        with block_weights.forced_isa(isa):
            check_rows_exact(backend, [7, 1, 30], [5, 17, 3, 88, 41, 9, 60, 2], splits=[(1, 7)])
            backend.reset()
            backend.deep(backend.shallow([7, 1, 30], 0), 0)
            passes.append(backend.deep(backend.shallow([5, 17, 3, 88, 41], 3), 3).logits)
    assert all(torch.equal(logits, passes[0]) for logits in passes)
    for prompt, vanilla in kangaroo_equals_target_alone(backend, [[(13 * seed + 3 * i) % 96 for i in range(7)]
                                                                 for seed in range(2)]):
        if level == 1:
            assert vanilla == hf_greedy(model, prompt, 30)
    # the drafter's own graph multiplies on the block kernel too (its float32 weights as Q8_0 blocks)
    (adapter_manifest,) = (tmp_path / "export" / "drafters").rglob("adapter_manifest.json")
    drafted = json.loads(adapter_manifest.read_text())["block_kernel"]
    assert drafted["products"] >= 3 and drafted["activations"] == ("int8" if level == 4 else "float32")


def test_gemma_block_types_export_where_matmulnbits_refuses(tiny_gguf, tmp_path):
    """A GGUF whose layers are Q5_0 (most of Gemma 3's Q4_K_M file; its Q4_K and Q6_K tensors are checked above and on
    the real model) exports on the block kernel; MatMulNBits refuses it in one line."""
    from test_gguf_nbits import write_tiny_gguf

    from kangaroo_apps.testing import tiny_llama
    from kangaroo_backends.onnx_export import export_onnx

    model = tiny_llama(6, vocab=96, hidden=256, layers=2, heads=4, kv_heads=2, dtype=torch.float32,
                       tie_word_embeddings=False, init_std=0.3)
    path = write_tiny_gguf(model, tmp_path / "mix.gguf", qtype=QT.Q5_0, head_type=QT.Q8_0)
    manifest = export_onnx(model, tmp_path / "b", exit_layer=1, weights="gguf", gguf_path=path, accuracy_level=1,
                           kernel="blocks", quiet=True)
    assert manifest["graphs"]["deep"]["matmul_nbits"]["types"] == {"Q5_0": 7}
    assert manifest["graphs"]["head"]["matmul_nbits"]["types"] == {"Q8_0": 1}
    with pytest.raises(UnsupportedQuantization, match="is Q5_0"):
        export_onnx(model, tmp_path / "c", exit_layer=1, weights="gguf", gguf_path=path, quiet=True)
