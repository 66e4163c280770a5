"""Every supported decoder family (Llama, Mistral, Qwen2, Qwen3, Gemma 3) through the split backends, the adapters and
the ONNX export: greedy output token-identical to transformers' own ``generate``; refusals for what is not supported.

The tiny models switch each family's quirks on (sliding windows shorter than the sequences, q/k norms, Gemma's sandwich
norms, two RoPE bases and scaled embeddings); :func:`test_the_window_is_exercised` shows the identity tests would see a
window handled wrongly.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from kangaroo_backends.families import (FAMILIES, UnsupportedArchitectureError, family_of, layer_kinds,
                                        rotary_embeddings, sliding_window)
from kangaroo_backends.gguf_tokenizer import spm_bpe_merges
from kangaroo_backends.hf_compat import rope_theta
from kangaroo_backends.torch_backend import TorchBackend, model_fingerprint
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine, encode_prompt, plain_prompt
from kangaroo_core.errors import AdapterMismatchError, ModelLoadError
from kangaroo_apps.testing import TINY_FAMILIES, TinyTokenizer, hf_greedy, tiny_model
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_plugins.kangaroo.networks import load_adapter

HAS_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
needs_ort = pytest.mark.skipif(not HAS_ORT, reason="onnxruntime/onnx not installed (pip install '.[onnx]')")

MODELS: dict = {}
PROMPTS = [[random.Random(seed).randrange(1, 64) for _ in range(9)] for seed in range(2)]
NEW_TOKENS = 24  # 9 + 24 positions: far past every tiny window (6)


def model(family: str, seed: int = 0, dtype=torch.float64):
    key = (family, seed, dtype)
    if key not in MODELS:
        MODELS[key] = tiny_model(family, seed, dtype=dtype, eos_token_id=None if seed % 2 else 5)
    return MODELS[key]


def backend(m, exit_layer: int = 2, kernels: str = "auto") -> TorchBackend:
    return TorchBackend(m, TinyTokenizer(m.config.vocab_size, m.generation_config.eos_token_id), exit_layer,
                        f"tiny-{m.config.model_type}", kernels=kernels)


def perturbed(adapter, seed: int = 0, scale: float = 0.05):
    """An adapter whose drafts differ from the untrained one's (and, for the deep-context one, read deep states)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return adapter


def save_adapter(tmp_path, m, kind: str, exit_layer: int = 2):
    network = DeepContextAdapter if kind == "deep-context" else KangarooAdapter
    adapter = perturbed(network.from_base_layer(m, exit_layer, ffn=kind != "attention"))
    directory = tmp_path / f"{m.config.model_type}-{kind}"
    adapter.save(directory, base_fingerprint=model_fingerprint(m), exit_layer=exit_layer)
    return str(directory)


# -- the description ------------------------------------------------------------------------------------------------
def test_every_family_has_a_tiny_model_and_its_quirks():
    assert {f.name for f in FAMILIES} == set(TINY_FAMILIES)
    for family in TINY_FAMILIES:
        config = model(family).config
        assert family_of(config).name == family
    assert set(layer_kinds(model("gemma3").config)) == {"full", "sliding"}
    assert set(layer_kinds(model("mistral").config)) == {"sliding"}
    assert set(layer_kinds(model("qwen2").config)) == {"full", "sliding"}
    assert layer_kinds(model("llama").config) == ("full",) * 4 and sliding_window(model("llama").config) is None
    assert sliding_window(model("gemma3").config) == 6


def test_unsupported_architectures_are_refused_in_one_line():
    from transformers import GPT2Config, Gemma2Config

    with pytest.raises(UnsupportedArchitectureError, match="not supported; supported: llama, mistral, qwen2, qwen3, gemma3_text") as info:
        family_of(GPT2Config())
    assert "\n" not in str(info.value)
    with pytest.raises(UnsupportedArchitectureError, match="not supported"):
        family_of(Gemma2Config())
    config = model("gemma3").config.__class__(**{**model("gemma3").config.to_dict(), "final_logit_softcapping": 30.0})
    with pytest.raises(UnsupportedArchitectureError, match="final_logit_softcapping"):
        family_of(config)
    assert issubclass(UnsupportedArchitectureError, ModelLoadError)


def test_an_unsupported_hf_directory_is_refused_before_loading_weights(tmp_path):
    from transformers import GPT2Config

    from kangaroo_backends.loading import load_model

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="model type 'gpt2' is not supported; supported: llama"):
        load_model(tmp_path)


