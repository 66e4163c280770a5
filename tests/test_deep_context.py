"""The deep-context adapter: lossless on both backends, its runners agree with its training pass, its files refuse
mismatches in one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.errors import AdapterMismatchError
from kangaroo_apps.testing import TinyTokenizer, hf_greedy, random_deep_context_adapter, tiny_backend, tiny_llama
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_plugins.kangaroo.networks import load_adapter
from kangaroo_policies.threshold import ThresholdPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HAS_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None

MODELS: dict = {}


def model(seed: int, layers: int = 3, dtype=torch.float64):
    key = (seed, layers, dtype)
    if key not in MODELS:
        MODELS[key] = tiny_llama(seed, layers=layers, dtype=dtype, eos_token_id=None if seed % 2 else 5)
    return MODELS[key]


def saved(adapter, backend, tmp_path, name="a") -> str:
    adapter.save(tmp_path / name, base_fingerprint=backend.fingerprint, exit_layer=backend.exit_layer)
    return str(tmp_path / name)


def engine(backend, adapter_dir, eta, gamma, new):
    config = DecodeConfig(exit_layer=backend.exit_layer, eta=eta, gamma=gamma, max_new_tokens=new)
    return Engine(backend, KangarooDrafter(adapter_dir), ThresholdPolicy(eta=eta), GreedyVerifier(), config)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 5), exit_layer=st.integers(1, 2), eta=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
       gamma=st.integers(1, 6), prompt=st.lists(st.integers(0, 63), min_size=1, max_size=9),
       vocab=st.booleans())
def test_deep_context_drafter_is_lossless_on_torch(tmp_path_factory, seed, exit_layer, eta, gamma, prompt, vocab):
    m = model(seed)
    backend = tiny_backend(m, exit_layer=exit_layer)
    adapter = random_deep_context_adapter(m, exit_layer, seed, draft_vocab=list(range(0, 64, 2)) + [5] if vocab else None)
    directory = saved(adapter, backend, tmp_path_factory.mktemp("dc"))
    result = engine(backend, directory, eta, gamma, 20).generate_ids(prompt)
    assert result.token_ids == hf_greedy(m, prompt, 20)


def test_an_untrained_deep_context_adapter_drafts_like_the_papers_adapter(tmp_path):
    """Zero-initialised fusions: exactly the paper's adapter (so training starts from it)."""
    m = model(1)
    backend = tiny_backend(m, exit_layer=1)
    paper = saved(KangarooAdapter.from_base_layer(m, 1), backend, tmp_path, "paper")
    deep = saved(DeepContextAdapter.from_base_layer(m, 1), backend, tmp_path, "deep")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = engine(backend, paper, 0.0, 4, 24).generate_ids(prompt)
    b = engine(backend, deep, 0.0, 4, 24).generate_ids(prompt)
    assert [(r.drafted, r.accepted) for r in a.rounds] == [(r.drafted, r.accepted) for r in b.rounds]


def test_runner_keys_follow_the_deep_states_it_was_given():
    """After any mix of advance / crop / observe_deep, the runner's draft equals a recomputation from scratch with
    the same verified positions (its rewritten keys/values are those the training pass builds)."""
    from kangaroo_plugins.kangaroo.runners import DeepContextTorchRunner

    m = model(2)
    adapter = random_deep_context_adapter(m, 1, 7).eval()
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(14, 32, generator=gen, dtype=torch.float64)
    z = torch.randn(14, 32, generator=gen, dtype=torch.float64)
    runner = DeepContextTorchRunner(adapter, m.lm_head)
    runner.observe_deep(0, z[:5])  # the prompt's deep states arrive before the drafter sees the prompt
    runner.advance(h[:5], 0)
    runner.advance(h[5:6], 5)
    runner.advance(h[6:8], 6)
    runner.crop(7)  # a rejected draft
    runner.observe_deep(5, z[5:7])  # x_n and one accepted draft
    runner.advance(h[7:9], 7)  # the carried-over draft state (now verified? no: known up to 6) and the new token
    got = runner.advance(h[9:10], 9)
    with torch.inference_mode():
        outs = adapter.forward_depths(h[None, :10], z[None, :10], [10 - 1 - 7])  # query 9, deep known up to 6
        want = adapter.drafting_head(m.lm_head)(outs[0][0, 9])
    assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("first_query", [0, 6])
