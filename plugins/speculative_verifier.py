"""Speculative sampling (rejection sampling): lossless verification when tokens are sampled.

Glossary (vLLM rejection-sampler style; one round, batch size 1):
    V        vocabulary size.
    k        drafts proposed this round, d_1..d_k.
    p        the target's processed distribution (temperature, top-k, top-p), [k+1, V]; row i follows d_1..d_i.
    q        the proposal: the distribution each draft was really drawn from, [V] per draft. Greedy drafting draws
             from a point mass on the drafter's top-1 (``DraftStep.proposal is None``); sampled drafting from the
             drafter's processed distribution.
    a(x)     acceptance probability of draft x: min(1, p(x) / q(x)).
    r        residual distribution after a rejection: norm(max(0, p − q)), [V].

Per draft i (in order): accept d_i with probability a(d_i) under p[i-1]; at the first rejection emit a token drawn
from r and stop; when all k are accepted, emit a bonus token drawn from p[k]. The emitted token at each position is
then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023): for every token y,
``q(y)·a(y) + (Σ_x q(x)(1 − a(x)))·r(y) = min(q(y), p(y)) + max(0, p(y) − q(y)) = p(y)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kangaroo_core.config import DecodeConfig, SamplingConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Verifier
from kangaroo_core.results import DraftStep, Verdict
from kangaroo_core.sampling import draw, make_generator, target_probs, uniform
from kangaroo_core.tree import sample_tree_walk


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """a = min(1, p / q), elementwise; [..., V] or scalars.

    Where q = 0 the token is never proposed, so a is irrelevant there; it is defined as 1 if p > 0 else 0 (no NaN).
    """
    safe_q = torch.where(q > 0, q, torch.ones_like(q))
    return torch.where(q > 0, torch.clamp(p / safe_q, max=1.0), (p > 0).to(p.dtype))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """r = norm(max(0, p − q)) over the last dim, [..., V] → [..., V].

    When the residual has no mass (p ≤ q everywhere, so a rejection can only come from rounding), r falls back to p:
    always a distribution, never NaN.
    """
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    has_mass = mass > 0
    return torch.where(has_mass, residual / torch.where(has_mass, mass, torch.ones_like(mass)), p)


def point_mass(token: int, vocab_size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The proposal of greedy drafting: all mass on ``token``, [V]."""
    q = torch.zeros(vocab_size, dtype=dtype)
    q[token] = 1.0
    return q


def proposal_of(step: DraftStep, vocab_size: int) -> torch.Tensor:
    """The distribution ``step.token`` was drawn from, float64 [V]."""
    if step.proposal is None:
        return point_mass(step.token, vocab_size)
    return step.proposal.detach().to(device="cpu", dtype=torch.float64)


class SpeculativeVerifier(Verifier):
    """Lossless under sampling: the output is distributed as sampling from the target alone (same processing).

    Args:
        sampling: the temperature / top-k / top-p that define the target's distribution p (the engine's config).
    """

    name = "speculative"
    samples = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig()):
        self.sampling = sampling
        self.generator = make_generator(sampling.seed)

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "SpeculativeVerifier":
        return cls(sampling=options.pop("sampling", config.sampling), **options)

    def begin(self, generator: torch.Generator) -> None:
        self.generator = generator

    def verify(self, drafts: Sequence[DraftStep], target_logits: torch.Tensor) -> Verdict:
        p = target_probs(target_logits, self.sampling)  # [k+1, V]
        vocab_size = p.shape[-1]
        for i, step in enumerate(drafts):
            x = step.token
            q_x = torch.tensor(1.0, dtype=torch.float64) if step.proposal is None else proposal_of(step, vocab_size)[x]
            if uniform(self.generator) < float(acceptance_probability(p[i, x], q_x)):
                continue
            residual = residual_distribution(p[i], proposal_of(step, vocab_size))  # [V]
            return Verdict.chain(i, draw(residual, self.generator))
        return Verdict.chain(len(drafts), draw(p[len(drafts)], self.generator))

    def verify_tree(self, tree, target_logits: torch.Tensor) -> Verdict:
        """Multi-candidate rejection sampling over each node's children (point-mass candidates, see
        :func:`kangaroo_core.tree.sample_tree_walk`): the emitted tokens are distributed as the target's."""
        p = target_probs(target_logits, self.sampling)  # [rows, V]
        path, token = sample_tree_walk(tree, p, lambda: uniform(self.generator), lambda q: draw(q, self.generator))
        return Verdict([r - 1 for r in path], token)


@hookimpl
def register_verifiers(register):
    register("speculative", SpeculativeVerifier)
