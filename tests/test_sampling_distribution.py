"""Speculative sampling on a tiny model is lossless in distribution: the first tokens it generates follow the
target's own sampling distribution (vanilla, drafter=None, same processing).

The target distribution of the first three tokens is computed exactly (every continuation, one batched forward of
the tiny model) with the same processing; the samples come from the real engine. Every random draw is seeded, so
these tests are deterministic (never flaky). After vLLM's test_rejection_sampling_approximates_target_distribution:
the empirical distribution gets closer to the target as samples grow, and stays closer to it than to nearby
reference distributions; a chi-square test (statistic and critical value computed here, no scipy) confirms.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kangaroo_core.config import DecodeConfig, SamplingConfig
from kangaroo_core.engine import Engine
from kangaroo_core.sampling import target_probs
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_plugins.speculative_verifier import SpeculativeVerifier
from kangaroo_policies.threshold import ThresholdPolicy

from kangaroo_apps.testing import ScriptedDrafter, tiny_backend, tiny_llama

VOCAB, PROMPT, TOKENS = 5, [1, 2, 3, 4], 3
SAMPLING = SamplingConfig(temperature=1.3, top_k=4, top_p=0.95)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(2, vocab=VOCAB, hidden=16, layers=3, heads=4, kv_heads=2)


@torch.inference_mode()
def exact_distribution(model, sampling: SamplingConfig) -> torch.Tensor:
    """P(t_1, t_2, t_3) when sampling from the target alone, [V**3] in lexicographic order."""
    continuations = torch.tensor(list(itertools.product(range(VOCAB), repeat=TOKENS - 1)))  # [V^2, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(continuations), -1), continuations], dim=1)
    logits = model(ids).logits[:, len(PROMPT) - 1:]  # [V^2, 3, V]: rows predict t_1, t_2, t_3
    p = target_probs(logits, sampling)
    joint = p[:, 0, continuations[:, 0]].diagonal() * p[torch.arange(len(ids)), 1, continuations[:, 1]]  # P(t1, t2)
    return (joint[:, None] * p[:, 2]).reshape(-1)  # [V^3]: (t1, t2) rows times P(t3 | t1, t2)


def sample_outcomes(engine: Engine, n: int, seed0: int) -> tuple[list[int], int, int]:
    """Outcome index (t1*V^2 + t2*V + t3) of ``n`` generations (seeds seed0..seed0+n-1), drafts accepted, drafted."""
    config = engine.config
    outcomes, accepted, drafted = [], 0, 0
    for seed in range(seed0, seed0 + n):
        engine.config = config.replace(sampling=config.sampling.replace(seed=seed))
        result = engine.generate_ids(PROMPT, TOKENS)
        ids = result.token_ids
        outcomes.append((ids[0] * VOCAB + ids[1]) * VOCAB + ids[2])
        accepted += sum(r.accepted for r in result.rounds)
        drafted += sum(r.drafted for r in result.rounds)
    engine.config = config
    return outcomes, accepted, drafted


def histogram(outcomes: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(outcomes), minlength=VOCAB**TOKENS).to(torch.float64) / len(outcomes)


def chi_square(outcomes: list[int], expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (cells with expected count < 5 pooled into one) and its 0.1% critical value."""
    n = len(outcomes)
    observed = torch.bincount(torch.tensor(outcomes), minlength=len(expected)).to(torch.float64)
    counts = expected * n
    big = counts >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([counts[big], counts[~big].sum()[None]])
    keep = exp > 0
    assert torch.all(obs[~keep] == 0), "a sample the target gives probability 0"
    statistic = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.090232  # standard normal 99.9% quantile; Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def make_engine(model, drafter, sampling: SamplingConfig) -> Engine:
    config = DecodeConfig(eta=0.0, gamma=2, exit_layer=1, max_new_tokens=TOKENS, sampling=sampling)
    return Engine(tiny_backend(model, exit_layer=1), drafter, ThresholdPolicy(eta=0.0), SpeculativeVerifier(sampling), config)


