"""The hybrid drafter: the context's n-gram continuation where one exists and has been accepted often enough, the
Kangaroo adapter's draft otherwise.

Drafts copied from the context cost nothing and are often right where the answer quotes its prompt (RAG,
summarisation, code, multi-turn); the adapter covers everything else. The choice is made per position from measured
acceptance: the drafter asks for the target's deep states (:meth:`~kangaroo_core.interfaces.SelfDrafter.observe_deep`),
which the engine hands over for exactly the accepted positions after every round, so it knows how far the target's
tokens are known; the next round's committed tokens say which of its lookup proposals the target agreed with. Per
n-gram length it keeps an acceptance estimate ``(accepted + 2 prior) / (verified + 2)`` for lookup drafts; a lookup
draft is proposed when that estimate beats the adapter's top-1 probability (or when both agree), and the policy sees
the estimate as the draft's confidence.

In token-tree rounds every node gets the same choice for its own drafted path (the lookup continuation of the
committed tokens plus the path), so a copied continuation becomes a branch next to the adapter's top-k; only the
root's lookup is scored (sibling nodes share positions).

Lossless like every drafter: the target verifies every draft. Under sampled drafting the proposal is the returned
distribution (mass ``c`` on the lookup token, the adapter's distribution scaled to ``1 - c`` elsewhere), which is
what the engine draws from and hands to the speculative verifier.
"""

from __future__ import annotations

import copy

import math
from collections.abc import Sequence
from typing import Any

import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.interfaces import Backend, SelfDrafter
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter


def lookup(token_ids: Sequence[int], max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """(next token, n) after the most recent earlier occurrence of the longest suffix n-gram (n >= min_ngram)."""
    tokens = list(token_ids)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n], n
    return None


