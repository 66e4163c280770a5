"""The paper's second early exit: keep drafting while the draft's top-1 probability exceeds eta."""

from __future__ import annotations

from typing import Any

import attrs

from kangaroo_core.config import DecodeConfig, _unit_interval
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep


@attrs.define
class ThresholdPolicy(StoppingPolicy):
    """Stop after the first draft whose confidence is <= eta (that draft is still proposed).

    eta=0 drafts gamma tokens every round (confidence is never <= 0 in practice); eta=1 proposes one draft per round.
    """

    eta: float = attrs.field(default=0.6, validator=_unit_interval)
    name = "threshold"

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "ThresholdPolicy":
        return cls(eta=options.pop("eta", config.eta), **options)

    def keep_drafting(self, step: DraftStep) -> bool:
        return step.confidence > self.eta


@hookimpl
def register_policies(register):
    register("threshold", ThresholdPolicy)