def test_the_window_is_exercised():
    """Power check: the same weights without their window answer differently on the test prompts."""
    for family in ("mistral", "qwen2", "gemma3"):
        m = model(family)
        windowless = tiny_model(family, 0, window=1000, eos_token_id=5)
        windowless.load_state_dict(m.state_dict())
        assert any(hf_greedy(m, p, NEW_TOKENS) != hf_greedy(windowless, p, NEW_TOKENS) for p in PROMPTS), family


# -- torch ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("kernels", ["auto", "plain"])
def test_torch_target_and_kangaroo_are_token_identical_to_transformers(family, kernels, tmp_path, one_torch_thread):
    for seed in (0, 1):
        m = model(family, seed)
        b = backend(m, kernels=kernels)
        # the threshold policy at eta 0: every round drafts gamma, so the untrained drafters' drafts are verified
        engines = [Engine.build(backend=b, drafter=None),
                   Engine.build(backend=b, config=DecodeConfig(exit_layer=2, eta=0.0, gamma=4), policy="threshold"),
                   Engine.build(backend=b, config=DecodeConfig(exit_layer=2, eta=0.0, gamma=3), policy="threshold",
                                drafter=KangarooDrafter(adapter=save_adapter(tmp_path, m, "deep-context")))]
        for prompt in PROMPTS:
            want = hf_greedy(m, prompt, NEW_TOKENS)
            results = [engine.generate_ids(prompt, NEW_TOKENS) for engine in engines]
            assert [r.token_ids for r in results] == [want] * 3, (family, seed, kernels)
            assert any(r.accepted for r in results[1].rounds + results[2].rounds)  # drafts were accepted and checked


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_token_trees_stay_identical_across_windows(family, one_torch_thread):
    m = model(family)
    b = backend(m)
    engine = Engine.build(backend=b, config=DecodeConfig(exit_layer=2, eta=0.0, gamma=4), tree="dynamic",
                          tree_options={"budget": 6, "topk": 2, "depth": 3, "min_prob": 0.0})
    for prompt in PROMPTS:
        assert engine.generate_ids(prompt, NEW_TOKENS).token_ids == hf_greedy(m, prompt, NEW_TOKENS)


# -- adapters ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_adapters_round_trip_and_are_refused_for_another_family(family, tmp_path):
    m = model(family)
    path = save_adapter(tmp_path, m, "deep-context")
    loaded = load_adapter(path, m, base_fingerprint=model_fingerprint(m), exit_layer=2)
    assert isinstance(loaded, DeepContextAdapter)
    assert type(loaded.attention).__name__.startswith(family_of(m.config).prefix)
    other = model("llama" if family != "llama" else "gemma3")
    with pytest.raises(AdapterMismatchError):
        load_adapter(path, other, base_fingerprint=model_fingerprint(other), exit_layer=2)
    with pytest.raises(AdapterMismatchError, match="does not fit this model"):  # same fingerprint, other family
        load_adapter(path, other, base_fingerprint=model_fingerprint(m), exit_layer=2)


def test_a_gemma_adapter_at_a_sliding_layer_uses_that_layer_s_rope():
    m = model("gemma3")
    kinds = layer_kinds(m.config)
    sliding, full = kinds.index("sliding"), kinds.index("full")
    local, rope = KangarooAdapter(m.config, exit_layer=sliding), KangarooAdapter(m.config, exit_layer=full)
    assert rope_theta(local.config) == rope_theta(m.config, "sliding_attention") == 10000.0
    assert rope_theta(rope.config) == rope_theta(m.config) == 1e6
    rotary = rotary_embeddings(m)
    assert torch.equal(local.rotary_emb.inv_freq, rotary["sliding"].inv_freq)
    assert torch.equal(rope.rotary_emb.inv_freq, rotary["full"].inv_freq)
    assert not torch.equal(rotary["sliding"].inv_freq, rotary["full"].inv_freq)


# -- onnx -----------------------------------------------------------------------------------------------------------
@needs_ort
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_onnx_export_and_kangaroo_on_it_are_token_identical(family, tmp_path, one_torch_thread, monkeypatch):
    from kangaroo_backends import onnx_backend as ob
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx

    monkeypatch.setattr(ob, "cache_dir", lambda: tmp_path / "cache")
    m = model(family, 0, torch.float32)
    export_onnx(m, tmp_path / "bundle", exit_layer=2, quiet=True)
    onnx = OnnxBackend(m, TinyTokenizer(64, 5), 2, bundle=tmp_path / "bundle", threads=1, quiet=True)
    eager = backend(m)
    for kind in ("attention", "deep-context"):
        path = save_adapter(tmp_path, m, kind)
        config = DecodeConfig(exit_layer=2, eta=0.0, gamma=4)
        # the threshold policy: the same drafting on both backends (the cost-aware one follows each one's costs)
        on_onnx = Engine.build(backend=onnx, config=config, drafter=KangarooDrafter(adapter=path), policy="threshold")
        on_torch = Engine.build(backend=eager, config=config, drafter=KangarooDrafter(adapter=path), policy="threshold")
        for prompt in PROMPTS:
            got, want = on_onnx.generate_ids(prompt, NEW_TOKENS), on_torch.generate_ids(prompt, NEW_TOKENS)
            assert got.token_ids == want.token_ids == hf_greedy(m, prompt, NEW_TOKENS), (family, kind)
            assert [(r.drafted, r.accepted) for r in got.rounds] == [(r.drafted, r.accepted) for r in want.rounds]


