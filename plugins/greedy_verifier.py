"""Greedy verification: the longest prefix of drafts equal to the target's argmax, plus one target token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Verifier
from kangaroo_core.results import DraftStep, Verdict
from kangaroo_core.tree import greedy_tree_walk


def accept_length(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens at the same positions."""
    n = 0
    for drafted, wanted in zip(draft_tokens, target_tokens):
        if drafted != wanted:
            break
        n += 1
    return n


class GreedyVerifier(Verifier):
    """Lossless for greedy decoding: the output is exactly the target's own argmax sequence."""

    name = "greedy"

    def verify(self, drafts: Sequence[DraftStep], target_logits: torch.Tensor) -> Verdict:
        target_tokens = target_logits.argmax(dim=-1).tolist()  # [k+1]
        accepted = accept_length([d.token for d in drafts], target_tokens)
        return Verdict.chain(accepted, target_tokens[accepted])

    def verify_tree(self, tree, target_logits: torch.Tensor) -> Verdict:
        """The longest root path matching the target's argmax after each parent, then the target's token."""
        path, token = greedy_tree_walk(tree, target_logits.argmax(dim=-1).tolist())
        return Verdict([r - 1 for r in path], token)


@hookimpl
def register_verifiers(register):
    register("greedy", GreedyVerifier)
