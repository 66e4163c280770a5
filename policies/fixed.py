"""The classic baseline: always draft gamma tokens (eta = 0), never stopping early."""

from __future__ import annotations

from typing import Any

from kangaroo_core.config import DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep


class FixedPolicy(StoppingPolicy):
    """Draft gamma tokens every round (the engine still stops at gamma and at the token budget)."""

    name = "fixed"

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "FixedPolicy":
        return cls(**options)

    def keep_drafting(self, step: DraftStep) -> bool:
        return True


@hookimpl
def register_policies(register):
    register("fixed", FixedPolicy)
