"""Pure functions of sampling: config validation, logit processing (vs transformers' warpers), and the
speculative-sampling math (acceptance probability, residual distribution) checked exactly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from kangaroo_core.config import ConfigError, DecodeConfig, SamplingConfig
from kangaroo_core.results import DraftStep
from kangaroo_core.sampling import draw, make_generator, process_logits, target_probs
from kangaroo_plugins.speculative_verifier import (
    SpeculativeVerifier,
    acceptance_probability,
    point_mass,
    residual_distribution,
)

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None)


# -- config -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "0.7"),
     ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("seed", 1.5), ("seed", "1"),
     ("sample_drafts", 1)],
)
def test_invalid_sampling_values_fail_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^{field} must be"):
        SamplingConfig(**{field: value})


def test_sampling_defaults_are_greedy_and_nest_in_decode_config():
    assert SamplingConfig().greedy and DecodeConfig().sampling == SamplingConfig()
    config = DecodeConfig(sampling=SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, seed=3))
    assert not config.sampling.greedy
    assert config.replace(gamma=2).sampling.seed == 3
    SamplingConfig(temperature=0, top_k=0, top_p=1.0, seed=None)  # boundaries


# -- processing = transformers' warpers -------------------------------------------------------------------------------
def hf_process(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What generate(do_sample=True, temperature=, top_k=, top_p=) applies, in its order and with its conditions."""
    scores, ids = logits, torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k=top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(ids, scores)
    return scores


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 4),
    vocab=st.integers(1, 40),
    temperature=st.sampled_from([0.05, 0.3, 0.7, 1.0, 1.5, 4.0]),
    top_k=st.sampled_from([0, 1, 2, 5, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    ties=st.booleans(),
)
def test_processing_equals_transformers_warpers(seed, rows, vocab, temperature, top_k, top_p, dtype, ties):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    if ties:  # repeated values exercise the >= / <= boundaries
        logits = logits.round()
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = process_logits(logits, sampling)
    theirs = hf_process(logits, temperature, top_k, top_p)
    assert ours.dtype == theirs.dtype
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours, theirs)
    probs = target_probs(logits, sampling)
    assert probs.dtype == torch.float64 and torch.allclose(probs.sum(-1), torch.ones(rows, dtype=torch.float64))
    assert torch.equal(probs > 0, ~torch.isinf(theirs))


