"""ONNX export and the onnx backend on tiny random float32 Llamas (fast; CPUExecutionProvider).

Skipped when onnxruntime is not importable, except the missing-dependency test, which fakes its absence.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
import torch

from kangaroo_backends.onnx_bundle import EXPORT_KEY, FORMAT_VERSION
from kangaroo_apps.cli import main
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.engine import Engine, TextStream
from kangaroo_core.errors import (AdapterMismatchError, MissingDependencyError, OnnxExportError, OnnxModelError,
                                  ProviderError)
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.threshold import ThresholdPolicy
from kangaroo_apps.testing import TinyTokenizer, check_rows_exact, hf_greedy, tiny_backend, tiny_llama

HAS_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
needs_ort = pytest.mark.skipif(not HAS_ORT, reason="onnxruntime/onnx not installed (pip install '.[onnx]')")

MODELS = {}


def model(seed: int):
    if seed not in MODELS:
        MODELS[seed] = tiny_llama(seed, dtype=torch.float32, layers=3, eos_token_id=None if seed % 2 else 5)
    return MODELS[seed]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, one_torch_thread):
    """(seed, exit layer) -> an exported directory, exported once per module."""
    from kangaroo_backends.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("onnx-bundles")
    made = {}

    def get(seed: int, exit_layer: int):
        if (seed, exit_layer) not in made:
            made[seed, exit_layer] = root / f"m{seed}-l{exit_layer}"
            export_onnx(model(seed), made[seed, exit_layer], exit_layer=exit_layer, quiet=True)
        return made[seed, exit_layer]

    return get


def onnx_backend(seed: int, exit_layer: int, bundle, **options):
    from kangaroo_backends.onnx_backend import OnnxBackend

    m = model(seed)
    return OnnxBackend(m, TinyTokenizer(m.config.vocab_size, m.generation_config.eos_token_id), exit_layer,
                       bundle=bundle, threads=1, quiet=True, **options)


def kangaroo_engine(backend, exit_layer, eta, gamma, drafter=None):
    config = DecodeConfig(exit_layer=exit_layer, eta=eta, gamma=gamma, max_new_tokens=24)
    return Engine(backend, drafter or KangarooDrafter(), ThresholdPolicy(eta=eta), GreedyVerifier(), config)


def attention_op():
    """The in-place attention op's library, or skip the test (no C compiler)."""
    from kangaroo_backends import ort_attention

    library, why = ort_attention.library()
    if library is None:
        pytest.skip(why)
    return library


@needs_ort
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("attention", ["in_place", "exported"])
def test_a_float32_verify_pass_reproduces_one_position_passes_bit_for_bit(bundles, threads, attention):
    """The float32 export's rows do not depend on the rows that come with them (onnxruntime's float32 MatMul and the
    graph's attention compute each row alike for every n; so does kangaroo's in-place attention op, its work items
    on onnxruntime's threads): Kangaroo on it equals its target alone by construction."""
    from kangaroo_backends.onnx_backend import OnnxBackend

    if attention == "in_place":
        attention_op()
    m = model(2)
    backend = OnnxBackend(m, TinyTokenizer(m.config.vocab_size, None), 1, bundle=bundles(2, 1), threads=threads,
                          quiet=True, attention=attention)
    check_rows_exact(backend, [7, 1, 30, 12, 9], [5, 17, 3, 50, 41, 9, 60, 2, 33], splits=[(1, 8), (4, 5), (9,)])


# -- export ---------------------------------------------------------------------------------------------------------
@needs_ort
def test_export_writes_a_validated_manifest(bundles):
    from kangaroo_backends.torch_backend import model_fingerprint

    directory = bundles(1, 1)
    manifest = json.loads((directory / "manifest.json").read_text())
    graphs = sorted(p.name for p in directory.iterdir() if p.suffix in (".onnx", ".json"))
    assert graphs == ["deep.onnx", "head.onnx", "manifest.json", "shallow.onnx"]  # the drafter's graph is not ours
    assert manifest["base_model_fingerprint"] == model_fingerprint(model(1))
    assert (manifest["exit_layer"], manifest["num_layers"], manifest["opset"], manifest["format_version"]) == (1, 3, 17, 3)
    assert {"torch", "onnx", "onnxruntime", "kangaroo-decoding"} <= set(manifest["versions"])
    shallow = manifest["graphs"]["shallow"]
    assert list(shallow["inputs"]) == ["input_ids", "position_ids", "attention_bias", "past_key.0", "past_value.0"]
    assert shallow["inputs"]["attention_bias"] == [1, 1, "n", "total"]
    assert shallow["inputs"]["past_key.0"] == [1, "past", 2, 8]
    assert list(manifest["graphs"]["deep"]["outputs"]) == ["final_hidden", "new_key.0", "new_value.0", "new_key.1", "new_value.1"]
    assert manifest["graphs"]["head"]["inputs"] == {"final_hidden": [1, "n", 32]}
    assert manifest["graphs"]["head"]["outputs"] == {"logits": [1, "n", 64]}
    for name, graph in manifest["graphs"].items():  # graph-by-graph validation against eager PyTorch
        check = graph["validation"]
        assert 0 <= check["max_abs_diff"] < 1e-4, (name, check)
        assert check["max_abs_diff"] <= check["tolerance"]


