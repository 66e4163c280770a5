"""Learned stopping: a logistic-regression acceptance predictor + an expected-value rule.

After draft i the policy predicts p_i = P(draft i accepted | drafts 1..i-1 accepted) from the draft's features
(:mod:`kangaroo_policies.predictor`) and keeps ``alive`` = p_1 · … · p_i, the probability that every draft so far is
accepted. The next draft's features are not known yet, so its acceptance is estimated from the current draft's
features with the index advanced by one (confidence is strongly autocorrelated along a round). Rule::

    keep drafting after draft i  iff  alive · p_next · value_of_token > draft_cost

``draft_cost`` is the cost of one more draft step in units of one verify pass (M[l:] over the round), and
``value_of_token`` the value of one more accepted token in the same unit (an accepted token saves about one target
pass). Defaults: ``value_of_token=1.0``, ``draft_cost=0.3``: MEASURED for SmolLM2-135M at exit layer 2 on a 2-core
CPU with the torch backend by ``kangaroo analyze-policies`` — a draft step costs 0.11 of a one-position verify and the
extra verified position 0.19 more (``marginal_draft_cost`` 0.30; 0.18 on onnxruntime). Other models, backends and
machines differ: pass the ``marginal_draft_cost`` that command prints, or ``draft_cost=measured`` to have the policy
measure it on the engine's own backend when it first runs (:func:`kangaroo_policies.cost_model.measure_costs`: one
draft step plus one more verified position, in units of a one-position pass; about a second).
"""

from __future__ import annotations

from typing import Any

from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, StoppingPolicy
from kangaroo_core.results import DraftStep
from kangaroo_policies.predictor import AcceptancePredictor, step_features


class LearnedPolicy(StoppingPolicy):
    """Keep drafting while P(next draft accepted and all before it) × value_of_token > draft_cost."""

    name = "learned"

    def __init__(self, predictor: AcceptancePredictor | str | None = None, value_of_token: float = 1.0,
                 draft_cost: float | str = 0.3):
        self.measure_draft_cost = draft_cost == "measured"
        if self.measure_draft_cost:
            draft_cost = 0.3  # replaced by the measurement when the policy first runs
        if not isinstance(draft_cost, (int, float)):
            raise ConfigError(f"learned policy: draft_cost must be a number or 'measured', got {draft_cost!r}")
        if value_of_token <= 0 or draft_cost < 0:
            raise ConfigError(f"learned policy: value_of_token must be > 0 and draft_cost >= 0, got {value_of_token}, {draft_cost}")
        self.predictor_path = predictor if isinstance(predictor, str) else None
        self.predictor = predictor if isinstance(predictor, AcceptancePredictor) else None
        self.value_of_token = float(value_of_token)
        self.draft_cost = float(draft_cost)
        self.alive = 1.0

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "LearnedPolicy":
        options.setdefault("predictor", None)  # None: the predictor shipped with the drafter's adapter
        for key in ("value_of_token", "draft_cost"):
            if key in options and not (key == "draft_cost" and options[key] == "measured"):
                try:
                    options[key] = float(options[key])
                except (TypeError, ValueError):
                    raise ConfigError(f"learned policy: {key} must be a number{' or measured' if key == 'draft_cost' else ''}, "
                                      f"got {options[key]!r}") from None
        return cls(**options)

    def bind(self, backend: Backend) -> None:
        """Load the predictor file for this base model and exit layer (a file made for another one is refused)."""
        if self.predictor_path is not None:
            self.predictor = AcceptancePredictor.load(self.predictor_path, base_fingerprint=backend.fingerprint,
                                                      exit_layer=backend.exit_layer)
            self.predictor_path = None

    def prepare(self, engine: Any, prompt_ids, max_new_tokens: int) -> None:
        """Without a predictor option: load the one shipped with the drafter's adapter (its ``default_predictor``
        directory), once; a drafter without one is refused in one line. With ``draft_cost=measured``, measure it
        once on this backend."""
        if self.measure_draft_cost:
            self.draft_cost = measured_draft_cost(engine.backend, engine.drafter)
            self.measure_draft_cost = False
        if self.predictor is not None:
            return
        directory = getattr(engine.drafter, "default_predictor", None)
        if directory is None:
            raise ConfigError("the learned policy needs a predictor: this drafter's adapter ships none; pass "
                              "--policy-option predictor=DIR (make one with `kangaroo train-policy --out DIR`)")
        backend = engine.backend
        self.predictor = AcceptancePredictor.load(str(directory), base_fingerprint=backend.fingerprint,
                                                  exit_layer=backend.exit_layer)

    def begin_round(self) -> None:
        self.alive = 1.0

    def decide(self, features: list[float]) -> bool:
        """The expected-value rule on one draft's features (index included); updates ``alive``."""
        p_here = self.predictor.predict(features)
        self.alive *= p_here
        p_next = self.predictor.predict(features[:-1] + [features[-1] + 1.0])
        return self.alive * p_next * self.value_of_token > self.draft_cost

    def keep_drafting(self, step: DraftStep) -> bool:
        if step.index == 1:
            self.alive = 1.0
        return self.decide(step_features(step))


@hookimpl
def register_policies(register):
    register("learned", LearnedPolicy)


def measured_draft_cost(backend: Backend, drafter: Any) -> float:
    """(one draft step + one more verified position) / a one-position pass, measured on ``backend`` now."""
    from kangaroo_policies.cost_model import measure_costs

    context = max(1, min(300, backend.max_context // 2))
    curve = measure_costs(backend, drafter, context=context, positions=(1, 2), repeats=7)
    one, two = curve.verify_ms
    return max(0.0, (curve.draft_step_ms + max(0.0, two - one)) / one)