def test_training_pass_equals_drafting_at_every_depth_and_query(first_query):
    """Every row the training pass computes (depth j, query q >= max(first_query, j + 1)) equals the runner's draft at
    query q with the deep states of positions <= q - j - 1 verified — the key sets the pass builds (fused keys up to
    the latest verified position, plain keys of the round) are exactly what drafting reads; earlier rows are zeros."""
    from kangaroo_plugins.kangaroo.runners import DeepContextTorchRunner

    m = tiny_llama(4, layers=3, heads=4, kv_heads=2, dtype=torch.float64)
    adapter = random_deep_context_adapter(m, 1, 9, ffn=True).eval()
    gen = torch.Generator().manual_seed(5)
    t = 12
    h = torch.randn(1, t, 32, generator=gen, dtype=torch.float64)
    z = torch.randn(1, t, 32, generator=gen, dtype=torch.float64)
    head = adapter.drafting_head(m.lm_head)
    with torch.inference_mode():
        outs = adapter.forward_depths(h, z, [0, 1, 2, 3], first_query=first_query)
        for j, out in enumerate(outs):
            lo = max(first_query, j + 1)
            assert torch.equal(out[0, :lo], torch.zeros_like(out[0, :lo]))
            for q in range(lo, t):
                runner = DeepContextTorchRunner(adapter, m.lm_head)
                runner.observe_deep(0, z[0, : q - j])  # verified: positions 0 .. q - j - 1
                runner.advance(h[0, : q - j], 0)
                got = runner.advance(h[0, q - j: q + 1], q - j)  # the round's first token and j drafts
                assert torch.allclose(got, head(out[0, q]), atol=1e-10), (j, q)


