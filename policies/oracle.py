"""ANALYSIS UPPER BOUND, not a decoding method: a policy that knows the target's own continuation.

The oracle compares each draft with the target's greedy continuation (a reference sequence: prompt + the target's
output alone) and stops at the first draft that does not match it. It therefore never drafts past a rejection, and
keeps drafting (up to gamma / the token budget) while the drafts are right. Under this API the policy is asked after
it has seen a draft and the engine always verifies the draft that made it stop, so a round that ends in a mismatch
carries exactly one rejected draft: that one draft step is the only waste, and no policy that decides after each draft
can do better. Real policies cannot know the continuation; use the oracle only to measure how far they are from the
best possible stopping decisions (CR and speedup upper bound), never to claim a speedup.

The reference is either given (option ``reference=``: token ids of prompt + continuation) or computed once per
generation by :meth:`OraclePolicy.prepare`, which runs the target alone on the prompt (not timed by the engine).
Greedy decoding only (temperature 0): under sampling there is no single continuation to compare with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep


class OraclePolicy(StoppingPolicy):
    """ANALYSIS UPPER BOUND: stop at the first draft that differs from the target's own greedy continuation."""

    name = "oracle"

    def __init__(self, reference: Sequence[int] | None = None):
        self.fixed_reference = None if reference is None else [int(t) for t in reference]
        self.reference: list[int] = list(self.fixed_reference or [])
        self.position = 0  # where the round's first draft goes
        self.matched = True

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "OraclePolicy":
        if not config.sampling.greedy:
            raise ConfigError("the oracle policy needs greedy decoding (temperature 0): it compares drafts with the "
                              "target's greedy continuation")
        return cls(**options)

    def prepare(self, engine: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Compute the reference (the target alone, greedy) unless one was given that starts with this prompt."""
        prompt = [int(t) for t in prompt_ids]
        if self.fixed_reference is not None and self.fixed_reference[: len(prompt)] == prompt:
            self.reference = self.fixed_reference
            return
        from kangaroo_core.engine import Engine
        from kangaroo_policies.fixed import FixedPolicy

        alone = Engine(engine.backend, None, FixedPolicy(), engine.verifier, engine.config)
        self.reference = prompt + alone.generate_ids(prompt, max_new_tokens).token_ids

    def start_round(self, tokens: Sequence[int]) -> None:
        self.position = len(tokens)

    def is_correct(self, step: DraftStep) -> bool:
        """Whether draft ``step`` equals the reference token at its position (it follows ``step.index - 1`` drafts)."""
        at = self.position + step.index - 1
        return at < len(self.reference) and self.reference[at] == step.token

    def keep_drafting(self, step: DraftStep) -> bool:
        return self.is_correct(step)


@hookimpl
def register_policies(register):
    register("oracle", OraclePolicy)
