"""Cost-aware stopping: per round, draft the number of tokens that maximises expected tokens per second.

A round that drafts k tokens costs ``R(k)``: measured whole, as the engine runs it (rounds back to back, at a short
and a longer context; a generation reads them at its prompt plus half its token budget), on this engine's backend,
machine, kernels and threads (:func:`~kangaroo_policies.cost_model.cached_costs`: seconds once, then cached) — k + 1
one-position shallow passes, k drafter steps, one deep pass over k + 1 positions, and whatever the drafter's kernels
cost the target's (caches, thread pools) — or, given as numbers, ``k · c + t(k + 1)``. It yields ``1 + E_k`` tokens, ``E_k = Σ_{j≤k} p_1 · … · p_j`` where ``p_i`` is the
probability that draft i is accepted once the drafts before it are. So its rate is::

    rate(k) = (1 + E_k) / R(k),        rate(0) = 1 / R(0)   (the target's plain step)

In a batch of s streams (greedy decoding; a sampled stream decides as alone, so that its seed reproduces it whatever
shares its passes) every pass is merged, and every stream decides by this same rule on the same costs: a stream
prices its round as all s streams drafting k together. Each draft step is then the batch's merged one, ``D(s)``
(measured: one M[:l] pass over a row per stream and one drafter pass), and the verify pass is the batch's merged
pass over k + 1 rows of each stream, ``V(s, k + 1)`` (measured on s stream views, and never less than
``t(s(k + 1))``, all there is where streams cannot run together)::

    R_s(k) = R(k) + k · (D(s) − D(1)) + V(s, k + 1) − V(1, k + 1),        rate(k) = (1 + E_k) / R_s(k)

That prices whether to draft at all: a batch's rounds start together (its verify passes wait for every stream), so
the streams that draft take their first steps together. Each then stops at its own draft, so a further step is
priced as the stream's alone — the others wait for it and their one row each joins its verify pass::

    R'_s(k) = R(k) + t(s + k) − t(k + 1),        rate'(k) = (s + E_k) / R'_s(k)

(``batch="wait"`` prices the whole round so, the earlier model, kept for A/B comparisons.) Where the drafter's
steps merge, D(s) grows far slower than s · D(1), so a batch keeps drafting while its merged verify rows are cheap;
where they cannot merge (or only one stream's step was measured) D(s) = s · D(1), and as verify rows grow dear
with s (a large batch fills the rows that cost nothing) drafting turns itself down.

``p_i`` is draft i's confidence (the drafter's top-1 probability) calibrated online on this generation's verdicts:
per confidence bin, accepted / verified drafts with a prior of ``prior`` pseudo-drafts centred on the confidence.

* Each draft, once proposed and before its layer-l state and verify row are paid for (``gate``, the default, for a
  stream decoding alone; a batch decides as with ``gate=False``): kept
  when the round's expected rate with it beats the rate with it dropped, its drafter step spent either way —
  ``(1 + E_i) / R(i)`` against ``(1 + E_{i-1}) / (R(i - 1) + d)``, ``d`` what a dropped draft adds to a round
  (measured: a round whose one draft is dropped, never less than the drafter's own step). A confident draft earns
  its row; a hopeless one costs its drafter step only.
* Before a round (``gate``): k = 0 — no drafter work at all — unless recent drafting rounds yielded more tokens per
  unit of time than plain steps by ``margin``: a running ratio (memory ``memory``) of their tokens to their priced
  costs, dropped drafts and misses included, from the prior's best round (drafts taken with ``RESUME``). While
  skipping, a probe round drafts after ``probe`` skipped rounds; a dropped or missed probe doubles the wait (up to
  2 × ``probe``), a hit restores the prior's yield. Near break-even the margin keeps to plain steps: there is
  little to win there and a noisy estimate's loss to risk.
* Before a round (``gate=False``, the earlier model, kept for A/B comparisons): k = 0 when no k ≥ 1 beats ``rate(0)``
  for the acceptance that recent rounds showed (an average over rounds of the first draft's and the later drafts' outcomes); while skipping, a
  probe round drafts one token after ``probe`` skipped rounds (× the streams of a batch: the others wait for its
  draft), so the estimate follows the text; each failed probe
  doubles that wait (up to 2 × ``probe``), a hit resumes drafting (the estimate back at ``RESUME`` at least). The
  estimate starts at ``RESUME`` and moves by ``1 - memory`` per verified round.
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
#: the first draft's acceptance assumed before any round is verified, and again after a probe's hit (the text has
#: turned predictable): the threshold rule's own assumption, a draft worth making at 0.6
RESUME = 0.6


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


def _flag(value: Any) -> bool:
    """An on/off option, given as a bool or as text (``false``, ``0``, ``no``: off)."""
    return str(value).strip().lower() not in ("false", "0", "no", "off")


@attrs.define
class CostAwarePolicy(StoppingPolicy):
    """Draft the k (0 included) that maximises expected tokens per second under the backend's measured costs."""

    gamma: int = 6
    prior: float = attrs.field(default=4.0, converter=float)
    probe: int = attrs.field(default=4, converter=int)
    memory: float = attrs.field(default=0.9, converter=float)
    costs: Any = "measured"
    #: within a round, keep drafting while the draft's top-1 probability > eta (the threshold rule); None: while a
    #: deeper stop has a higher expected rate. The round's budget (0 included) comes from the costs either way.
    eta: float | None = attrs.field(default=None, converter=attrs.converters.optional(float))
    #: how a stream in a batch prices whether to draft: "together" (every stream drafting k, merged draft steps) or
    #: "wait" (the others drafting nothing and waiting for its draft steps: the earlier model, kept for A/B
    #: comparisons); a further draft within a round is priced as "wait" either way
    batch: str = "together"
    #: see each draft before paying for its verify row: drop it unverified when the row costs more than its
    #: calibrated chance returns, and decide whether to draft at all from what recent drafting rounds yielded; False:
    #: verify every draft and decide from the first drafts' acceptance (the earlier model, kept for A/B comparisons)
    gate: bool = attrs.field(default=True, converter=_flag)
    #: with ``gate``: draft only while recent drafting rounds yielded this much more than plain steps (their
    #: estimate is noisy, and near break-even there is nothing to win but a loss to risk)
    margin: float = attrs.field(default=0.05, converter=float)
    draft_ms: float = attrs.field(default=0.0, init=False)
    drop_ms: float = attrs.field(default=0.0, init=False)  # what a dropped draft adds to a plain step
    pass_ms: tuple[float, ...] = attrs.field(default=(), init=False)
    round_ms: tuple[float, ...] = attrs.field(default=(), init=False)  # this generation's (at its context)
    round_contexts: tuple[int, ...] = attrs.field(default=(), init=False)
    rounds_by_context: tuple[float, ...] = attrs.field(default=(), init=False)
    pass_sizes: tuple[int, ...] = attrs.field(default=(), init=False)
    draft_streams: tuple[int, ...] = attrs.field(default=(1,), init=False)
    draft_many_ms: tuple[float, ...] = attrs.field(default=(), init=False)
    verify_rows: tuple[int, ...] = attrs.field(default=(), init=False)
    verify_many_ms: tuple[float, ...] = attrs.field(default=(), init=False)
    costs_of_rounds: dict = attrs.field(factory=dict, init=False, repr=False)  # (k, streams, together) -> ms
    backend: Any = attrs.field(default=None, init=False, repr=False)
    streams: int = attrs.field(default=1, init=False)
    accepted: list[int] = attrs.field(factory=lambda: [0] * BINS, init=False)
    verified: list[int] = attrs.field(factory=lambda: [0] * BINS, init=False)
    first: float | None = attrs.field(default=None, init=False)
    later: float | None = attrs.field(default=None, init=False)
    skipped: int = attrs.field(default=0, init=False)
    interval: int = attrs.field(default=0, init=False)
    probing: bool = attrs.field(default=False, init=False)
    most: int = attrs.field(default=0, init=False)
    alive: float = attrs.field(default=1.0, init=False)
    expected: float = attrs.field(default=0.0, init=False)
    dropped_later: bool = attrs.field(default=False, init=False)
    yielded: tuple[float, float] | None = attrs.field(default=None, init=False)  # drafting rounds: (tokens, cost)
    name = "cost"

    def __attrs_post_init__(self):
        if self.batch not in ("together", "wait"):
            raise ConfigError(f"cost policy: batch must be 'together' or 'wait', got {self.batch!r}")
        if self.prior <= 0 or self.probe < 1 or not 0 <= self.memory < 1 or self.margin < 0:
            raise ConfigError(f"cost policy: prior must be > 0, probe >= 1, 0 <= memory < 1 and margin >= 0, got "
                              f"prior={self.prior}, probe={self.probe}, memory={self.memory}, margin={self.margin}")
        self.interval = self.probe
        given = parse_costs(self.costs)
        if given is not None:
            self.draft_ms, self.pass_ms = given[0], given[1]
            self.drop_ms = self.draft_ms
            self.pass_sizes = tuple(range(1, len(self.pass_ms) + 1))

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "CostAwarePolicy":
        return cls(gamma=config.gamma, **options)

    def bind_engine(self, engine: Any) -> None:
        """Read this machine's cost curve for the engine's backend and drafter (measured once, then cached). A
        batch binds each stream's copy to the stream's engine, whose backend says how many streams share a pass."""
        # under sampling the drafts decide which random draws make the tokens: a stream decides as if alone, so
        # that its seed reproduces it whatever shares its passes (greedy output never depends on the drafts)
        self.backend = engine.backend if engine.config.sampling.greedy else None
        if self.pass_ms:
            return
        from kangaroo_policies.cost_model import cached_costs

        curve = cached_costs(engine.backend, engine.drafter, self.gamma)
        self.draft_ms = curve.draft_step_ms or 0.0
        # a dropped draft costs its drafter step at least: a round timed among others can read cheaper than that
        dropped, advance = curve.dropped_round_ms, curve.advance_ms or 0.0
        self.drop_ms = self.draft_ms if dropped is None else max(advance, dropped - curve.round_ms[0])
        self.pass_sizes, self.pass_ms = tuple(curve.positions), tuple(curve.verify_ms)
        self.round_ms = tuple(curve.round_ms)
        if curve.short_round_ms:  # rounds at two contexts, flattened context-major
            self.round_contexts = (curve.short_context, curve.context)
            self.rounds_by_context = tuple(curve.short_round_ms) + self.round_ms
        self.draft_streams, self.draft_many_ms = tuple(curve.draft_streams), tuple(curve.draft_many_ms)
        self.verify_rows, self.verify_many_ms = tuple(curve.verify_rows), tuple(curve.verify_many_ms)

    def prepare(self, engine: Any, prompt_ids, max_new_tokens: int) -> None:
        """Every generation starts from the prior: the same prompt gets the same drafting, whatever ran before."""
        self.accepted, self.verified = [0] * BINS, [0] * BINS
        self.first = self.later = None
        self.skipped, self.interval, self.probing = 0, self.probe, False
        self.costs_of_rounds, self.yielded = {}, None
        if self.rounds_by_context:  # priced where the answer runs: its prompt and half its tokens before it
            per = len(self.rounds_by_context) // len(self.round_contexts)
            at = len(prompt_ids) + max_new_tokens // 2
            self.round_ms = tuple(interpolate(self.round_contexts, self.rounds_by_context[k::per], at, extend=False)
                                  for k in range(per))

    # -- the model ------------------------------------------------------------------------------------------------------
    def pass_cost(self, n: int) -> float:
        """t(n): measured, interpolated between measured sizes, or extended along the last measured step."""
        return interpolate(self.pass_sizes, self.pass_ms, n)

    def draft_pass_cost(self, streams: int) -> float:
        """D(s): a batch's draft step with ``streams`` streams drafting (one stream's where only that was measured:
        then s of them, one by one)."""
        return interpolate(self.draft_streams, self.draft_many_ms or (self.draft_ms,), streams)

    def probability(self, confidence: float) -> float:
        """P(accepted | the drafts before it were): the confidence, calibrated on this generation's verdicts."""
        b = min(BINS - 1, int(confidence * BINS))
        return (self.accepted[b] + self.prior * confidence) / (self.verified[b] + self.prior)

    def verify_pass_cost(self, streams: int, rows: int) -> float:
        """V(s, r): a batch's merged verify pass over ``rows`` rows of each of ``streams`` streams — measured,
        interpolated between measured counts and rows — and never less than one stream's pass over as many rows,
        t(s · r) (merged passes timed apart from the loop can read lower than the same passes in it), which is all
        there is where it was not measured."""
        one_stream = self.pass_cost(streams * rows)
        if not self.verify_many_ms:
            return one_stream
        n = len(self.verify_rows)
        by_count = [interpolate(self.verify_rows, self.verify_many_ms[i * n:(i + 1) * n], rows)
                    for i in range(len(self.draft_streams))]
        return max(one_stream, interpolate(self.draft_streams, by_count, streams))

    def round_cost(self, k: int, streams: int = 1, together: bool | None = None) -> float:
        """What a round of k drafts costs (:meth:`price_round`; the same numbers for every round of a
        generation, so each is worked out once)."""
        together = self.batch == "together" if together is None else together
        cost = self.costs_of_rounds.get((k, streams, together))
        if cost is None:
            cost = self.costs_of_rounds[k, streams, together] = self.price_round(k, streams, together)
        return cost

    def price_round(self, k: int, streams: int = 1, together: bool = True) -> float:
        """What a round of k drafts costs: measured whole (``round_ms``) where it was, else k draft steps + t(k + 1)
        (beyond the measured rounds: the last measured one plus that model's increments). In a batch of s streams
        every stream decides by the same rule on the same costs, so all are priced as drafting k together: each
        draft step is the batch's merged one, D(s) instead of D(1), and the verify pass is the batch's over every
        stream's k + 1 rows, V(s, k + 1) instead of V(1, k + 1). Not ``together``: the others drafted nothing
        and wait for this stream's steps, their one row each joining its verify pass, t(s + k) instead of
        t(k + 1)."""
        model = k * self.draft_ms + self.pass_cost(k + 1)
        r = self.round_ms
        if k < len(r):
            alone = r[k]
        elif r:
            last = len(r) - 1
            alone = r[last] + model - (last * self.draft_ms + self.pass_cost(last + 1))
        else:
            alone = model
        if streams > 1 and not together:
            return alone + self.pass_cost(streams + k) - self.pass_cost(k + 1)
        if streams > 1:
            merged = k * (self.draft_pass_cost(streams) - self.draft_pass_cost(1))
            return alone + merged + self.verify_pass_cost(streams, k + 1) - self.verify_pass_cost(1, k + 1)
        return alone

    def rate(self, k: int, expected: float, together: bool | None = None) -> float:
        """Expected tokens per unit of time of a round of k drafts that accepts ``expected`` of them on average (in
        a batch, ``together``: per stream, every stream drafting k; else the whole pass's tokens, the others' one
        each). ``together`` defaults to the ``batch`` option."""
        together = self.batch == "together" if together is None else together
        if together or self.streams == 1:
            return (1 + expected) / self.round_cost(k, self.streams, True)
        return (self.streams + expected) / self.round_cost(k, self.streams, False)

    def best_rate(self, drafted: int, alive: float, expected: float, p: float, horizon: int,
                  together: bool | None = None) -> float:
        """The highest expected rate over stops j in drafted+1..horizon, each later draft accepted with ``p``."""
        best = 0.0
        for j in range(drafted + 1, horizon + 1):
            alive *= p
            expected += alive
            best = max(best, self.rate(j, expected, together))
        return best

    @property
    def gated(self) -> bool:
        """``gate``, for a stream decoding alone: in a batch the earlier model decides (every draft verified), whose
        pricing of a batch's merged passes the batch measurements were made with (see docs/benchmarks.md: gated
        streams in a 4-bit batch drafted far less and lost to the batched target alone at 8 streams)."""
        return self.gate and self.streams == 1

    def prior_round(self, most: int) -> tuple[float, float]:
        """(tokens, cost) of the best round at the prior's acceptance, every draft taken with ``RESUME``."""
        best, expected, alive = (1.0, self.round_cost(0, self.streams)), 0.0, 1.0
        for k in range(1, most + 1):
            alive *= RESUME
            expected += alive
            candidate = (1 + expected, self.round_cost(k, self.streams))
            if candidate[0] / candidate[1] > best[0] / best[1]:
                best = candidate
        return best

    def record(self, tokens: float, cost: float) -> None:
        """Fold a drafting round's tokens and priced cost into the running yield (from the prior's at first)."""
        had = self.yielded or self.prior_round(self.most)
        m = self.memory
        self.yielded = (m * had[0] + (1 - m) * tokens, m * had[1] + (1 - m) * cost)

    def dropped_rate(self, index: int) -> float:
        """The expected rate of this round if draft ``index`` is dropped unverified (its drafter step is spent)."""
        s = self.streams
        return (s + self.expected) / (self.round_cost(index - 1, s, s == 1) + self.drop_ms)

    # -- the hooks ------------------------------------------------------------------------------------------------------
    def round_budget(self, most: int) -> int:
        self.most = most
        self.streams = getattr(self.backend, "streams", 1)
        if self.gated:  # what drafting rounds have yielded, drops and misses included
            tokens, cost = self.yielded or self.prior_round(most)
            drafting = tokens / cost / (1 + self.margin)
        else:
            first = RESUME if self.first is None else self.first  # before any verdict: the prior
            later = first if self.later is None else self.later
            drafting = max(self.rate(1, first), self.best_rate(1, first, first, later, most))
        if drafting > self.rate(0, 0.0):
            self.skipped, self.interval = 0, self.probe
            return most
        self.skipped += 1
        if self.skipped < self.interval * self.streams:  # in a batch a probe makes every stream wait for its draft
            return 0
        self.skipped, self.probing = 0, True
        # a probe tells whether the text has turned predictable: a gated one may draft on (each draft is seen before
        # its verify row is paid for), an ungated one drafts one token
        return most if self.gated else 1

    def begin_round(self) -> None:
        self.alive, self.expected, self.dropped_later = 1.0, 0.0, False

    def worth_verifying(self, step: DraftStep) -> bool:
        """With ``gate``: keep the draft when the round's expected rate with its verify row beats dropping it."""
        if not self.gated:
            return True
        i = step.index
        expected = self.expected + self.alive * self.probability(step.confidence)
        if self.rate(i, expected, together=False) >= self.dropped_rate(i):
            return True
        if i > 1:
            self.dropped_later = True
        else:  # nothing to verify but the target's own token
            self.record(1.0, self.round_cost(0, self.streams) + self.drop_ms)
            self.end_probe(False)
        return False

    def keep_drafting(self, step: DraftStep) -> bool:
        p = self.probability(step.confidence)
        self.alive *= p
        self.expected += self.alive
        if self.eta is not None:
            return step.confidence > self.eta
        # a batch's streams start drafting together, but each stops at its own draft: a further step is priced as
        # this stream's alone, the others waiting for it
        i, horizon = step.index, max(self.most, step.index)
        return (self.best_rate(i, self.alive, self.expected, p, horizon, together=False)
                > self.rate(i, self.expected, together=False))

    def end_round(self, drafts: Sequence[DraftStep], accepted: int) -> None:
        """Calibrate on every verified draft (those up to and including the first rejected one)."""
        for i, step in enumerate(drafts[: accepted + 1]):
            b = min(BINS - 1, int(step.confidence * BINS))
            self.verified[b] += 1
            self.accepted[b] += i < accepted
        m = self.memory
        hit = float(accepted >= 1)
        self.first = m * (RESUME if self.first is None else self.first) + (1 - m) * hit
        if self.gated:
            self.record(1 + accepted, self.round_cost(len(drafts), self.streams) + self.drop_ms * self.dropped_later)
        self.end_probe(bool(hit))
        tried = min(len(drafts), accepted + 1) - 1  # later drafts that were verified
        if tried > 0:
            rate = (accepted - 1) / tried  # drafts 2..accepted of the verified ones
            self.later = rate if self.later is None else m * self.later + (1 - m) * rate


    def end_probe(self, hit: bool) -> None:
        """After a probe round: a miss doubles the wait before the next one (up to 2x); a hit resumes drafting."""
        if not self.probing:
            return
        self.probing = False
        self.interval = self.probe if hit else min(2 * self.interval, 2 * self.probe)
        if hit:
            self.first = max(self.first or 0.0, RESUME)
            prior = self.prior_round(self.most)
            if self.yielded is None or self.yielded[0] / self.yielded[1] < prior[0] / prior[1]:
                self.yielded = prior


def interpolate(sizes: Sequence[int], values: Sequence[float], n: int, extend: bool = True) -> float:
    """The value at ``n``: measured, interpolated between measured sizes, or extended along the last measured step
    (in proportion to ``n`` where only one size was measured); not ``extend``: the last measured value."""
    for i, size in enumerate(sizes):
        if n <= size:
            if n == size or i == 0:
                return values[i]
            return values[i - 1] + (values[i] - values[i - 1]) * (n - sizes[i - 1]) / (size - sizes[i - 1])
    if not extend:
        return values[-1]
    if len(values) == 1:
        return values[0] * n / sizes[0]
    return values[-1] + (n - sizes[-1]) * (values[-1] - values[-2]) / (sizes[-1] - sizes[-2])


@hookimpl
def register_policies(register):
    register("cost", CostAwarePolicy)
