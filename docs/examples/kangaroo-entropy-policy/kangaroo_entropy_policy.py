"""An entropy-threshold stopping policy: keep drafting while the drafter is sure of itself.

The built-in ``threshold`` policy looks at the draft's top-1 probability only. Entropy looks at the whole
distribution: a draft whose probability mass is spread over many tokens is likely to be rejected, so stop there.
"""

from __future__ import annotations

from typing import Any

import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy of a probability vector, in nats (0 for a point mass, log V for a uniform distribution)."""
    p = probs.double()
    return float(-(p * torch.log(p.clamp_min(1e-300))).sum())


class EntropyPolicy(StoppingPolicy):
    """Stop after the first draft whose distribution has entropy > ``max_entropy`` nats (that draft is still verified).

    Args:
        max_entropy: threshold in nats; 0 stops after every draft, a large value never stops early.
    """

    name = "entropy"

    def __init__(self, max_entropy: float = 1.0):
        if not max_entropy >= 0:
            raise ValueError(f"max_entropy must be >= 0, got {max_entropy!r}")
        self.max_entropy = float(max_entropy)

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "EntropyPolicy":
        # options come from --policy-option KEY=VALUE or Engine.build(policy_options={...}). create passes them on to
        # __init__, so its parameters are the valid options: a misspelled key is refused in one line naming them,
        # before anything is built. eta/gamma are not used.
        return cls(**options)

    def keep_drafting(self, step: DraftStep) -> bool:
        return entropy(step.probs) <= self.max_entropy


@hookimpl
def register_policies(register):
    register("entropy", EntropyPolicy)
