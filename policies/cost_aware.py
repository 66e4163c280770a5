"""Cost-aware stopping: per round, draft the number of tokens that maximises expected tokens per second.

A round that drafts k tokens costs ``k · c + t(k + 1)`` — k draft steps and one pass over k + 1 positions, both
measured on this engine's backend, machine, kernels and threads (:func:`~kangaroo_policies.cost_model.cached_costs`:
seconds once, then cached) — and yields ``1 + E_k`` tokens, ``E_k = Σ_{j≤k} p_1 · … · p_j`` where ``p_i`` is the
probability that draft i is accepted once the drafts before it are. So its rate is::

    rate(k) = (1 + E_k) / (k · c + t(k + 1)),        rate(0) = 1 / t(1)   (the target's plain step)

``p_i`` is draft i's confidence (the drafter's top-1 probability) calibrated online on this generation's verdicts:
per confidence bin, accepted / verified drafts with a prior of ``prior`` pseudo-drafts centred on the confidence.

* Before a round: k = 0 — no drafter work at all — when no k ≥ 1 beats ``rate(0)`` for the acceptance that recent
  rounds showed (an average over rounds of the first draft's and the later drafts' outcomes); while skipping, every
  ``probe``-th round drafts anyway, so the estimate follows the text.
* After draft i: keep drafting while some deeper stop j > i, the later drafts taken as likely as draft i (confidence
  runs on along a round), has a higher expected rate than stopping at i.

Where a verify row costs little (custom small-batch kernels) this drafts about as the threshold policy does; where
it costs much (an AVX2-only CPU, a 4-bit export, a large batch) it drafts less and, when speculation cannot pay,
not at all. Nothing is measured inside the per-token loop: the rule is arithmetic on at most gamma numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep

BINS = 10


def parse_costs(value: Any) -> tuple[float, tuple[float, ...]] | None:
    """``"measured"`` → None; ``"C,T1,T2,..."`` → (draft step, pass over 1, 2, ... positions), any one unit."""
    if value in (None, "measured"):
        return None
    try:
        numbers = [float(x) for x in str(value).split(",")]
    except ValueError:
        numbers = []
    if len(numbers) < 2 or min(numbers) < 0 or numbers[1] <= 0:
        raise ConfigError(f"cost policy: costs must be 'measured' or 'DRAFT,T1,T2,...' (a draft step, then a pass "
                          f"over 1, 2, ... positions, T1 > 0), got {value!r}")
    return numbers[0], tuple(numbers[1:])


@attrs.define
class CostAwarePolicy(StoppingPolicy):
    """Draft the k (0 included) that maximises expected tokens per second under the backend's measured costs."""

    gamma: int = 6
    prior: float = attrs.field(default=4.0, converter=float)
    probe: int = attrs.field(default=4, converter=int)
    memory: float = attrs.field(default=0.8, converter=float)
    costs: Any = "measured"
    draft_ms: float = attrs.field(default=0.0, init=False)
    pass_ms: tuple[float, ...] = attrs.field(default=(), init=False)
    accepted: list[int] = attrs.field(factory=lambda: [0] * BINS, init=False)
    verified: list[int] = attrs.field(factory=lambda: [0] * BINS, init=False)
    first: float | None = attrs.field(default=None, init=False)
    later: float | None = attrs.field(default=None, init=False)
    skipped: int = attrs.field(default=0, init=False)
    most: int = attrs.field(default=0, init=False)
    alive: float = attrs.field(default=1.0, init=False)
    expected: float = attrs.field(default=0.0, init=False)
    name = "cost"

    def __attrs_post_init__(self):
        if self.prior <= 0 or self.probe < 1 or not 0 <= self.memory < 1:
            raise ConfigError(f"cost policy: prior must be > 0, probe >= 1 and 0 <= memory < 1, got prior={self.prior}, "
                              f"probe={self.probe}, memory={self.memory}")
        given = parse_costs(self.costs)
        if given is not None:
            self.draft_ms, self.pass_ms = given[0], given[1]

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "CostAwarePolicy":
        return cls(gamma=config.gamma, **options)

    def bind_engine(self, engine: Any) -> None:
        """Read this machine's cost curve for the engine's backend and drafter (measured once, then cached)."""
        if self.pass_ms:
            return
        from kangaroo_policies.cost_model import cached_costs

        curve = cached_costs(engine.backend, engine.drafter, positions=range(1, self.gamma + 2))
        self.draft_ms = curve.draft_step_ms or 0.0
        self.pass_ms = tuple(curve.verify_ms[curve.positions.index(n)] for n in range(1, self.gamma + 2))

    def prepare(self, engine: Any, prompt_ids, max_new_tokens: int) -> None:
        """Every generation starts from the prior: the same prompt gets the same drafting, whatever ran before."""
        self.accepted, self.verified = [0] * BINS, [0] * BINS
        self.first = self.later = None
        self.skipped = 0

    # -- the model ------------------------------------------------------------------------------------------------------
    def pass_cost(self, n: int) -> float:
        """t(n): measured, or extended along the last measured step for n beyond the curve."""
        t = self.pass_ms
        if n <= len(t):
            return t[n - 1]
        step = t[-1] - t[-2] if len(t) > 1 else t[-1]
        return t[-1] + (n - len(t)) * step

    def probability(self, confidence: float) -> float:
        """P(accepted | the drafts before it were): the confidence, calibrated on this generation's verdicts."""
        b = min(BINS - 1, int(confidence * BINS))
        return (self.accepted[b] + self.prior * confidence) / (self.verified[b] + self.prior)

    def rate(self, k: int, expected: float) -> float:
        """Expected tokens per unit of time of a round of k drafts that accepts ``expected`` of them on average."""
        return (1 + expected) / (k * self.draft_ms + self.pass_cost(k + 1))

    def best_rate(self, drafted: int, alive: float, expected: float, p: float, horizon: int) -> float:
        """The highest expected rate over stops j in drafted+1..horizon, each later draft accepted with ``p``."""
        best = 0.0
        for j in range(drafted + 1, horizon + 1):
            alive *= p
            expected += alive
            best = max(best, self.rate(j, expected))
        return best

    # -- the hooks ------------------------------------------------------------------------------------------------------
    def round_budget(self, most: int) -> int:
        self.most = most
        if self.first is None:  # no round verified yet: draft, and learn
            return most
        first, later = self.first, self.first if self.later is None else self.later
        drafting = max(self.rate(1, first), self.best_rate(1, first, first, later, most))
        if drafting > self.rate(0, 0.0):
            self.skipped = 0
            return most
        self.skipped += 1
        return most if self.skipped % self.probe == 0 else 0

    def begin_round(self) -> None:
        self.alive, self.expected = 1.0, 0.0

    def keep_drafting(self, step: DraftStep) -> bool:
        p = self.probability(step.confidence)
        self.alive *= p
        self.expected += self.alive
        i, horizon = step.index, max(self.most, step.index)
        return self.best_rate(i, self.alive, self.expected, p, horizon) > self.rate(i, self.expected)

    def end_round(self, drafts: Sequence[DraftStep], accepted: int) -> None:
        """Calibrate on every verified draft (those up to and including the first rejected one)."""
        for i, step in enumerate(drafts[: accepted + 1]):
            b = min(BINS - 1, int(step.confidence * BINS))
            self.verified[b] += 1
            self.accepted[b] += i < accepted
        m = self.memory
        hit = float(accepted >= 1)
        self.first = hit if self.first is None else m * self.first + (1 - m) * hit
        tried = min(len(drafts), accepted + 1) - 1  # later drafts that were verified
        if tried > 0:
            rate = (accepted - 1) / tried  # drafts 2..accepted of the verified ones
            self.later = rate if self.later is None else m * self.later + (1 - m) * rate


@hookimpl
def register_policies(register):
    register("cost", CostAwarePolicy)