def test_temperature_zero_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.9, 0.0]])
    probs = target_probs(logits, SamplingConfig(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    with pytest.raises(ValueError):
        process_logits(logits, SamplingConfig())
    near_zero = target_probs(logits.double(), SamplingConfig(temperature=1e-4))  # the limit agrees
    assert torch.allclose(near_zero, probs.double(), atol=1e-12)


def test_generator_reproduces_draws():
    probs = torch.full((10,), 0.1, dtype=torch.float64)
    a, b, c = make_generator(7), make_generator(7), make_generator(8)
    first = [draw(probs, a) for _ in range(20)]
    assert first == [draw(probs, b) for _ in range(20)]
    assert first != [draw(probs, c) for _ in range(20)]


# -- the math, exactly ------------------------------------------------------------------------------------------------
def one_step_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution of the token emitted at one position: Σ_x q(x)·[a(x)·δ_x + (1 − a(x))·r]."""
    a = acceptance_probability(p, q)  # [V]
    r = residual_distribution(p, q)  # [V]
    return q * a + (q * (1 - a)).sum() * r


@st.composite
def distributions(draw_, vocab: int, zeros: bool = True):
    weights = draw_(st.lists(st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False), min_size=vocab, max_size=vocab))
    if zeros:
        mask = draw_(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
        weights = [0.0 if m else w for w, m in zip(weights, mask)]
    weights = torch.tensor(weights, dtype=torch.float64)
    if weights.sum() <= 1e-6:
        weights = point_mass(draw_(st.integers(0, vocab - 1)), vocab)
    return weights / weights.sum()


@st.composite
def p_and_q(draw_):
    vocab = draw_(st.integers(1, 8))
    p = draw_(distributions(vocab))
    kind = draw_(st.sampled_from(["dense", "point", "equal", "disjoint"]))
    if kind == "point":  # greedy drafting
        q = point_mass(draw_(st.integers(0, vocab - 1)), vocab)
    elif kind == "equal":
        q = p.clone()
    elif kind == "disjoint" and vocab > 1:  # q puts mass only where p has none, where possible
        q = (p == 0).to(torch.float64)
        q = q / q.sum() if q.sum() > 0 else point_mass(int(p.argmin()), vocab)
    else:
        q = draw_(distributions(vocab))
    return p, q


@SETTINGS
@given(p_and_q())
def test_one_accept_reject_step_outputs_exactly_p(pq):
    p, q = pq
    out = one_step_output(p, q)
    assert torch.all(out >= 0)
    assert (out - p).abs().max().item() <= 1e-12, (p, q, out)


@SETTINGS
@given(p_and_q())
def test_acceptance_and_residual_are_well_formed(pq):
    p, q = pq
    a, r = acceptance_probability(p, q), residual_distribution(p, q)
    assert torch.all((a >= 0) & (a <= 1)) and not torch.isnan(a).any()
    assert not torch.isnan(r).any() and torch.all(r >= 0) and math.isclose(r.sum().item(), 1.0, abs_tol=1e-12)
    assert torch.all(r[q >= p] == 0) or torch.equal(r, p)  # r lives where p exceeds q (or is the fallback)


def test_edge_cases():
    p = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    a = acceptance_probability(p, q)
    assert a.tolist() == [0.0, 1.0, 1.0]  # p(x)=0: never accepted; q(x)=0 with p>0: never proposed, defined as 1
    assert residual_distribution(p, q).tolist() == [0.0, 0.0, 1.0]
    x = point_mass(1, 3)  # greedy drafting: accept with p(x); residual is p without x, renormalised
    assert acceptance_probability(p, x)[1].item() == 0.5
    assert residual_distribution(p, x).tolist() == [0.0, 0.0, 1.0]
    one = point_mass(2, 3)  # all mass on one token, both sides: always accepted; residual falls back to p
    assert acceptance_probability(one, one)[2].item() == 1.0
    assert torch.equal(residual_distribution(one, one), one)
    assert torch.equal(residual_distribution(p, p), p)  # no residual mass: p, not NaN
    batched = residual_distribution(torch.stack([p, one]), torch.stack([q, one]))  # [2, V]
    assert batched.tolist() == [[0.0, 0.0, 1.0], one.tolist()]


def test_verifier_at_temperature_zero_is_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]], dtype=torch.float64)
    verifier = SpeculativeVerifier(SamplingConfig(temperature=0, seed=0))
    step = lambda i, t: DraftStep(i, t, torch.zeros(3), 0.9)  # noqa: E731  (greedy drafting: point mass)
    for _ in range(20):
        assert verifier.verify([step(1, 1), step(2, 0)], logits) == verifier.verify([step(1, 1), step(2, 0)], logits)
        v = verifier.verify([step(1, 1), step(2, 0)], logits)
        assert (v.accepted, v.next_token) == (2, 2)
        v = verifier.verify([step(1, 1), step(2, 2)], logits)
        assert (v.accepted, v.next_token) == (1, 0)
        v = verifier.verify([step(1, 0)], logits)
        assert (v.accepted, v.next_token) == (0, 1)


def test_verifier_never_accepts_what_p_excludes_and_resamples_from_the_residual():
    # top_k=1 makes p a point mass on token 2 at every row; a proposal of token 0 must always be rejected
    logits = torch.tensor([[0.0, 1.0, 4.0]] * 2, dtype=torch.float64)
    verifier = SpeculativeVerifier(SamplingConfig(temperature=1.0, top_k=1))
    verifier.begin(make_generator(0))
    q = torch.tensor([0.9, 0.1, 0.0], dtype=torch.float64)
    for _ in range(50):
        v = verifier.verify([DraftStep(1, 0, q, 0.9, proposal=q)], logits)
        assert (v.accepted, v.next_token) == (0, 2)