def test_the_exported_graphs_attention_equals_the_runners():
    """``attend_biased`` (the ONNX graph's attention: grouped heads by reshape, an additive bias) equals
    ``attend_all`` for a chain's one query and ``attend_masked`` (SDPA, a boolean mask) for a token tree's rows."""
    from kangaroo_core.tree import TreeAttention

    m = tiny_llama(3, layers=3, heads=4, kv_heads=2, dtype=torch.float64)
    adapter = random_deep_context_adapter(m, 1, 5).eval()
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 9, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(1, 2, 9, 8, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        x = torch.randn(1, 1, 32, generator=gen, dtype=torch.float64)
        position = torch.tensor([8])
        assert torch.equal(adapter.attend_biased(x, position, keys, values, torch.zeros(1, 1, 1, 9, dtype=x.dtype)),
                           adapter.attend_all(x, position, keys, values))
        tree = TreeAttention(committed=6, visible=[(6,), (7,), (6, 8)], positions=[6, 6, 7])
        rows = torch.randn(1, 3, 32, generator=gen, dtype=torch.float64)
        positions = tree.position_ids()
        got = adapter.attend_biased(rows, positions, keys, values, tree.additive_mask(9, torch.float64))
        want = adapter.attend_masked(rows, positions, keys, values, tree.allowed(9))
        assert torch.allclose(got, want, atol=1e-12)
        shuffled = adapter.attend_biased(rows, positions, keys, values, tree.additive_mask(9, torch.float64)[..., [1, 0, 2], :])
        assert not torch.allclose(shuffled, want, atol=1e-6)  # the bias rows reach their own queries


@pytest.mark.skipif(not HAS_ORT, reason="onnxruntime/onnx not installed (pip install '.[onnx]')")
@pytest.mark.parametrize("eta, gamma", [(0.0, 4), (0.1, 3)])
def test_onnx_runner_drafts_like_the_torch_runner_and_stays_lossless(tmp_path, eta, gamma):
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx

    m = model(2, dtype=torch.float32)
    export_onnx(m, tmp_path / "bundle", exit_layer=1, quiet=True)
    onnx = OnnxBackend(m, TinyTokenizer(64, m.generation_config.eos_token_id), 1, bundle=tmp_path / "bundle",
                       threads=1, quiet=True)
    torch_backend = tiny_backend(m, exit_layer=1)
    directory = saved(random_deep_context_adapter(m, 1, 4, draft_vocab=list(range(40))), onnx, tmp_path)
    for prompt in ([1, 5, 7, 9, 3], [60, 2, 2, 8]):
        on_onnx = engine(onnx, directory, eta, gamma, 24).generate_ids(prompt)
        on_torch = engine(torch_backend, directory, eta, gamma, 24).generate_ids(prompt)
        assert on_onnx.token_ids == on_torch.token_ids == hf_greedy(m, prompt, 24)
        assert [(r.drafted, r.accepted) for r in on_onnx.rounds] == [(r.drafted, r.accepted) for r in on_torch.rounds]
    manifests = list((tmp_path / "bundle").rglob("adapter_manifest.json"))
    assert manifests and json.loads(manifests[0].read_text())["architecture"]["type"] == "deep-context"


def test_mismatched_deep_context_files_are_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    m = model(1)
    backend = tiny_backend(m, exit_layer=1)
    directory = tmp_path / "a"
    saved(random_deep_context_adapter(m, 1, 0), backend, tmp_path)
    loaded = load_adapter(directory, m, base_fingerprint=backend.fingerprint, exit_layer=1)
    assert isinstance(loaded, DeepContextAdapter) and loaded.reads_deep_states

    def refused(match):
        with pytest.raises(AdapterMismatchError, match=match) as info:
            load_adapter(directory, m, base_fingerprint=backend.fingerprint, exit_layer=1)
        assert "\n" not in str(info.value)

    state = load_file(directory / "adapter.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("kv_fuse")}, directory / "adapter.safetensors")
    refused("missing tensors")  # a paper adapter's weights under a deep-context adapter.json
    save_file(state, directory / "adapter.safetensors")
    meta = json.loads((directory / "adapter.json").read_text())
    (directory / "adapter.json").write_text(json.dumps({**meta, "architecture": {**meta["architecture"], "type": "mystery"}}))
    refused("unknown adapter type 'mystery'")
    (directory / "adapter.json").write_text(json.dumps({**meta, "architecture": {**meta["architecture"], "type": "attention"}}))
    refused("unexpected")  # deep-context weights under a paper adapter.json
    (directory / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(AdapterMismatchError, match="exit layer"):
        load_adapter(directory, m, base_fingerprint=backend.fingerprint, exit_layer=2)
    other = tiny_backend(model(3), exit_layer=1)
    with pytest.raises(AdapterMismatchError, match="made for base model"):
        load_adapter(directory, other.model, base_fingerprint=other.fingerprint, exit_layer=1)


def test_a_draft_head_needs_a_draft_vocabulary():
    m = model(1)
    adapter = DeepContextAdapter.from_base_layer(m, 1, draft_head=True)
    with pytest.raises(ValueError, match="needs a draft vocabulary"):
        adapter.set_draft_vocab(None)
    with pytest.raises(ValueError, match="not both"):
        KangarooAdapter(m.config, separate_head=True, draft_head=True)


def test_hybrid_drafter_hands_deep_states_to_a_deep_context_adapter(tmp_path):
    """The hybrid drafter reads deep states for its own counts and passes them on to the adapter it wraps."""
    from kangaroo_apps.testing import check_lossless, tiny_target
    from kangaroo_plugins.kangaroo.hybrid import HybridDrafter

    target = tiny_target(4)
    adapter = random_deep_context_adapter(target.model, target.exit_layer, 1)
    directory = saved(adapter, target.backend(), tmp_path)
    seen = []

    class Spy(HybridDrafter):
        def observe_deep(self, start, hidden):
            super().observe_deep(start, hidden)
            seen.append(self.adapter.runner.context.known)

    check_lossless(drafter=lambda: Spy(adapter=directory), target=target, max_new_tokens=16)
    assert seen and all(k > 0 for k in seen)


@pytest.mark.parametrize("eta, gamma", [(0.0, 4), (0.05, 3)])
def test_replay_of_a_deep_context_drafter_equals_the_engine(tmp_path, eta, gamma):
    """`kangaroo analyze-policies` replays answers: for a deep-context adapter it follows the depth pattern."""
    from kangaroo_apps.testing import tiny_target
    from kangaroo_tools.replay import replay_answer, simulate_policy

    target = tiny_target(0)  # a seed whose greedy output gets drafts accepted (checked below)
    backend = target.backend()
    directory = saved(random_deep_context_adapter(target.model, target.exit_layer, 2), backend, tmp_path)
    drafter = KangarooDrafter(directory)
    run = engine(backend, directory, eta, gamma, 24)
    engine_drafter = run.drafter
    accepted = 0
    for prompt in ([1, 5, 7, 9, 3], [60, 2, 2, 8], [11, 12, 13]):
        result = run.generate_ids(prompt)
        drafter.bind(backend)
        answer = replay_answer(backend, drafter, "t", prompt, result.token_ids, gamma=gamma, max_new_tokens=24)
        simulated = simulate_policy(answer, ThresholdPolicy(eta=eta), gamma)
        assert [(r.accepted, r.emitted) for r in result.rounds] == [(r.accepted, r.emitted) for r in simulated]
        accepted += sum(r.accepted for r in result.rounds)
    assert accepted > 0 and engine_drafter.wants_deep_states