# -- prompts and tokenizers -------------------------------------------------------------------------------------------
def test_a_base_model_without_a_chat_template_gets_plain_question_answer_prompts():
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello. "},
                {"role": "user", "content": "And?"}]
    assert plain_prompt(messages) == "Question: Hi?\nAnswer: Hello.\nQuestion: And?\nAnswer:"

    class Recorder(TinyTokenizer):
        def encode(self, text, **kw):
            self.seen = text
            return super().encode(text)

    tok = Recorder(64)
    encode_prompt(tok, "What is 2+2?")
    assert tok.seen == "Question: What is 2+2?\nAnswer:"
    encode_prompt(tok, "raw text", chat=False)
    assert tok.seen == "raw text"


def test_sentencepiece_bpe_merges_rank_by_score():
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    scores = [0, -1, -2, -3, -4, -5, -6, 0]
    types = [3, 1, 1, 1, 1, 1, 1, 6]
    assert spm_bpe_merges(tokens, scores, types) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "mistral"])
def test_model_generate_custom_generate_on_every_family(family, one_torch_thread):
    from kangaroo_apps.hf import kangaroo_generate, last_result

    m = model(family)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        plain = m.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        ours = m.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          custom_generate=kangaroo_generate, kangaroo_exit_layer=2, kangaroo_eta=0.0)
        assert ours.tolist() == plain.tolist()
        assert last_result(m).rounds