@needs_ort
def test_the_graphs_are_lean_no_shape_arithmetic_and_no_repeated_keys(bundles):
    """The lean graphs of revision 2 on (measured: onnxruntime pays microseconds per node): no node asks for a shape, the
    keys/values are never expanded per query head, RoPE's rotate-half is one MatMul, every bias is tiled once per
    graph, and the manifest records the revision the export cache is keyed by. Revision 6: each layer's attention over
    the cache is marked (its nodes' scope and its shapes in the graph's metadata) for the in-place op."""
    import onnx

    from kangaroo_backends.onnx_bundle import GRAPH_REVISION

    directory = bundles(1, 1)
    assert json.loads((directory / "manifest.json").read_text())["graph_revision"] == GRAPH_REVISION == 6
    assert EXPORT_KEY == f"v{FORMAT_VERSION}.{GRAPH_REVISION}"
    for name, layers in (("shallow", 1), ("deep", 2)):  # 4 query heads share 2 KV heads
        proto = onnx.load(directory / f"{name}.onnx")
        ops = [node.op_type for node in proto.graph.node]
        assert not {"Shape", "Neg", "Where"} & set(ops), (name, sorted(set(ops)))
        assert ops.count("Gather") == (name == "shallow")  # the embedding lookup only
        assert (ops.count("Softmax"), ops.count("Tile"), ops.count("Expand")) == (layers, 1, 1), (name, ops)  # the bias
        assert json.loads({p.key: p.value for p in proto.metadata_props}["kangaroo.attention_core"]) == {
            "heads": 4, "kv_heads": 2, "head_dim": 8, "scale": 8 ** -0.5,
            "scopes": [f"/attns.{i}/core" for i in range(layers)]}


