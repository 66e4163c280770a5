"""The decode loop under sampling, on tiny random float64 Llama models: seeded runs reproduce, seeds differ,
temperature 0 through the sampling path is still greedy, EOS and the token budget still end generation, and the
greedy verifier is refused when it would not be lossless."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_core.config import ConfigError, DecodeConfig, SamplingConfig
from kangaroo_core.assembly import EngineSpec, verifier_name
from kangaroo_core.engine import Engine
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_plugins.speculative_verifier import SpeculativeVerifier
from kangaroo_policies.threshold import ThresholdPolicy

from kangaroo_apps.testing import ScriptedDrafter, hf_greedy, set_eos, tiny_backend, tiny_llama

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(backend, drafter, sampling: SamplingConfig, eta=0.3, gamma=3, n=12) -> Engine:
    config = DecodeConfig(eta=eta, gamma=gamma, exit_layer=backend.exit_layer, max_new_tokens=n, sampling=sampling)
    return Engine(backend, drafter, ThresholdPolicy(eta=eta), SpeculativeVerifier(sampling), config)


@st.composite
def cases(draw):
    layers = draw(st.integers(2, 4))
    vocab = draw(st.integers(16, 64))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "layers": layers,
        "exit_layer": draw(st.integers(1, layers - 1)),
        "vocab": vocab,
        "prompt": draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)),
        "eta": draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])),
        "gamma": draw(st.integers(1, 5)),
        "n": draw(st.integers(6, 16)),
        "temperature": draw(st.sampled_from([0.5, 0.8, 1.0, 1.5])),
        "top_k": draw(st.sampled_from([0, 0, 5, 20])),
        "top_p": draw(st.sampled_from([1.0, 1.0, 0.9])),
        "sample_drafts": draw(st.booleans()),
        "drafter": draw(st.sampled_from(["kangaroo", "vanilla"])),
        "sampling_seed": draw(st.integers(0, 2**31)),
    }


@SETTINGS
@given(case=cases())
def test_same_seed_same_tokens_and_seeds_differ(case):
    model = tiny_llama(case["seed"], vocab=case["vocab"], hidden=32, layers=case["layers"], heads=4, kv_heads=2)
    backend = tiny_backend(model, exit_layer=case["exit_layer"])
    sampling = SamplingConfig(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"],
                              seed=case["sampling_seed"], sample_drafts=case["sample_drafts"])
    drafter = KangarooDrafter() if case["drafter"] == "kangaroo" else None
    engine = make_engine(backend, drafter, sampling, case["eta"], case["gamma"], case["n"])
    first = engine.generate_ids(case["prompt"], case["n"])
    again = engine.generate_ids(case["prompt"], case["n"])  # the same engine: a fresh generator per generation
    assert again.token_ids == first.token_ids and len(first.token_ids) == case["n"]
    other = make_engine(tiny_backend(model, exit_layer=case["exit_layer"]), KangarooDrafter() if drafter else None,
                        sampling, case["eta"], case["gamma"], case["n"])
    assert other.generate_ids(case["prompt"], case["n"]).token_ids == first.token_ids  # a fresh engine too
    outputs = {tuple(first.token_ids)}
    for offset in range(1, 5):
        engine.config = engine.config.replace(sampling=sampling.replace(seed=case["sampling_seed"] + offset))
        outputs.add(tuple(engine.generate_ids(case["prompt"], case["n"]).token_ids))
    assert len(outputs) >= 2, "five seeds gave the same output"


@pytest.mark.parametrize("drafter_kind", ["kangaroo", "scripted", "vanilla"])
@pytest.mark.parametrize("sample_drafts", [False, True])
def test_temperature_zero_through_the_speculative_verifier_is_greedy(drafter_kind, sample_drafts):
    model = tiny_llama(4, vocab=40, hidden=32, layers=3, heads=4, kv_heads=2)
    prompt, n = [3, 1, 4, 1, 5], 16
    ref = hf_greedy(model, prompt, n)
    drafter = {"kangaroo": KangarooDrafter(), "vanilla": None,
               "scripted": ScriptedDrafter(prompt + ref, 40, wrong_at={7, 9, 12})}[drafter_kind]
    engine = make_engine(tiny_backend(model, exit_layer=1), drafter,
                         SamplingConfig(temperature=0, seed=1, sample_drafts=sample_drafts), eta=0.0, gamma=4, n=n)
    assert engine.generate_ids(prompt, n).token_ids == ref


def test_eos_still_ends_a_sampled_generation():
    model = tiny_llama(5, vocab=24, hidden=32, layers=3, heads=4, kv_heads=2)
    backend = tiny_backend(model, exit_layer=1)
    sampling = SamplingConfig(temperature=1.0, seed=0, sample_drafts=True)
    free = make_engine(backend, KangarooDrafter(), sampling, eta=0.0, gamma=4, n=20).generate_ids([1, 2], 20)
    eos = free.token_ids[len(free.token_ids) // 2]
    set_eos(model, eos)
    backend = tiny_backend(model, exit_layer=1)
    stops = 0
    for seed in range(5):
        engine = make_engine(backend, KangarooDrafter(), sampling.replace(seed=seed), eta=0.0, gamma=4, n=20)
        result = engine.generate_ids([1, 2], 20)
        assert eos not in result.token_ids[:-1]
        assert result.stopped_on_eos == (result.token_ids[-1] == eos)
        assert result.stopped_on_eos or len(result.token_ids) == 20
        stops += result.stopped_on_eos
    assert stops >= 1


def test_greedy_verifier_is_refused_under_sampling():
    backend = tiny_backend(tiny_llama(0, vocab=16, hidden=16, layers=2, heads=2, kv_heads=1), exit_layer=1)
    config = DecodeConfig(exit_layer=1, sampling=SamplingConfig(temperature=0.7))
    with pytest.raises(ConfigError, match="greedy verifier is only lossless at temperature 0"):
        Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config)
    assert verifier_name(EngineSpec(), config) == "speculative" and verifier_name(EngineSpec(), DecodeConfig()) == "greedy"
    Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config.replace(sampling=SamplingConfig()))
