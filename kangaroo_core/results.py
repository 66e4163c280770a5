"""Per-step, per-round and per-generation results (attrs value objects)."""

from __future__ import annotations

import attrs
import torch

from kangaroo_core.metrics import compression_rate, ctar, mean_drafted


@attrs.frozen
class DraftStep:
    """One token proposed by the drafter, shown to the stopping policy.

    Attributes:
        index: 1-based position of this draft in the round.
        token: the proposed token id (the drafter's top-1 under greedy drafting, a draw from ``proposal`` under
            sampled drafting).
        probs: the drafter's next-token distribution, shape [vocab].
        confidence: the drafter's top-1 probability, ``probs.max()``.
        proposal: the distribution ``token`` was really drawn from, shape [vocab] (the drafter's processed
            distribution under sampled drafting); None means a point mass on ``token`` (greedy drafting).
    """

    index: int
    token: int
    probs: torch.Tensor = attrs.field(eq=False, repr=False)
    confidence: float
    proposal: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, index: int) -> "DraftStep":
        """The drafter's top-1 proposal from its next-token logits [V] (greedy drafting: q is a point mass)."""
        probs = torch.softmax(logits.float(), dim=-1)
        confidence, token = torch.stack([t.double() for t in probs.max(dim=-1)]).tolist()  # one host sync, exact
        return cls(index=index, token=int(token), probs=probs, confidence=confidence)


@attrs.frozen
class Verdict:
    """What the verifier decided for one round.

    Attributes:
        path: indices (into the round's drafts, ascending) of the accepted drafts, in the order they are emitted.
            For a chain it is always a prefix ``0..m-1`` (:meth:`chain`); a tree verifier names one root-to-node path.
        next_token: the target's own token after the accepted path (a correction, or a bonus token when every
            draft on the path was accepted).
    """

    path: tuple[int, ...] = attrs.field(converter=tuple)
    next_token: int

    @classmethod
    def chain(cls, accepted: int, next_token: int) -> "Verdict":
        """The first ``accepted`` drafts of a chain, then ``next_token``."""
        return cls(tuple(range(accepted)), next_token)

    @property
    def accepted(self) -> int:
        """How many drafts are accepted."""
        return len(self.path)


def cut_at_eos(tokens, eos: frozenset[int], limit: int) -> list[int]:
    """``tokens`` up to and including the first EOS, and at most ``limit`` of them."""
    out: list[int] = []
    for token in list(tokens)[:limit]:
        out.append(int(token))
        if token in eos:
            break
    return out


class Emitted(list):
    """The token ids one step of :meth:`~kangaroo_core.engine.Engine.decode` appends (a plain ``list`` otherwise).

    ``from_drafts``: how many of them, from the front, are accepted drafts; the rest is the target's own token (none
    when EOS or the token budget cut the round inside its accepted drafts). ``drafted``: how many drafts the round
    proposed. The prefill's token has 0 and 0.
    """

    from_drafts: int = 0
    drafted: int = 0

    def __init__(self, tokens=(), from_drafts: int = 0, drafted: int = 0):
        super().__init__(tokens)
        self.from_drafts, self.drafted = from_drafts, drafted


@attrs.frozen
class RoundResult:
    """Statistics of one draft → stop → verify round."""

    drafted: int
    accepted: int
    emitted: int  # tokens appended to the output this round (accepted + 1, fewer at EOS or the token budget)
    draft_seconds: float
    verify_seconds: float
    dropped: int = 0  # drafts proposed but not verified (the policy found a verify row not worth it)


@attrs.frozen
class GenerationResult:
    """The outcome of one ``Engine.generate`` call.

    ``rounds`` are the verification passes after the prefill (the prefill's first token is not a round).
    ``seconds`` is the engine's own time (prefill to last token), never the consumer's time between streamed pieces.
    ``mean_accepted_tokens`` is the paper's compression rate CR: tokens emitted per verification pass
    (accepted drafts + the target's own token). ``ctar[w-1]`` is CTAR(w): the share of rounds whose first w drafts
    were all accepted, for w = 1..gamma.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    rounds: list[RoundResult]
    seconds: float
    gamma: int
    stopped_on_eos: bool

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def mean_accepted_tokens(self) -> float:
        return compression_rate(self.rounds) or 0.0

    @property
    def ctar(self) -> list[float]:
        return ctar(self.rounds, self.gamma) if self.rounds else [0.0] * self.gamma

    @property
    def mean_drafted(self) -> float:
        return mean_drafted(self.rounds) or 0.0

    @property
    def draft_seconds(self) -> float:
        return sum(r.draft_seconds for r in self.rounds)

    @property
    def verify_seconds(self) -> float:
        return sum(r.verify_seconds for r in self.rounds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.num_rounds,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "ctar": self.ctar,
            "mean_drafted": self.mean_drafted,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "stopped_on_eos": self.stopped_on_eos,
        }