def test_rotate_half_as_a_matrix_is_exact():
    from kangaroo_backends.onnx_toolkit import rope, rotate_half_matrix

    torch.manual_seed(0)
    for head_dim in (8, 64, 256):
        x, cos, sin = torch.randn(2, 5, 3, head_dim), torch.randn(5, 1, head_dim), torch.randn(5, 1, head_dim)
        rotated = x @ rotate_half_matrix(head_dim)
        assert torch.equal(rotated, torch.cat((-x[..., head_dim // 2:], x[..., : head_dim // 2]), dim=-1))
        assert torch.equal(x * cos + rotated * sin, rope(x, cos, sin))


@needs_ort
def test_exported_adapter_alone_gives_the_drafter_logits(tmp_path):
    """adapter.onnx is usable without the rest: layer-l states + its own KV → the drafter's next-token logits."""
    import onnxruntime as ort

    from kangaroo_plugins.kangaroo.onnx_graph import export_adapter_graph, read_adapter_manifest

    m, exit_layer = model(1), 1
    adapter = KangarooAdapter.from_base_layer(m, exit_layer)
    export_adapter_graph(adapter, m.lm_head, tmp_path / "g", fingerprint="f", exit_layer=exit_layer, key="untrained",
                         quiet=True)
    manifest = read_adapter_manifest(tmp_path / "g", fingerprint="f", exit_layer=exit_layer, key="untrained")
    assert manifest["validation"]["max_abs_diff"] <= manifest["validation"]["tolerance"]
    with pytest.raises(OnnxModelError, match="adapter 'untrained', expected 'other'"):
        read_adapter_manifest(tmp_path / "g", fingerprint="f", exit_layer=exit_layer, key="other")
    session = ort.InferenceSession(str(tmp_path / "g" / "adapter.onnx"), providers=["CPUExecutionProvider"])
    hidden = torch.randn(6, m.config.hidden_size)
    with torch.inference_mode():
        expected = m.lm_head(adapter(hidden[None], 0)[0, -1])
    from kangaroo_backends.onnx_toolkit import attention_bias

    past = torch.zeros(1, 0, 2, 8).numpy()
    step1 = session.run(None, {"hidden": hidden[None, :4].numpy(), "position_ids": torch.arange(4)[None].numpy(),
                               "attention_bias": attention_bias(4, 0).numpy(), "past_key.0": past,
                               "past_value.0": past, "logit_rows": torch.tensor([3]).numpy()})
    keys, values = step1[1], step1[2]
    step2 = session.run(None, {"hidden": hidden[None, 4:].numpy(), "position_ids": torch.arange(4, 6)[None].numpy(),
                               "attention_bias": attention_bias(2, 4).numpy(), "past_key.0": keys,
                               "past_value.0": values, "logit_rows": torch.tensor([1]).numpy()})
    assert step2[0].shape == (1, 1, m.config.vocab_size) and step2[2].shape == (1, 2, 2, 8)
    assert torch.allclose(torch.from_numpy(step2[0][0, 0]), expected, atol=1e-4)


@needs_ort
def test_export_refused_beyond_tolerance_leaves_nothing(tmp_path, one_torch_thread):
    from kangaroo_backends.onnx_export import export_onnx

    with pytest.raises(OnnxExportError, match="differs from eager PyTorch"):
        export_onnx(model(1), tmp_path / "out", exit_layer=1, tolerance=0.0, quiet=True)
    assert list(tmp_path.iterdir()) == []


# -- the in-place attention op ----------------------------------------------------------------------------------------
def _deep_feed(rng, past: int, n: int, layers: int, tree=None):
    import numpy as np

    from kangaroo_backends.onnx_toolkit import attention_bias

    feed = {"hidden": rng.standard_normal((1, n, 32)).astype(np.float32),
            "position_ids": np.arange(past, past + n)[None] if tree is None else tree.position_ids()[None].numpy(),
            "attention_bias": attention_bias(n, past, tree=tree).numpy()}
    for i in range(layers):
        for kind in ("key", "value"):
            feed[f"past_{kind}.{i}"] = rng.standard_normal((1, past, 2, 8)).astype(np.float32)
    return feed


@needs_ort
def test_the_attention_op_computes_the_exported_attention(bundles):
    """The swapped graph (each layer's attention nodes → one ``kangaroo.CachedAttention``) gives the exported graph's
    outputs within float rounding (its sums run in another order), on chains and a token tree, with or without a
    cache; the file on disk is untouched; a call whose inputs disagree is one clear error."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from kangaroo_backends import ort_attention
    from kangaroo_backends.onnx_toolkit import validation_tree

    library = attention_op()
    path = bundles(2, 1) / "deep.onnx"
    before = path.read_bytes()
    proto = onnx.load(path)
    assert ort_attention.swap_attention(proto) == 2
    ops = [node.op_type for node in proto.graph.node]
    assert ops.count("CachedAttention") == 2 and not {"Softmax", "Tile", "Expand"} & set(ops), ops
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    swapped = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    exported = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert path.read_bytes() == before
    rng = np.random.default_rng(0)
    for past, n, tree in ((0, 4, None), (6, 1, None), (6, 5, None), (5, 3, validation_tree())):
        feed = _deep_feed(rng, past, n, 2, tree)
        for got, want in zip(swapped.run(None, feed), exported.run(None, feed)):
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), (past, n)
    feed = _deep_feed(rng, 6, 2, 2)
    feed["past_value.1"] = feed["past_value.1"][:, :5]
    with pytest.raises(Exception, match="CachedAttention: input shapes disagree"):
        swapped.run(None, feed)


@needs_ort
@pytest.mark.parametrize("name, layers", [("shallow", 1), ("deep", 2)])
def test_the_rotary_op_gives_the_exported_graph_bits(bundles, name, layers):
    """Each layer's rotary embedding of the queries and of the keys (Reshape, Unsqueeze, Mul, MatMul by the ±1
    matrix, Add) becomes one ``kangaroo.Rotary`` node, and the graph's outputs keep their bits: on chains and a token
    tree, with or without a cache, the attention swapped or not."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from kangaroo_backends import ort_attention
    from kangaroo_backends.onnx_toolkit import validation_tree
    from kangaroo_backends.ort_rotary import fuse_rotary

    library = attention_op()
    path = bundles(2, 1) / f"{name}.onnx"
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    for swap in (False, True):
        plain, fused = onnx.load(path), onnx.load(path)
        if swap:
            assert ort_attention.swap_attention(plain) == ort_attention.swap_attention(fused) == layers
        before = [node.op_type for node in fused.graph.node]
        assert fuse_rotary(fused) == 2 * layers
        after = [node.op_type for node in fused.graph.node]
        assert after.count("Rotary") == 2 * layers
        for op, gone in (("MatMul", 2), ("Mul", 4), ("Add", 2), ("Reshape", 2)):  # per layer; Reshape: the head splits
            assert before.count(op) - after.count(op) == gone * layers, (op, before, after)
        sessions = [ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
                    for proto in (plain, fused)]
        rng = np.random.default_rng(1)
        for past, n, tree in ((0, 4, None), (6, 1, None), (6, 5, None), (5, 3, validation_tree())):
            feed = _deep_feed(rng, past, n, layers, tree)
            if name == "shallow":
                feed["input_ids"] = rng.integers(0, 64, (1, n))
                del feed["hidden"]
            want, got = (session.run(None, feed) for session in sessions)
            for a, b in zip(want, got):
                assert a.shape == b.shape and np.array_equal(a, b), (swap, past, n)


@needs_ort
def test_the_runner_reads_the_cache_in_place_and_decodes_the_same_tokens(bundles):
    """Through the backend, each layer's new keys land right after the cached ones (IO binding), so the op reads the
    whole cache where it lies, never copying it; Kangaroo gives transformers' tokens, as with the exported attention."""
    from kangaroo_backends import ort_attention

    attention_op()
    prompt = [7, 1, 30, 12, 9]
    before = ort_attention.counters()
    backend = onnx_backend(2, 1, bundles(2, 1), attention="in_place")
    got = kangaroo_engine(backend, 1, 0.3, 4).generate_ids(prompt, 24)
    after = ort_attention.counters()
    assert after["in_place"] > before["in_place"] and after["copied"] == before["copied"], (before, after)
    exported = kangaroo_engine(onnx_backend(2, 1, bundles(2, 1), attention="exported"), 1, 0.3, 4)
    assert got.token_ids == exported.generate_ids(prompt, 24).token_ids == hf_greedy(model(2), prompt, 24)


@needs_ort
def test_attention_option_falls_back_or_refuses_in_one_line(bundles, tmp_path, monkeypatch):
    """``auto`` runs an unmarked bundle (exported before revision 6) or a machine without the op as exported;
    ``in_place`` refuses either in one line; an unknown value is one line too."""
    import onnx

    from kangaroo_backends import ort_attention

    with pytest.raises(ConfigError, match=r"^attention must be one of auto, in_place, exported, got 'fast'$"):
        onnx_backend(1, 1, None, attention="fast")
    attention_op()
    old = tmp_path / "old"
    shutil.copytree(bundles(2, 1), old)
    for name in ("shallow", "deep"):
        proto = onnx.load(old / f"{name}.onnx")
        del proto.metadata_props[:]
        onnx.save(proto, old / f"{name}.onnx")
    prompt = [7, 1, 30, 12, 9]
    want = hf_greedy(model(2), prompt, 12)
    engine = Engine(onnx_backend(2, 1, old), None, ThresholdPolicy(), GreedyVerifier(), DecodeConfig(exit_layer=1))
    assert engine.generate_ids(prompt, 12).token_ids == want
    with pytest.raises(ConfigError, match=r"^attention=in_place: .*\.onnx does not mark its attention \(exported "
                                          r"before graph revision 6\); re-export it$"):
        onnx_backend(2, 1, old, attention="in_place").reset()
    monkeypatch.setenv("KANGAROO_NATIVE", "0")
    ort_attention.library.cache_clear()
    try:
        engine = Engine(onnx_backend(2, 1, bundles(2, 1)), None, ThresholdPolicy(), GreedyVerifier(),
                        DecodeConfig(exit_layer=1))
        assert engine.generate_ids(prompt, 12).token_ids == want
        with pytest.raises(ConfigError, match=r"^attention=in_place: kangaroo's attention op is not available: "
                                              r"disabled by KANGAROO_NATIVE=0$"):
            onnx_backend(2, 1, bundles(2, 1), attention="in_place").reset()
    finally:
        ort_attention.library.cache_clear()


def test_the_cli_takes_the_onnx_flags_from_the_backend():
    """The onnx flags are the backend's own (OnnxBackend.flags): the command line lists their choices as it does."""
    from kangaroo_apps.cli_options import backend_flag_params
    from kangaroo_backends.onnx_backend import ATTENTION, SPINNING, WEIGHTS

    choices = {o.opts[0]: tuple(o.type.choices) for o in backend_flag_params() if hasattr(o.type, "choices")}
    assert choices["--onnx-attention"] == ATTENTION and choices["--onnx-spinning"] == SPINNING
    assert choices["--onnx-weights"] == WEIGHTS


# -- the ORT loop ---------------------------------------------------------------------------------------------------
@needs_ort
@pytest.mark.parametrize("seed,exit_layer,eta,gamma,prompt", [
    (1, 1, 0.0, 4, [3, 5, 7, 9]),
    (1, 2, 0.3, 2, [11, 2]),
    (2, 1, 0.6, 6, [1, 2, 3, 4, 5, 6, 7]),
    (2, 2, 0.0, 1, [40]),
    (3, 1, 0.1, 3, [8, 8, 9, 30, 31]),
])
def test_onnx_loop_is_token_identical_to_eager_and_transformers(bundles, seed, exit_layer, eta, gamma, prompt):
    onnx = kangaroo_engine(onnx_backend(seed, exit_layer, bundles(seed, exit_layer)), exit_layer, eta, gamma)
    eager = kangaroo_engine(tiny_backend(model(seed), exit_layer=exit_layer), exit_layer, eta, gamma)
    got, want = onnx.generate_ids(prompt, 24), eager.generate_ids(prompt, 24)
    assert got.token_ids == want.token_ids == hf_greedy(model(seed), prompt, 24)
    # the drafter behaves the same on both backends: same drafts accepted, round by round
    assert [(r.drafted, r.accepted) for r in got.rounds] == [(r.drafted, r.accepted) for r in want.rounds]
    assert onnx.backend.cache_lengths() == eager.backend.cache_lengths()
    vanilla = Engine(onnx.backend, None, onnx.policy, onnx.verifier, onnx.config).generate_ids(prompt, 24)
    assert vanilla.token_ids == want.token_ids


@needs_ort
@pytest.mark.parametrize("variant", ["plain", "draft_vocab", "ffn"])
def test_trained_adapter_is_exported_with_the_backend_and_drafts_the_same(tmp_path, one_torch_thread, variant):
    from kangaroo_backends.torch_backend import model_fingerprint

    m, exit_layer = model(1), 1
    adapter = KangarooAdapter.from_base_layer(m, exit_layer, ffn=variant == "ffn")
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if variant == "draft_vocab":  # half the vocabulary: -inf logits must survive the export exactly
        adapter.set_draft_vocab(range(0, m.config.vocab_size, 2))
    adapter.save(tmp_path / "adapter", base_fingerprint=model_fingerprint(m), exit_layer=exit_layer)
    path = str(tmp_path / "adapter")
    backend = onnx_backend(1, exit_layer, None)
    from kangaroo_backends import loading

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "cache_dir", lambda: tmp_path / "cache")
        import kangaroo_backends.onnx_backend as ob

        mp.setattr(ob, "cache_dir", lambda: tmp_path / "cache")
        onnx = kangaroo_engine(backend, exit_layer, 0.0, 4, KangarooDrafter(adapter=path))
        eager = kangaroo_engine(tiny_backend(m, exit_layer=exit_layer), exit_layer, 0.0, 4, KangarooDrafter(adapter=path))
        import kangaroo_plugins.kangaroo.runners as runners

        calls = []
        real_key = runners.adapter_key
        mp.setattr(runners, "adapter_key", lambda path: calls.append(path) or real_key(path))
        again = kangaroo_engine(backend, exit_layer, 0.0, 4, KangarooDrafter(adapter=path))  # binds: hashes once
        again.generate_ids([3, 4, 5], 24)
        got, want = onnx.generate_ids([3, 4, 5], 24), eager.generate_ids([3, 4, 5], 24)
        assert calls == [path]  # the adapter is hashed when a drafter binds: never per generation or token
    assert got.token_ids == want.token_ids
    assert [(r.drafted, r.accepted) for r in got.rounds] == [(r.drafted, r.accepted) for r in want.rounds]
    (export,) = (tmp_path / "cache" / "onnx" / EXPORT_KEY).iterdir()
    (graph,) = (export / "drafters" / "kangaroo").iterdir()  # the drafter's graph lives inside the backend's export
    assert graph.name == f"l1-{real_key(path)}" and (graph / "adapter.onnx").is_file()
    with pytest.raises(AdapterMismatchError):
        KangarooDrafter(adapter=path).bind(onnx_backend(1, 2, None))


# -- bad inputs -----------------------------------------------------------------------------------------------------
@needs_ort
def test_manifest_of_another_model_exit_layer_or_adapter_is_refused(bundles):
    with pytest.raises(OnnxModelError, match="made for base model"):
        onnx_backend(2, 1, bundles(1, 1)).reset()
    with pytest.raises(OnnxModelError, match="split at exit layer 1, but exit layer 2"):
        onnx_backend(1, 2, bundles(1, 1)).reset()


@needs_ort
def test_missing_corrupt_and_wrong_opset_files_are_one_clear_error(bundles, tmp_path):
    import onnx

    broken = tmp_path / "broken"
    shutil.copytree(bundles(1, 1), broken)
    (broken / "deep.onnx").write_bytes(b"this is not an onnx file")
    with pytest.raises(OnnxModelError, match=r"cannot load .*deep.onnx \(corrupt"):
        onnx_backend(1, 1, broken).reset()
    (broken / "deep.onnx").unlink()
    with pytest.raises(OnnxModelError, match=r"deep.onnx is missing"):
        onnx_backend(1, 1, broken).reset()
    shutil.copy(bundles(1, 1) / "deep.onnx", broken / "deep.onnx")
    graph = onnx.load(str(broken / "head.onnx"))
    for entry in graph.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = 99
    onnx.save(graph, str(broken / "head.onnx"))
    with pytest.raises(OnnxModelError, match="uses ONNX opset 99, which onnxruntime .* cannot run"):
        onnx_backend(1, 1, broken).reset()
    shutil.copy(bundles(1, 1) / "head.onnx", broken / "head.onnx")
    manifest = json.loads((broken / "manifest.json").read_text())
    for damage, message in [(lambda m: m.pop("graphs"), "'graphs' is missing"),
                            (lambda m: m.update(exit_layer="1"), "'exit_layer' is missing or not a int"),
                            (lambda m: m["graphs"]["deep"].update(file="../../etc/passwd"), "outside"),
                            (lambda m: m["graphs"].pop("head"), "lists no head graph")]:
        bad = json.loads(json.dumps(manifest))
        damage(bad)
        (broken / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(OnnxModelError, match=message):
            onnx_backend(1, 1, broken).reset()
    (broken / "manifest.json").write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(OnnxModelError, match="not valid UTF-8 JSON"):
        onnx_backend(1, 1, broken).reset()
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(OnnxModelError, match="not valid UTF-8 JSON"):
        onnx_backend(1, 1, broken).reset()
    with pytest.raises(OnnxModelError, match="not a kangaroo ONNX export"):
        onnx_backend(1, 1, tmp_path / "nowhere").reset()


@needs_ort
@pytest.mark.parametrize("spinning, spins", [("none", set()), ("deep", {"deep"}), ("all", {"shallow", "deep", "head"})])
def test_spinning_sets_which_sessions_busy_wait_and_changes_no_token(bundles, spinning, spins):
    """``spinning``: the chosen sessions' threads busy-wait between ops and stop when their run ends; the others
    sleep. Scheduling only: Kangaroo and the target alone give the same tokens as with every thread sleeping."""
    backend = onnx_backend(2, 1, bundles(2, 1), spinning=spinning)
    backend.threads = 2
    engine = kangaroo_engine(backend, 1, 0.3, 4)
    prompt = [7, 1, 30, 12, 9]
    got = engine.generate_ids(prompt, 24)
    runners = {"shallow": backend.shallow_runner, "deep": backend.deep_runner, "head": backend.head_runner}
    for name, runner in runners.items():
        options = runner.session.get_session_options()
        want = "1" if name in spins else "0"
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == want, name
        if name in spins:
            assert options.get_session_config_entry("session.force_spinning_stop") == "1", name
    plain = kangaroo_engine(onnx_backend(2, 1, bundles(2, 1), spinning="none"), 1, 0.3, 4).generate_ids(prompt, 24)
    assert got.token_ids == plain.token_ids == hf_greedy(model(2), prompt, 24)


@needs_ort
def test_the_loop_holds_torch_to_one_thread_beside_onnxruntime_and_gives_it_back(bundles, monkeypatch):
    """A CPU onnx backend's ``host_threads``: torch's own work in the loop (here the verifier's) runs on one thread,
    alone and in a batch, and the caller's setting is back after each token, each batch step and at the end."""
    from kangaroo_core.machine import host_threads

    backend = onnx_backend(2, 1, bundles(2, 1))
    assert backend.host_threads == 1 and backend.spinning == "all"
    seen = []
    verify = GreedyVerifier.verify
    monkeypatch.setattr(GreedyVerifier, "verify", lambda self, *a: seen.append(torch.get_num_threads()) or verify(self, *a))
    engine = kangaroo_engine(backend, 1, 0.3, 4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in TextStream(engine, [7, 1, 30, 12, 9], 12):
            assert torch.get_num_threads() == 2  # the consumer's own work between tokens keeps its threads
        assert seen and set(seen) == {1}
        seen.clear()
        batch = engine.batch(max_batch=2)
        streams = [batch.submit(p, chat=False, max_new_tokens=10) for p in ([7, 1, 30], [4, 4, 2, 9])]
        while batch.step():
            assert torch.get_num_threads() == 2
        assert all(s.wait().token_ids for s in streams) and seen and set(seen) == {1}
        with host_threads(backend):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@needs_ort
def test_unknown_spinning_is_one_line_error():
    from kangaroo_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"^spinning must be one of none, deep, all, got 'always'$"):
        onnx_backend(1, 1, None, spinning="always")


def test_onnx_options_are_validated_once_when_made_in_one_line():
    """Every onnx backend option is checked where :class:`OnnxOptions` is made (create, the constructor's keywords):
    a bad value is one ConfigError line naming it; ``create`` takes exactly its named options."""
    import inspect

    import attrs

    from kangaroo_backends.onnx_backend import OnnxBackend, OnnxOptions

    for bad, message in [({"weights": "int3"}, "weights must be one of float32, gguf, got 'int3'"),
                         ({"spinning": "sometimes"}, "spinning must be one of none, deep, all, got 'sometimes'"),
                         ({"attention": "fast"}, "attention must be one of auto, in_place, exported, got 'fast'"),
                         ({"provider": "tpu"}, "provider must be one of auto, cpu, cuda, got 'tpu'"),
                         ({"accuracy_level": 4}, "accuracy_level applies to weights=gguf only"),
                         ({"weights": "gguf", "accuracy_level": 7}, "accuracy_level must be an integer 0..4, got 7"),
                         ({"threads": 0}, "threads must be an integer >= 1 (or None: onnxruntime's choice), got 0")]:
        with pytest.raises(ConfigError) as info:
            OnnxOptions(**bad)
        assert str(info.value) == message
        with pytest.raises(ConfigError) as info:  # before any model is loaded
            OnnxBackend.create(DecodeConfig(exit_layer=1), model="/does/not/exist", **bad)
        assert str(info.value) == message
    options = OnnxOptions(bundle="~/x", threads=2.0, weights="gguf", accuracy_level="4")
    assert (options.bundle.is_absolute(), options.threads, options.accuracy_level, options.level) == (True, 2, 4, 4)
    assert (OnnxOptions().level, OnnxOptions(weights="gguf").level) == (0, 1)
    parameters = inspect.signature(OnnxBackend.create).parameters.values()
    assert not any(p.kind is p.VAR_KEYWORD for p in parameters)  # an unknown option is refused by its signature
    assert [p.name for p in parameters][2:] == ["device", "dtype", *attrs.fields_dict(OnnxOptions)]


@needs_ort
def test_resplit_keeps_the_options(bundles):
    from kangaroo_backends.onnx_backend import OnnxOptions

    backend = onnx_backend(1, 1, None, spinning="deep", attention="exported")
    again = backend.resplit(2)
    assert again.exit_layer == 2 and again.options == backend.options
    assert (again.spinning, again.attention, again.threads, again.quiet) == ("deep", "exported", 1, True)
    bundled = onnx_backend(1, 1, bundles(1, 1), spinning="all")
    assert bundled.resplit(1).options == bundled.options == OnnxOptions(bundle=bundles(1, 1), threads=1,
                                                                       spinning="all")
    with pytest.raises(ConfigError, match="cannot be re-split at 2"):
        bundled.resplit(2)


@needs_ort
def test_public_binding_wrappers_give_the_same_passes(bundles):
    """The runner binds through onnxruntime's binding object directly; its public wrappers (the fallback) compute
    the same bits."""
    prompt = [7, 1, 30, 12, 9, 44]
    results = []
    for raw in (True, False):
        backend = onnx_backend(2, 1, bundles(2, 1))
        backend.reset()
        for runner in (backend.shallow_runner, backend.deep_runner, backend.head_runner):
            assert runner.binder.raw  # onnxruntime 1.32 has the binding object underneath
            runner.binder.raw = raw
        hidden = backend.shallow(prompt[:4], 0)
        first = backend.deep(hidden, 0)
        second = backend.deep(backend.shallow(prompt[4:], 4), 4)
        results.append((hidden, first.logits, second.logits, second.hidden))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_ort
def test_unavailable_provider_is_an_error():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA provider available here")
    with pytest.raises(ProviderError, match="CUDAExecutionProvider is not available.*onnx-gpu"):
        onnx_backend(1, 1, None, provider="cuda")


@needs_ort
def test_failed_first_use_export_leaves_no_cache(tmp_path, monkeypatch, one_torch_thread):
    import kangaroo_backends.onnx_backend as ob
    import kangaroo_backends.onnx_export as oe

    monkeypatch.setattr(ob, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(oe, "validate_outputs", lambda *a, **k: {"max_abs_diff": 1.0, "max_abs_reference": 1.0})
    with pytest.raises(OnnxExportError, match="export refused"):
        onnx_backend(1, 1, None).reset()
    assert list((tmp_path / "onnx" / EXPORT_KEY).iterdir()) == []


def test_missing_onnxruntime_gives_the_install_hint(monkeypatch, tiny_model_dir, capsys):
    from kangaroo_backends.onnx_backend import OnnxBackend

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime → ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install onnxruntime onnx \(kangaroo's \[onnx\] extra\)"):
        OnnxBackend.create(DecodeConfig(exit_layer=1), model=str(tiny_model_dir))
    assert main(["generate", "hi", "--model", str(tiny_model_dir), "--backend", "onnx"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install onnxruntime onnx" in err
    assert main(["export-onnx", "--out", "x", "--model", str(tiny_model_dir)]) == 1


# -- CLI ------------------------------------------------------------------------------------------------------------
@needs_ort
def test_cli_generate_backend_onnx_exports_once_and_matches_torch(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                  one_torch_thread):
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))
    args = ["generate", "tell me a story", "--model", str(tiny_model_dir), "--exit-layer", "1", "--max-new-tokens",
            "10", "--eta", "0", "--gamma", "3", "--json"]
    assert main(args + ["--backend", "onnx"]) == 0
    out, err = capsys.readouterr()
    assert "exporting once" in err
    first = json.loads(out)
    assert main(args + ["--backend", "onnx", "--provider", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "exporting" not in err and json.loads(out)["token_ids"] == first["token_ids"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    (export,) = (tmp_path / "onnx" / EXPORT_KEY).iterdir()
    assert export.name.endswith("-l1")
    assert [p.name for p in (export / "drafters" / "kangaroo").iterdir()] == ["l1-untrained"]


@needs_ort
def test_cli_export_onnx_then_generate_from_it(tiny_model_dir, other_tiny_model_dir, tmp_path, capsys, one_torch_thread):
    out_dir = tmp_path / "export"
    assert main(["export-onnx", "--out", str(out_dir), "--model", str(tiny_model_dir), "--exit-layer", "2"]) == 0
    _, err = capsys.readouterr()
    assert "[deep] deep.onnx: max |onnx - eager|" in err
    assert main(["export-onnx", "--out", str(out_dir), "--model", str(tiny_model_dir)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    base = ["generate", "hello world", "--max-new-tokens", "6", "--backend", "onnx", "--onnx-dir", str(out_dir), "--json"]
    assert main(base + ["--model", str(tiny_model_dir)]) == 0
    from_bundle = json.loads(capsys.readouterr().out)["token_ids"]
    assert (out_dir / "drafters" / "kangaroo" / "l2-untrained" / "adapter.onnx").is_file()  # exported with the split
    assert main(["generate", "hello world", "--max-new-tokens", "6", "--exit-layer", "2", "--json", "--vanilla",
                 "--model", str(tiny_model_dir)]) == 0
    assert from_bundle == json.loads(capsys.readouterr().out)["token_ids"]  # the same tokens as torch alone
    assert main(base + ["--model", str(other_tiny_model_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kangaroo: error: ONNX export") and "made for base model" in err and err.count("\n") == 1


def test_every_c_source_ships_with_the_package():
    """The kernels and the onnxruntime op are compiled on the user's machine from the package's own C files."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert set(listed["kangaroo_backends"]) == {p.name for p in (root / "backends").glob("*.c")}


@needs_ort
def test_many_streams_on_onnx_decode_what_each_decodes_alone(bundles, tmp_path, one_torch_thread):
    """Continuous batching on onnxruntime (each stream its own KV buffers, passes one stream at a time): every
    stream equals its prompt decoded alone, target alone and Kangaroo (the deep-context adapter's graph too)."""
    import random

    from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
    from kangaroo_backends.torch_backend import model_fingerprint

    backend = onnx_backend(0, 1, bundles(0, 1))
    directory = tmp_path / "deep"
    DeepContextAdapter.from_base_layer(model(0), 1, ffn=True).save(directory, base_fingerprint=model_fingerprint(model(0)),
                                                                  exit_layer=1)
    engines = [Engine(backend, None, ThresholdPolicy(eta=0.0), GreedyVerifier(), DecodeConfig(exit_layer=1)),
               kangaroo_engine(backend, 1, 0.0, 4), kangaroo_engine(backend, 1, 0.0, 3, KangarooDrafter(str(directory)))]
    prompts = [[random.Random(s).randrange(1, 60) for _ in range(3 + s)] for s in range(5)]
    for engine in engines:
        alone = [engine.generate_ids(p, 16).token_ids for p in prompts]
        batch = engine.batch(3)
        assert [r.token_ids for r in batch.generate(prompts, max_new_tokens=16)] == alone
        assert max(batch.sizes) == 3  # three streams per step (their passes run one after another on onnx)
