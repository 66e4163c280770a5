"""Adaptive threshold: eta is chosen once per round from the first draft's confidence (seed follow-up 4).

Rule (every parameter is a policy option)::

    c1 = confidence of the round's first draft
    eta_round = eta_confident   if c1 >= pivot      (a confident start: the context is "easy", draft deeper)
                eta_unsure      otherwise           (a hesitant start: stop at the first doubtful draft)
    keep drafting after draft i  iff  confidence_i > eta_round      (draft 1 included)

Defaults: pivot=0.8, eta_confident=0.4, eta_unsure=0.7. With eta_confident == eta_unsure == eta it is exactly the
``threshold`` policy. The defaults are a heuristic, not tuned on data (see docs/policies.md).
"""

from __future__ import annotations

from typing import Any

import attrs

from kangaroo_core.config import DecodeConfig, _unit_interval
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep


@attrs.define
class AdaptivePolicy(StoppingPolicy):
    """Per-round eta from the first draft's confidence: ``eta_confident`` if it is >= ``pivot``, else ``eta_unsure``."""

    pivot: float = attrs.field(default=0.8, validator=_unit_interval)
    eta_confident: float = attrs.field(default=0.4, validator=_unit_interval)
    eta_unsure: float = attrs.field(default=0.7, validator=_unit_interval)
    eta_round: float | None = attrs.field(default=None, init=False)
    name = "adaptive"

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "AdaptivePolicy":
        return cls(**{k: float(v) for k, v in options.items()})

    def choose_eta(self, first_confidence: float) -> float:
        """The round's eta, from the first draft's top-1 probability."""
        return self.eta_confident if first_confidence >= self.pivot else self.eta_unsure

    def begin_round(self) -> None:
        self.eta_round = None

    def keep_drafting(self, step: DraftStep) -> bool:
        if step.index == 1 or self.eta_round is None:
            self.eta_round = self.choose_eta(step.confidence)
        return step.confidence > self.eta_round


@hookimpl
def register_policies(register):
    register("adaptive", AdaptivePolicy)