class NgramIndex:
    """Where each n-gram (n = min_n..max_n) of a sequence occurred, kept in step with the drafter's sequence as it
    grows and is rolled back, so a lookup costs O(max_n) instead of a scan of the whole sequence per draft step.

    ``positions[ngram]`` lists, ascending, the starts of the occurrences whose next token is known.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}

    def sync(self, token_ids: Sequence[int]) -> None:
        """Make the index describe ``token_ids`` (drop what was rolled back, add what is new)."""
        common = 0
        limit = min(len(self.tokens), len(token_ids))
        while common < limit and self.tokens[common] == token_ids[common]:
            common += 1
        for i in range(len(self.tokens) - 1, common - 1, -1):  # undo, latest first: entries are appended in order
            for n in range(self.min_n, self.max_n + 1):
                if i - n >= 0:
                    key = tuple(self.tokens[i - n:i])
                    starts = self.positions[key]
                    starts.pop()
                    if not starts:
                        del self.positions[key]
        del self.tokens[common:]
        for i in range(common, len(token_ids)):
            for n in range(self.min_n, self.max_n + 1):
                if i - n >= 0:  # the n-gram ending just before token i is now followed by a known token
                    self.positions.setdefault(tuple(self.tokens[i - n:i]), []).append(i - n)
            self.tokens.append(int(token_ids[i]))

    def lookup(self, extra: Sequence[int] = ()) -> tuple[int, int] | None:
        """(next token, n) after the latest earlier occurrence of the longest suffix n-gram, as :func:`lookup`.

        ``extra``: tokens appended to the indexed sequence for this lookup only (a tree node's drafted path); the
        occurrences searched are those of the indexed sequence."""
        tail = self.tokens[-self.max_n:] + list(extra)[-self.max_n:]
        for n in range(min(self.max_n, len(self.tokens) + len(extra) - 1), self.min_n - 1, -1):
            starts = self.positions.get(tuple(tail[-n:]))
            if starts:
                return self.tokens[starts[-1] + n], n
        return None


class HybridDrafter(SelfDrafter):
    """Prompt lookup + the Kangaroo adapter, chosen per position by measured acceptance.

    Args:
        adapter: as for the ``kangaroo`` drafter (None: the shipped adapter for this model and exit layer).
        max_ngram / min_ngram: the suffix lengths looked up (longest first).
        prior: the acceptance estimate of a lookup draft before any has been verified.
        carry_over: keep the acceptance counts from one generation to the next (a server learning its traffic).
            Off by default, so that a generation depends only on its own prompt (and seed).
        onnx_opset / onnx_tolerance: passed to the adapter's drafter (its graph on an onnxruntime backend).
        merge_steps: passed to the adapter's drafter (a batch's draft steps as one pass, or one by one).

    The counts are measured under greedy drafting only: under sampled drafting the token drawn from the returned
    distribution need not be the lookup token, and the drafter cannot tell, so the estimates stay at ``prior``.
    """

    name = "kangaroo-hybrid"
    wants_deep_states = True

    def __init__(self, adapter: str | None = None, max_ngram: int = 4, min_ngram: int = 2, prior: float = 0.5,
                 carry_over: bool = False, measure: bool = True, onnx_opset: int | None = None,
                 onnx_tolerance: float | None = None, merge_steps: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0 < prior < 1:
            raise ValueError(f"prior must be in (0, 1), got {prior!r}")
        onnx = {k: v for k, v in (("onnx_opset", onnx_opset), ("onnx_tolerance", onnx_tolerance)) if v is not None}
        self.adapter = KangarooDrafter(adapter=adapter, merge_steps=merge_steps, **onnx)
        self.max_ngram, self.min_ngram, self.prior = max_ngram, min_ngram, prior
        self.carry_over, self.measure = bool(carry_over), bool(measure)
        # per n-gram length: [accepted, verified] of lookup drafts
        self.counts = {n: [0, 0] for n in range(min_ngram, max_ngram + 1)}
        self.pending: dict[int, tuple[int, int]] = {}  # position -> (token, n) of lookup drafts not yet verified
        self.verified: tuple[int, int] | None = None  # (start, end) of the last round's accepted positions
        self.index = NgramIndex(min_ngram, max_ngram)
        self.sources = {"lookup": 0, "adapter": 0}

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "HybridDrafter":
        sampled = config.sampling.sample_drafts and not config.sampling.greedy
        return cls(**{"measure": not sampled, **options})

    def preferred_exit_layer(self, fingerprint: str) -> int | None:
        return self.adapter.preferred_exit_layer(fingerprint)

    def bind(self, backend: Backend) -> None:
        self.adapter.bind(backend)
        self.resolved_adapter = self.adapter.resolved_adapter

    def fork(self, backend: Backend) -> "HybridDrafter":
        clone = copy.copy(self)
        clone.adapter = self.adapter.fork(backend)
        clone.counts = {n: list(c) for n, c in self.counts.items()}
        clone.pending, clone.verified, clone.sources = {}, None, dict(self.sources)
        clone.index = NgramIndex(self.min_ngram, self.max_ngram)
        return clone

    @property
    def default_predictor(self):
        return self.adapter.default_predictor

    @property
    def seen(self) -> int:
        return self.adapter.seen

    def reset(self) -> None:
        self.adapter.reset()
        self.pending.clear()
        self.verified = None
        self.index = NgramIndex(self.min_ngram, self.max_ngram)
        if not self.carry_over:
            self.counts = {n: [0, 0] for n in self.counts}

    def crop(self, length: int) -> None:
        self.adapter.crop(length)

    def estimate(self, n: int) -> float:
        accepted, verified = self.counts[n]
        return (accepted + 2 * self.prior) / (verified + 2)

    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
        logits = self.adapter.advance(token_ids, hidden)  # the adapter sees every position, whichever source wins
        return self._choose(token_ids, logits)

    def advance_many(self, calls) -> list[torch.Tensor]:
        """Several forks' steps: their adapters' steps as one (see :meth:`KangarooDrafter.advance_many`), then each
        fork's own lookup."""
        logits = self.adapter.advance_many([(d.adapter, ids, hidden) for d, ids, hidden in calls])
        return [d._choose(ids, row) for (d, ids, _), row in zip(calls, logits)]

    def _choose(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """The adapter's logits, or the lookup continuation where its measured acceptance beats them."""
        self._settle(token_ids)
        self.index.sync(token_ids)
        found = self.index.lookup()
        row, used = self._propose(logits, found)
        if used and self.measure:
            self.pending[len(token_ids)] = found
        return row

    def _propose(self, logits: torch.Tensor, found: tuple[int, int] | None) -> tuple[torch.Tensor, bool]:
        """The adapter's logits [V], or — when the lookup token's estimate beats the adapter's top-1 probability, or
        both agree — a distribution with mass ``c`` on the lookup token and the adapter's scaled to ``1 - c`` on the
        rest (under greedy drafting its argmax is the lookup token). Returns (logits, lookup used)."""
        if found is None:
            self.sources["adapter"] += 1
            return logits, False
        token, n = found
        best, top = logits.max(dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        confidence = float(torch.exp(best - lse))  # the adapter's top-1 probability
        c = self.estimate(n)
        if int(top) != token and c <= confidence:
            self.sources["adapter"] += 1
            return logits, False  # the common case stays as cheap as the plain drafter
        self.sources["lookup"] += 1
        c = max(c, confidence) if int(top) == token else c
        return self._mix(logits, lse, token, c), True

    @staticmethod
    def _mix(logits: torch.Tensor, lse: torch.Tensor, token: int, c: float) -> torch.Tensor:
        """Logits whose softmax puts mass ``c`` on ``token`` and the adapter's distribution scaled to ``1 - c`` on the
        rest. Only the lookup token's logit moves: the others keep their ratios, so it is set to
        ``log Σ_{i≠token} e^{l_i} + log(c / (1 - c))`` — one float32 copy of the row instead of a float64 softmax over
        the vocabulary on every lookup step (measured: 2 % of a 1-thread onnx generation). ``lse``: logsumexp of
        ``logits``."""
        rest = 1.0 - float(torch.exp(logits[token] - lse))  # the adapter's mass off the lookup token
        if rest < 1e-6 or c >= 1.0:  # float32 cannot resolve the rest: mix in float64 over the vocabulary
            others = torch.softmax(logits.double(), dim=-1)
            others[token] = 0.0
            mass = float(others.sum())
            mixed = others * ((1 - c) / mass) if mass > 0 else torch.full_like(others, (1 - c) / (len(others) - 1))
            mixed[token] = c
            return torch.log(mixed).to(logits.dtype)
        mixed = logits.clone()
        mixed[token] = float(lse) + math.log(rest) + math.log(c / (1 - c))
        return mixed

    def observe_deep(self, start: int, hidden: torch.Tensor) -> None:
        """Positions ``start..start+m`` were accepted (x_n and m drafts), so the target's token at every position up
        to ``start+m+1`` is now known: the pending lookup drafts there are scored at the next :meth:`advance`, against
        the tokens committed (the rest were proposed after a rejection, off the target's path: no evidence)."""
        if self.adapter.wants_deep_states:  # a deep-context adapter reads them too
            self.adapter.observe_deep(start, hidden)
        self.verified = (start, start + hidden.shape[0])

    def _settle(self, token_ids: Sequence[int]) -> None:
        """Score the pending lookup drafts of the last round: one at position p was verified when the round's
        accepted positions reach p - 1, and accepted when the committed token at p is the lookup token. In a chain
        round that is "p before the first rejection"; in a tree round (where only the root's lookup is pending) the
        accepted path may have taken another child, which the token comparison sees."""
        if self.verified is not None:
            start, end = self.verified  # end: the first position not accepted; its token is the target's own
            for position, (token, n) in self.pending.items():
                if start < position <= end and position < len(token_ids):
                    self.counts[n][1] += 1
                    self.counts[n][0] += int(token_ids[position] == token)
            self.verified = None
            self.pending.clear()  # within a round (verified is None) the round's own drafts stay pending

    # -- token trees: every node's drafted path gets its own lookup, as a branch next to the adapter's top-k --------
    @property
    def drafts_trees(self) -> bool:
        return self.adapter.drafts_trees

    def advance_tree(self, token_ids: Sequence[int], paths, hidden: torch.Tensor, start: int, tree) -> torch.Tensor:
        logits = self.adapter.advance_tree(token_ids, paths, hidden, start, tree)  # [m, V]
        # the index holds the committed sequence (synced at the round's root); a node's suffix ends in its path
        return torch.stack([self._propose(logits[i], self.index.lookup(path))[0] for i, path in enumerate(paths)])

    def keep(self, positions: Sequence[int]) -> None:
        self.adapter.keep(positions)