def save_tiny_family_dir(directory, family: str):
    """A tiny model directory of ``family`` as a user would have it (safetensors + tokenizer, no chat template).
    Qwen2's: a byte-level BPE tokenizer (transformers 5.x always reads a qwen2 directory's tokenizer as a Qwen2
    tokenizer, rebuilt from the saved vocabulary and merges)."""
    from conftest import make_bpe_tokenizer, make_tokenizer
    from transformers import GenerationConfig

    tok = make_bpe_tokenizer() if family == "qwen2" else make_tokenizer()
    tok.chat_template = None  # a base model: plain Question/Answer prompts
    m = tiny_model(family, 0, vocab=len(tok), dtype=torch.float32, eos_token_id=tok.eos_token_id)
    m.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    m.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_bench_runs_every_backend_on_another_family(family, tmp_path, monkeypatch, one_torch_thread):
    import json

    from kangaroo_apps.cli import main

    directory = save_tiny_family_dir(tmp_path / family, family)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in [
        {"question_id": 1, "category": "x", "subtask": "mt_bench", "turns": ["hello world", "and again"]},
        {"question_id": 2, "category": "y", "subtask": "qa", "turns": ["what is the answer"]}]))
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path / "cache"))
    methods = "hf_vanilla,vanilla,kangaroo" + (",vanilla_onnx,kangaroo_onnx" if HAS_ORT else "")
    assert main(["bench", "--questions", str(questions), "--out", str(tmp_path / "out"), "--model", str(directory),
                 "--methods", methods, "--max-new-tokens", "10", "--eta", "0", "--gamma", "3"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for name in methods.split(","):
        entry = results["methods"][name]
        assert entry["error"] is None, (name, entry["error"])
        assert entry["overall"]["identical_to_vanilla"] is True, name  # every method, hf_vanilla itself included


def test_without_an_exit_layer_the_adapter_s_own_layer_is_used(tmp_path, one_torch_thread):
    from kangaroo_backends.loading import load_model
    from kangaroo_apps.cli_options import EngineOptions

    directory = save_tiny_family_dir(tmp_path / "gemma", "gemma3")
    loaded, _, _ = load_model(directory)
    adapter = save_adapter(tmp_path, loaded, "attention", exit_layer=3)
    engine = EngineOptions(model=str(directory), adapter=adapter, eta=0.0).engine()
    assert engine.backend.exit_layer == engine.config.exit_layer == 3
    assert engine.drafter.resolved_adapter == adapter
    vanilla = EngineOptions(model=str(directory)).engine(vanilla=True)
    assert vanilla.backend.exit_layer == 2  # no drafter: the default split
    prompt = [5, 6, 7, 8]
    assert engine.generate_ids(prompt, 16).token_ids == vanilla.generate_ids(prompt, 16).token_ids
    assert EngineOptions(model=str(directory), adapter=adapter).backend().exit_layer == 3
    assert EngineOptions(model=str(directory), adapter=adapter).backend(vanilla=True).exit_layer == 2
    with pytest.raises(AdapterMismatchError, match="exit layer 3, but exit layer 2"):
        EngineOptions(model=str(directory), adapter=adapter, exit_layer=2).engine().generate_ids(prompt, 4)


def test_exit_layer_costs_tool_splits_at_each_adapter_s_layer(tmp_path, one_torch_thread):
    import json

    from click.testing import CliRunner

    from kangaroo_backends.loading import load_model
    from kangaroo_apps.studies.exit_layer_costs import main

    directory = save_tiny_family_dir(tmp_path / "qwen3", "qwen3")
    loaded, _, _ = load_model(directory)
    adapters = [save_adapter(tmp_path / f"l{layer}", loaded, "attention", exit_layer=layer) for layer in (1, 3)]
    out = tmp_path / "costs.json"
    result = CliRunner().invoke(main, [*adapters, "--model", str(directory), "--repeats", "2", "--context", "20",
                                        "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["exit_layer"] for r in rows] == [1, 3]
    assert all(r["forward_ms"] > 0 and r["draft_step_ms"] > 0 for r in rows)


def test_a_tree_deeper_than_the_window_is_refused():
    from kangaroo_core.tree import TreeAttention

    tree = TreeAttention(committed=10, visible=[[10], [10, 11]], positions=[10, 11])
    assert tree.allowed(12, window=6).shape == (2, 12)
    deep = TreeAttention(committed=10, visible=[[10 + i for i in range(7)]], positions=[16])
    with pytest.raises(ValueError, match="does not fit a 6-position sliding window"):
        deep.allowed(17, window=6)


def test_an_adapter_for_another_model_has_no_preferred_layer(tmp_path):
    path = save_adapter(tmp_path, model("qwen3"), "attention", exit_layer=3)
    assert KangarooDrafter(adapter=path).preferred_exit_layer(model_fingerprint(model("qwen3"))) == 3
    assert KangarooDrafter(adapter=path).preferred_exit_layer("another-model") is None  # load says why
    assert KangarooDrafter(adapter="untrained").preferred_exit_layer("x") is None


@needs_ort
def test_an_onnx_bundle_resplits_only_at_its_own_layer(tmp_path, one_torch_thread):
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_core.config import ConfigError

    m = model("llama", 0, torch.float32)
    export_onnx(m, tmp_path / "bundle", exit_layer=3, quiet=True)
    backend = OnnxBackend(m, TinyTokenizer(64, 5), 2, bundle=tmp_path / "bundle", threads=1, quiet=True)
    assert backend.resplit(3).exit_layer == 3
    with pytest.raises(ConfigError, match="split at exit layer 3; it cannot be re-split at 1"):
        backend.resplit(1)


def test_architecture_report_joins_training_costs_and_bench(tmp_path):
    import json

    from click.testing import CliRunner

    from kangaroo_apps.studies.architecture_report import main

    costs, bench = [], []
    for layer in (1, 2):
        sweep = tmp_path / f"sweep-l{layer}"
        sweep.mkdir()
        (sweep / "training_report.json").write_text(json.dumps({
            "data": {"train_prompts": 8, "train_response_tokens": 100},
            "history": [{"top1_agreement": 0.1, "cr": 1.1}, {"top1_agreement": 0.2 + layer / 100, "cr": 1.2}]}))
        costs.append({"adapter": str(sweep), "exit_layer": layer, "layers": 4, "forward_ms": 10.0,
                      "draft_step_ms": 1.0 * layer, "draft_over_forward": 0.1 * layer})
        bench.append({"exit_layer": layer, "mean_accepted_tokens": 1.3, "speedup": 1.05})
    (tmp_path / "costs.json").write_text(json.dumps({"rows": costs}))
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "adapters.json").write_text(json.dumps({"adapters": bench}))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["--out", str(out), "--model", "Tiny", str(tmp_path / "sweep-l"),
                                       str(tmp_path / "costs.json"), str(tmp_path / "bench")])
    assert result.exit_code == 0, result.output
    assert "| Tiny | 2 of 4 | 0.220 | 1.20 | 0.20 (2.0 / 10.0 ms) | 1.30 | 1.05× |" in (out / "architectures.txt").read_text()
    assert (out / "architectures.png").stat().st_size > 0