@pytest.fixture(scope="module")
def sampled_drafting_outcomes(model):
    engine = make_engine(model, KangarooDrafter(), SAMPLING.replace(sample_drafts=True))
    return sample_outcomes(engine, 800, seed0=0)


def test_exact_distribution_is_a_distribution(model):
    p = exact_distribution(model, SAMPLING)
    assert abs(float(p.sum()) - 1) < 1e-12
    assert (p == 0).any() and (p > 0.001).sum() > 20  # filtering removes some outcomes; many remain


@pytest.mark.parametrize("kind", ["sampled drafts", "greedy drafts", "scripted drafts", "vanilla",
                                  "sampled drafts, draft vocabulary", "hybrid (lookup + adapter), sampled drafts"])
def test_first_tokens_follow_the_target_distribution(model, kind, sampled_drafting_outcomes, tmp_path):
    """Chi-square of the joint distribution of the first three tokens against the exact target distribution."""
    if kind == "sampled drafts":
        outcomes, accepted, drafted = sampled_drafting_outcomes
    elif kind == "sampled drafts, draft vocabulary":  # q is zero outside {0, 2, 4}: the residual must supply 1, 3
        from kangaroo_backends.torch_backend import model_fingerprint
        from kangaroo_plugins.kangaroo.adapter import KangarooAdapter

        adapter = KangarooAdapter.from_base_layer(model, 1)
        adapter.set_draft_vocab([0, 2, 4])
        adapter.save(tmp_path / "adapter", base_fingerprint=model_fingerprint(model), exit_layer=1)
        engine = make_engine(model, KangarooDrafter(str(tmp_path / "adapter")), SAMPLING.replace(sample_drafts=True))
        outcomes, accepted, drafted = sample_outcomes(engine, 300, seed0=2000)
        assert any(t in (1, 3) for o in outcomes for t in (o // VOCAB**2, o // VOCAB % VOCAB, o % VOCAB))
    elif kind.startswith("hybrid"):  # q mixes a lookup token's mass with the adapter's distribution
        from kangaroo_plugins.kangaroo.hybrid import HybridDrafter

        engine = make_engine(model, HybridDrafter(adapter="untrained", min_ngram=1, prior=0.6),
                             SAMPLING.replace(sample_drafts=True))
        outcomes, accepted, drafted = sample_outcomes(engine, 300, seed0=3000)
        assert engine.drafter.sources["lookup"] > 0
    else:
        drafter = None if kind == "vanilla" else KangarooDrafter() if kind == "greedy drafts" else \
            ScriptedDrafter(PROMPT + [0, 1, 2], VOCAB, confidence=0.5, strict=False)
        outcomes, accepted, drafted = sample_outcomes(make_engine(model, drafter, SAMPLING), 300, seed0=1000)
    if kind != "vanilla":  # both the accept and the reject paths ran
        assert 0 < accepted < drafted, (accepted, drafted)
    target = exact_distribution(model, SAMPLING)
    statistic, critical = chi_square(outcomes, target)
    assert statistic < critical, (kind, statistic, critical)
    # the test can fail: the distribution at another temperature is rejected on the same samples
    wrong = exact_distribution(model, SAMPLING.replace(temperature=0.5))
    assert chi_square(outcomes, wrong)[0] > critical


def test_sampled_drafting_converges_to_the_target_faster_than_to_nearby_distributions(model, sampled_drafting_outcomes):
    """vLLM-style: distance to the target shrinks with samples; nearby reference distributions stay further away."""
    outcomes = sampled_drafting_outcomes[0]
    target = exact_distribution(model, SAMPLING)
    gen = torch.Generator().manual_seed(0)
    references = []
    for _ in range(10):  # 60% target + 40% random: close to the target, but not it
        noise = torch.softmax(torch.randn(len(target), generator=gen, dtype=torch.float64), -1)
        references.append(0.6 * target + 0.4 * noise)
    distances = []
    for n in (50, 200, 800):
        empirical = histogram(outcomes[:n])
        distances.append(total_variation(empirical, target))
        if n >= 200:
            assert distances[-1] < min(total_variation(empirical, r) for r in references), n
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.6 * distances[0]
    assert distances[2] < 0.15
