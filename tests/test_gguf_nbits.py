"""The GGUF file's own blocks on onnxruntime (MatMulNBits): block mapping, graph rewrite, the 4-bit backend."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

from kangaroo_backends.gguf_nbits import (  # noqa: E402
    LLAMA_NAMES,
    ROWS,
    ROWS_AT_ONCE,
    UnsupportedQuantization,
    from_gguf_blocks,
    read_linear_weights,
)


def blocks(qtype, n=6, k=96, seed=0, flat_block=False):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if flat_block:
        w[1, 32:64] = 0.25  # a block of equal values: Q4_1 stores d = 0
    return w, quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_blocks_dequantize_like_gguf(qtype):
    _, raw = blocks(qtype, flat_block=True)
    reference = quants.dequantize(raw, qtype)  # what transformers loads
    weight = from_gguf_blocks("t", qtype.name, raw, *reference.shape)
    np.testing.assert_array_equal(weight.dequantize(), reference)  # d·q (+ m): the same float32 operations


def test_unsupported_types_are_refused_in_one_line():
    with pytest.raises(UnsupportedQuantization, match=r"^GGUF tensor blk.0.ffn_up.weight is Q5_K; .* maps Q4_0, Q4_1, Q8_0 only$"):
        from_gguf_blocks("blk.0.ffn_up.weight", "Q5_K", np.zeros((2, 176), np.uint8), 2, 256)


def _matmul_nbits(weight, a):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(weight.codes, "B"), numpy_helper.from_array(weight.scales, "S")]
    names = ["A", "B", "S"]
    if weight.zero_points is not None:
        inits.append(numpy_helper.from_array(weight.zero_points, "Z"))
        names.append("Z")
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=weight.k, N=weight.n,
                            bits=weight.bits, block_size=32, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", weight.k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", weight.n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_onnxruntime_reads_the_blocks_as_gguf_does(qtype):
    """x = identity: MatMulNBits returns its dequantized weight, which must be transformers' bit for bit (Q4_1: the op
    gives d·q; the graph adds m over each block, here m[n, j // 32] for the one-hot row j)."""
    _, raw = blocks(qtype, n=8, k=64, seed=3, flat_block=True)
    reference = quants.dequantize(raw, qtype)
    weight = from_gguf_blocks("t", qtype.name, raw, 8, 64)
    got = _matmul_nbits(weight, np.eye(64, dtype=np.float32)).T
    if weight.mins is not None:
        got = got + np.repeat(weight.mins, 32, axis=1)
    np.testing.assert_array_equal(got, reference)


# -- a tiny Llama written as a real GGUF file (tensors only) --------------------------------------------------------
def _permute(w, heads):  # llama.cpp's convert_hf_to_gguf permute (what transformers reverses)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model, path, qtype=QT.Q4_1, head_type=QT.Q8_0):
    """Quantize ``model``'s linear layers into a GGUF file and set the model to the file's dequantized weights (what
    loading that file with transformers would give)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    params = dict(model.named_parameters(remove_duplicate=False))
    for i in range(cfg.num_hidden_layers):
        for gname, hf in LLAMA_NAMES.items():
            p = params[f"model.layers.{i}.{hf}.weight"]
            w = p.detach().float().numpy()
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(gname)
            stored = _permute(w, heads) if heads else w
            raw = quants.quantize(np.ascontiguousarray(stored), qtype)
            writer.add_tensor(f"blk.{i}.{gname}.weight", raw, raw_dtype=qtype)
            back = quants.dequantize(raw, qtype)
            if heads:  # undo the permutation the way transformers does
                dim = back.shape[0] // heads // 2
                back = back.reshape(heads, dim, 2, -1).swapaxes(2, 1).reshape(back.shape)
            with torch.no_grad():
                p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    head = model.lm_head.weight
    raw = quants.quantize(head.detach().float().numpy(), head_type)
    writer.add_tensor("output.weight", raw, raw_dtype=head_type)
    with torch.no_grad():
        head.copy_(torch.from_numpy(quants.dequantize(raw, head_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from kangaroo_apps.testing import tiny_llama

    model = tiny_llama(5, vocab=96, hidden=64, layers=3, heads=4, kv_heads=2, dtype=torch.float32,
                       tie_word_embeddings=False, init_std=0.3)
    path = write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, path


def test_products_of_one_input_stack_into_one_weight(tiny_gguf):
    """q/k/v (and gate/up) stack into one [ΣN, K] weight whose dequantization is theirs, row block by row block;
    weights of different formats do not stack."""
    from kangaroo_backends.gguf_nbits import stacked

    model, path = tiny_gguf
    weights = read_linear_weights(path, model.config)
    parts = [weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    merged = stacked(parts)
    assert merged is not None and merged.n == sum(p.n for p in parts) and merged.k == parts[0].k
    assert np.array_equal(merged.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    assert stacked(parts[:1]) is None
    other = attrs.evolve(parts[1], gguf_type="Q8_0", bits=8, mins=None)
    assert stacked([parts[0], other]) is None


def test_read_linear_weights_matches_the_dequantized_model(tiny_gguf):
    model, path = tiny_gguf
    weights = read_linear_weights(path, model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert len(weights) == 7 * model.config.num_hidden_layers + 1
    for name, weight in weights.items():
        ref = params[name].detach().numpy()
        np.testing.assert_array_equal(weight.dequantize(), ref)


@pytest.fixture(scope="module")
def gguf_bundle(tiny_gguf, tmp_path_factory):
    from kangaroo_backends.onnx_export import export_onnx

    model, path = tiny_gguf
    out = tmp_path_factory.mktemp("bundle") / "q4"
    manifest = export_onnx(model, out, exit_layer=1, weights="gguf", gguf_path=path, quiet=True)
    return out, manifest


def test_gguf_export_replaces_every_linear_layer(gguf_bundle):
    import onnx

    out, manifest = gguf_bundle
    assert manifest["weights"] == {"format": "gguf-matmulnbits", "gguf_file": "tiny.gguf", "accuracy_level": 1,
                                   "rows": ROWS}
    counts = {g: e["matmul_nbits"]["replaced"] for g, e in manifest["graphs"].items()}
    assert counts == {"shallow": 7, "deep": 14, "head": 0}  # the Q8_0 head stays float32 at float32 activations
    assert manifest["graphs"]["head"]["matmul_nbits"]["kept_float32"] == {"lm_head.weight": "Q8_0"}
    for name in ("shallow", "deep"):
        graph = onnx.load(str(out / f"{name}.onnx")).graph
        ops = [n.op_type for n in graph.node]
        layers = counts[name] // 7
        products = 4 * layers  # q/k/v stacked into one product, o, gate/up stacked, down
        assert ops.count("Split") == 2 * layers
        assert "MatMulNBits" not in ops  # every product row by row, inside a Scan
        bodies = [a.g for n in graph.node if n.op_type == "Scan" for a in n.attribute if a.name == "body"]
        assert [[n.op_type for n in body.node] for body in bodies] == [["Unsqueeze", "MatMulNBits", "Squeeze"]] * products
        assert manifest["graphs"][name]["prefill_file"] == f"{name}.prefill.onnx"  # the prefill: rows at once
        prefill_ops = [n.op_type for n in onnx.load(str(out / f"{name}.prefill.onnx")).graph.node]
        assert prefill_ops.count("MatMulNBits") == products and "Scan" not in prefill_ops
        assert not [i for i in graph.initializer if len(i.dims) == 2 and i.dims[0] * i.dims[1] >= 64 * 64
                    and i.data_type == 1 and name != "shallow"]  # no float32 weight matrix left (shallow: embedding)
    listed = {e[key] for e in manifest["graphs"].values() for key in ("file", "prefill_file") if key in e}
    assert {p.name for p in out.iterdir() if p.is_file()} == listed | {"manifest.json"}  # nothing else left on disk


def test_two_graphs_are_quantized_from_one_float32_file_without_copying_it(tiny_gguf, tmp_path):
    """The prefill graph is written straight from the float32 export (``out=``), so an export never holds a second
    float32 copy of a graph on disk (SmolLM2's deep graph is 400 MB); the float32 file is left as it was."""
    import onnx

    from kangaroo_backends.gguf_nbits import quantize_graph
    from kangaroo_backends.onnx_export import export_onnx

    model, path = tiny_gguf
    export_onnx(model, tmp_path / "f32", exit_layer=1, quiet=True)
    source = tmp_path / "f32" / "deep.onnx"
    before = source.read_bytes()
    weights = {n: w for n, w in read_linear_weights(path, model.config).items() if n.startswith("model.layers.")
               and int(n.split(".")[2]) >= 1}
    done = quantize_graph(source, model, weights, rows_one_by_one=False, out=tmp_path / "prefill.onnx")
    assert done["replaced"] == len(weights) == 14 and source.read_bytes() == before
    ops = [n.op_type for n in onnx.load(str(tmp_path / "prefill.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 8 and "Scan" not in ops  # q/k/v and gate/up stacked: 4 products per layer


def test_int8_activations_also_take_the_8_bit_head(tiny_gguf, tmp_path):
    from kangaroo_backends.onnx_export import export_onnx

    model, path = tiny_gguf
    manifest = export_onnx(model, tmp_path / "a4", exit_layer=1, weights="gguf", gguf_path=path, accuracy_level=4,
                           quiet=True)
    assert manifest["graphs"]["head"]["matmul_nbits"]["types"] == {"Q8_0": 1}
    assert manifest["graphs"]["deep"]["validation"]["tolerance"] > manifest["graphs"]["deep"]["validation"]["max_abs_diff"]


def kangaroo_equals_target_alone(backend, prompts, max_new_tokens: int = 30) -> list[tuple[list[int], list[int]]]:
    """Kangaroo (eta 0: always drafting, gamma 5) on ``backend`` emits its target alone's tokens for every prompt,
    through real multi-position verify passes; returns (prompt, the target alone's tokens) pairs."""
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_plugins.greedy_verifier import GreedyVerifier
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
    from kangaroo_policies.threshold import ThresholdPolicy

    config = DecodeConfig(eta=0.0, gamma=5, exit_layer=1, max_new_tokens=max_new_tokens)
    pairs = []
    for prompt in prompts:
        vanilla = Engine(backend, None, ThresholdPolicy(eta=0.0), GreedyVerifier(), config).generate_ids(prompt)
        drafted = Engine(backend, KangarooDrafter(), ThresholdPolicy(eta=0.0), GreedyVerifier(), config).generate_ids(prompt)
        assert drafted.token_ids == vanilla.token_ids
        assert sum(r.drafted for r in drafted.rounds) >= 5 * 3  # multi-position verify passes really ran
        pairs.append((prompt, vanilla.token_ids))
    return pairs


def test_kangaroo_on_the_gguf_backend_is_lossless(tiny_gguf, gguf_bundle):
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_apps.testing import TinyTokenizer, hf_greedy

    model, _ = tiny_gguf
    out, _ = gguf_bundle
    backend = OnnxBackend(model, TinyTokenizer(96, model.generation_config.eos_token_id), 1, "tiny", bundle=out,
                          provider="cpu")
    for prompt, vanilla in kangaroo_equals_target_alone(backend, [[(13 * seed + 3 * i) % 96 for i in range(7)]
                                                                 for seed in range(3)]):
        assert vanilla == hf_greedy(model, prompt, 30)  # same weights as transformers' float32 model
    assert backend.weights == "gguf"


def test_gguf_weights_need_a_gguf_model(tiny_gguf):
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_core.config import ConfigError
    from kangaroo_apps.testing import TinyTokenizer

    model, _ = tiny_gguf
    with pytest.raises(ConfigError, match="weights=gguf needs a model loaded from a GGUF file"):
        OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", weights="gguf")
    with pytest.raises(ConfigError, match="accuracy_level applies to weights=gguf only"):
        OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", accuracy_level=4)


def test_a_gguf_with_an_unmapped_type_is_refused(tiny_gguf, tmp_path):
    from kangaroo_backends.onnx_export import export_onnx

    model, _ = tiny_gguf
    bad = tmp_path / "q5.gguf"
    writer = gguf.GGUFWriter(str(bad), "llama")
    w = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    writer.add_tensor("blk.0.ffn_up.weight", quants.quantize(w, QT.Q5_0), raw_dtype=QT.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedQuantization, match="is Q5_0"):
        export_onnx(model, tmp_path / "out", exit_layer=1, weights="gguf", gguf_path=bad, quiet=True)
    assert not (tmp_path / "out").exists()


def not_row_exact(monkeypatch):
    """Make this process see MatMulNBits' int8 kernel as a CPU with AVX2 alone has it (not row-exact: onnxruntime's
    AVX2 kernel takes another path for one row than for several), whatever this CPU has."""
    from kangaroo_backends import gguf_nbits

    monkeypatch.setattr(gguf_nbits, "row_difference",
                        lambda level, ks: "row 0 of a 2-row call differs from its one-row call (as on AVX2 alone)")


#: the int8 kernel as this CPU has it, and as a CPU where it is not row-exact has it (AVX2 without AVX-512)
INT8_KERNELS = ["this-cpu", "not-row-exact"]


@pytest.mark.parametrize("level,int8_kernel", [(1, "this-cpu"), (4, "this-cpu"), (4, "not-row-exact")],
                         ids=["1", "4", "4-not-row-exact"])
def test_a_verify_pass_reproduces_one_position_passes_bit_for_bit(tiny_gguf, tmp_path, monkeypatch, level,
                                                                  int8_kernel):
    """At float32 activations (level 1) MatMulNBits' multi-row kernel differs from its one-row kernel in the last
    bits, so those graphs go row by row; at int8 activations (level 4) the kernel computes each row alone where the CPU
    has AVX-512, so those graphs multiply all rows at once (no Scan) — where it does not (AVX2 alone: measured at
    export, gguf_nbits.row_difference; here also pretended), they go row by row too. Both prefill the prompt in a
    graph of their own, at float32 activations. Either way a pass over n positions gives exactly the logits of n
    one-position passes."""
    from kangaroo_backends import gguf_nbits
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_apps.testing import TinyTokenizer, check_rows_exact

    model, path = tiny_gguf
    if int8_kernel == "not-row-exact":
        not_row_exact(monkeypatch)
    manifest = export_onnx(model, tmp_path / "b", exit_layer=1, weights="gguf", gguf_path=path, accuracy_level=level,
                           quiet=True)
    at_once = level == 4 and gguf_nbits.row_difference(4, gguf_nbits.linear_ks(model.config)) is None
    assert manifest["weights"]["rows"] == (ROWS_AT_ONCE if at_once else ROWS)
    assert all(("prefill_file" in graph) is (name != "head") for name, graph in manifest["graphs"].items())
    assert {manifest["graphs"][name]["prefill_accuracy_level"] for name in ("shallow", "deep")} == {1}
    scans = [node for node in onnx.load(str(tmp_path / "b" / "deep.onnx")).graph.node if node.op_type == "Scan"]
    assert bool(scans) is not at_once
    levels = {a.i for node in onnx.load(str(tmp_path / "b" / "deep.prefill.onnx")).graph.node
              if node.op_type == "MatMulNBits" for a in node.attribute if a.name == "accuracy_level"}
    assert levels == {1}
    backend = OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", bundle=tmp_path / "b", provider="cpu", threads=2)
    assert backend.inexact_multi_position is None
    check_rows_exact(backend, [7, 1, 30], [5, 17, 3, 88, 41, 9, 60, 2], splits=[(1, 7)])  # one row, then a 7-row pass
    check_rows_exact(backend, [7, 1, 30], [5, 17, 3, 88, 41, 9, 60, 2], splits=[(8,)])  # the prefill's pass too
    # the attention op runs where a cache is read: the main graphs, and a prefill graph that also takes the one-row
    # passes (level 1); an int8 export's prefill graphs run only the prompt, nothing cached, so they keep their own
    from kangaroo_backends import ort_attention

    swapped = {p.name for p in backend.swapped}
    if ort_attention.library()[0] is not None:  # a C compiler builds the op (KANGAROO_NATIVE unset)
        assert swapped == {"shallow.onnx", "deep.onnx"} | (set() if level == 4 else {"shallow.prefill.onnx",
                                                                                    "deep.prefill.onnx"})


def test_the_row_probe_says_what_the_int8_kernel_does_on_this_cpu(tiny_gguf):
    """gguf_nbits.row_difference (run at export, and for an all-rows-at-once bundle at load) agrees with a wider
    measurement on the tiny GGUF's own blocks (Q4_1 with its zero points and Q8_0: every one of 16 rows, calls of
    2..16 rows, 1 and 2 threads), and finds the difference that float32 activations (level 1) always have."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from kangaroo_backends import gguf_nbits
    from kangaroo_backends.native import cpu_identity

    model, path = tiny_gguf
    assert gguf_nbits.row_difference(1, gguf_nbits.linear_ks(model.config))  # the negative control
    probed = gguf_nbits.row_difference(4, gguf_nbits.linear_ks(model.config))
    weights = read_linear_weights(path, model.config)
    x = np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32)
    exact = True
    for name in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):  # 4-bit with zero points, 8-bit
        weight = weights[name]
        inits = [numpy_helper.from_array(weight.codes, "B"), numpy_helper.from_array(weight.scales, "S")]
        if weight.zero_points is not None:
            inits.append(numpy_helper.from_array(weight.zero_points, "Z"))
        node = helper.make_node("MatMulNBits", ["A", "B", "S"] + ["Z"] * (weight.zero_points is not None), ["Y"],
                                domain="com.microsoft", K=weight.k, N=weight.n, bits=weight.bits, block_size=32,
                                accuracy_level=4)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", 64])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", weight.n])], inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        for threads in (1, 2):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
            alone = np.concatenate([session.run(None, {"A": x[i:i + 1]})[0] for i in range(16)])
            for rows in range(2, 17):
                together = session.run(None, {"A": x[:rows]})[0]
                exact &= np.array_equal(together.view(np.uint32), alone[:rows].view(np.uint32))
    assert (probed is None) == exact, f"probe: {probed!r}, measured row-exact: {exact}; CPU: {cpu_identity()}"


@pytest.mark.parametrize("int8_kernel", INT8_KERNELS)
def test_int8_activations_draft_losslessly_and_an_older_4_bit_bundle_is_refused(tiny_gguf, tmp_path, monkeypatch,
                                                                               int8_kernel):
    """At accuracy level 4 Kangaroo is token-identical to that backend's own target alone (the int8 kernel computes
    each row alone, or — where it does not, AVX2 alone — the export goes row by row); a 4-bit bundle whose manifest does
    not say so (exported before) runs the target alone and refuses drafters in one line."""
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_core.config import ConfigError, DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_apps.testing import TinyTokenizer
    from kangaroo_plugins.greedy_verifier import GreedyVerifier
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
    from kangaroo_policies.threshold import ThresholdPolicy

    model, path = tiny_gguf
    if int8_kernel == "not-row-exact":
        not_row_exact(monkeypatch)
    export_onnx(model, tmp_path / "a4", exit_layer=1, weights="gguf", gguf_path=path, accuracy_level=4, quiet=True)
    backend = OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", bundle=tmp_path / "a4", provider="cpu")
    assert backend.accuracy_level == 4 and backend.inexact_multi_position is None  # read before any session opens
    kangaroo_equals_target_alone(backend, [[(11 * seed + 5 * i) % 96 for i in range(6)] for seed in range(3)])

    # the prompt's pass runs the float32-activation prefill graphs (transformers' final states within the export's
    # 1e-4 tolerance); every later pass, one row or several, the int8 graphs (off by far more: lossy by choice)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    with torch.no_grad():
        reference = model.model(torch.tensor([prompt])).last_hidden_state[0]
    backend.reset()
    prefill = backend.deep(backend.shallow(prompt[:6], 0), 0).hidden
    after = torch.cat([backend.deep(backend.shallow(prompt[6:7], 6), 6).hidden,
                       backend.deep(backend.shallow(prompt[7:], 7), 7).hidden])
    scale = reference.abs().max()
    assert (prefill - reference[:6]).abs().max() / scale < 1e-4
    assert (after - reference[6:]).abs().max() / scale > 1e-3
    config = DecodeConfig(exit_layer=1, max_new_tokens=30)

    manifest_path = tmp_path / "a4" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["weights"]["rows"]  # what a bundle of graph revision 1 or 2 says
    manifest_path.write_text(json.dumps(manifest))
    old = OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", bundle=tmp_path / "a4", provider="cpu")
    assert Engine(old, None, ThresholdPolicy(), GreedyVerifier(), config).generate_ids([1, 2, 3]).token_ids
    with pytest.raises(ConfigError, match="^drafting on this backend would not be lossless: this 4-bit ONNX export "
                                          "multiplies several rows at once"):
        Engine(old, KangarooDrafter(), ThresholdPolicy(), GreedyVerifier(), config)


def test_an_all_rows_at_once_bundle_does_not_draft_where_the_int8_kernel_is_not_row_exact(tiny_gguf, tmp_path,
                                                                                          monkeypatch):
    """A level-4 bundle exported where MatMulNBits' int8 kernel is row-exact (AVX-512: all rows at once) and run
    where it is not (AVX2 alone) would verify inexactly: it runs the target alone and refuses drafters in one line
    naming the difference found here. The export cache keeps such CPUs' row-by-row exports apart (``-rows``)."""
    from kangaroo_backends import gguf_nbits
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_core.config import ConfigError, DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_apps.testing import TinyTokenizer
    from kangaroo_plugins.greedy_verifier import GreedyVerifier
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
    from kangaroo_policies.threshold import ThresholdPolicy

    model, path = tiny_gguf
    monkeypatch.setattr(gguf_nbits, "row_difference", lambda level, ks: None)  # exported as on AVX-512
    manifest = export_onnx(model, tmp_path / "a4", exit_layer=1, weights="gguf", gguf_path=path, accuracy_level=4,
                           quiet=True)
    assert manifest["weights"]["rows"] == ROWS_AT_ONCE
    cached = OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", provider="cpu", weights="gguf", accuracy_level=4,
                         gguf_path=path, kernel="matmulnbits").export_dir()
    not_row_exact(monkeypatch)  # run as on AVX2 alone
    backend = OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", bundle=tmp_path / "a4", provider="cpu")
    assert backend.inexact_multi_position.startswith(
        "this 4-bit ONNX export multiplies all rows of a pass in one int8 MatMulNBits call, which is not row-exact on "
        "this CPU (row 0 of a 2-row call differs")
    config = DecodeConfig(exit_layer=1, max_new_tokens=20)
    assert Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config).generate_ids([1, 2, 3]).token_ids
    with pytest.raises(ConfigError, match="^drafting on this backend would not be lossless: this 4-bit ONNX export "
                                          "multiplies all rows .* use --onnx-kernel blocks to draft$"):
        Engine(backend, KangarooDrafter(), ThresholdPolicy(), GreedyVerifier(), config)
    rows = OnnxBackend(model, TinyTokenizer(96, None), 1, "tiny", provider="cpu", weights="gguf", accuracy_level=4,
                       gguf_path=path, kernel="matmulnbits").export_dir()
    assert rows.name == f"{cached.name}-rows"


def test_llama_cpp_method_says_how_to_install_it(monkeypatch):
    import builtins

    from kangaroo_core.errors import MissingDependencyError
    from kangaroo_plugins.llama_cpp_bench import LlamaCpp

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(MissingDependencyError, match=r"pip install llama-cpp-python \(kangaroo's \[llama-cpp\] extra\)"):
        LlamaCpp().prepare(None)
