"""Prompt-lookup drafting: propose the token that followed the last earlier occurrence of the current n-gram.

When the answer copies from its context (summaries, retrieval-augmented answers, code edits, or a model that repeats
itself), the next tokens are often already in the sequence. Drafting them costs no model at all: the drafter ignores
the layer-l hidden states and only searches ``token_ids``. The target verifies every draft as usual, so the output is
still exactly the target's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, SelfDrafter


def lookup(token_ids: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> int | None:
    """The token that followed the most recent earlier occurrence of the longest matching suffix n-gram.

    Tries n = max_ngram down to min_ngram: the last n tokens are searched for earlier in ``token_ids`` (latest match
    first); the token right after the match is returned. None when no suffix of length >= min_ngram occurs before.

    >>> lookup([1, 2, 3, 9, 1, 2])
    3
    """
    tokens = list(token_ids)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier match that has a next token
            if tokens[start:start + n] == suffix:
                return tokens[start + n]
    return None


class PromptLookupDrafter(SelfDrafter):
    """A :class:`~kangaroo_core.interfaces.SelfDrafter` that drafts by n-gram lookup in the sequence so far.

    Args:
        max_ngram: longest suffix to look up.
        min_ngram: shortest suffix to look up.
        confidence: probability given to the looked-up token (the rest is spread evenly), what the stopping
            policy sees as ``DraftStep.confidence``.
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, confidence: float = 0.99):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
        self.max_ngram, self.min_ngram, self.confidence = max_ngram, min_ngram, confidence
        self.vocab_size = 0
        self._seen = 0

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "PromptLookupDrafter":
        return cls(**options)

    def bind(self, backend: Backend) -> None:
        self.vocab_size = backend.vocab_size

    # Everything it needs is in token_ids; the only state is how many positions it has been fed.
    @property
    def seen(self) -> int:
        return self._seen

    def reset(self) -> None:
        self._seen = 0

    def crop(self, length: int) -> None:
        self._seen = min(self._seen, length)

    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor | None:
        self._seen = len(token_ids)  # hidden held positions seen..len(token_ids)-1
        token = lookup(token_ids, self.max_ngram, self.min_ngram)
        if token is None:
            return None  # nothing to propose: the engine stops drafting for this round
        rest = math.log((1 - self.confidence) / (self.vocab_size - 1))
        logits = torch.full((self.vocab_size,), rest, dtype=torch.float32)
        logits[token] = math.log(self.confidence)
        return logits


@hookimpl
def register_drafters(register):
    register("prompt-lookup", PromptLookupDrafter)
