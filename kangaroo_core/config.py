"""Configuration value objects.

Validators guard only invariants; an invalid value fails at construction with a message naming the field.
"""

from __future__ import annotations

import math

import attrs

from kangaroo_core.errors import KangarooError, PluginError


class ConfigError(KangarooError, ValueError):
    """A configuration value is out of range. The message names the field."""


def unknown_plugin(kind: str, name: str, known: list[str]) -> PluginError:
    return PluginError(f"unknown {kind} '{name}'; known {kind} plugins: {', '.join(known) or 'none'}")


def unknown_options(kind: str, name: str, unknown: list[str], valid: list[str] | None) -> ConfigError:
    names = "unknown" if valid is None else ", ".join(valid) or "none"
    return ConfigError(f"{kind} '{name}': unknown option(s) {', '.join(unknown)}; valid options: {names}")


def not_lossless_under_sampling(verifier: str, temperature: float) -> ConfigError:
    return ConfigError(f"the {verifier} verifier is only lossless at temperature 0, got temperature={temperature}; "
                       "use the speculative verifier (or auto)")


def _check(cond: bool, field: str, value, rule: str) -> None:
    if not cond:
        raise ConfigError(f"{field} must be {rule}, got {value!r}")


def _unit_interval(_inst, attribute, value) -> None:
    _check(isinstance(value, (int, float)) and 0.0 <= value <= 1.0, attribute.name, value, "in [0, 1]")


def _positive_int(_inst, attribute, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, attribute.name, value, "an integer >= 1")


def _non_negative_int(_inst, attribute, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, attribute.name, value, "an integer >= 0")


def _non_negative_float(_inst, attribute, value) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0.0
    _check(ok, attribute.name, value, "a finite number >= 0")


def _top_p(_inst, attribute, value) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0
    _check(ok, attribute.name, value, "in (0, 1]")


def _optional_int(_inst, attribute, value) -> None:
    _check(value is None or (isinstance(value, int) and not isinstance(value, bool)), attribute.name, value,
           "an integer or None")


def _bool(_inst, attribute, value) -> None:
    _check(isinstance(value, bool), attribute.name, value, "True or False")


@attrs.frozen
class SamplingConfig:
    """How tokens are chosen: greedy (temperature 0, the default) or sampled from the target's processed distribution.

    Processing is transformers' ``generate(do_sample=True, temperature=, top_k=, top_p=)``: temperature, then top-k,
    then top-p (see :mod:`kangaroo_core.sampling`).

    Attributes:
        temperature: 0 means greedy (argmax); > 0 divides the logits before top-k / top-p.
        top_k: keep the k most likely tokens; 0 turns top-k off.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1 turns top-p off.
        seed: seeds the per-generation random generator (the same seed reproduces the same output); None: random.
        sample_drafts: draw each draft from the drafter's processed distribution instead of taking its top-1.
            Either way the output follows the target's distribution; only the acceptance rate changes.
    """

    temperature: float = attrs.field(default=0.0, validator=_non_negative_float)
    top_k: int = attrs.field(default=0, validator=_non_negative_int)
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    seed: int | None = attrs.field(default=None, validator=_optional_int)
    sample_drafts: bool = attrs.field(default=False, validator=_bool)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes) -> "SamplingConfig":
        return attrs.evolve(self, **changes)


#: the exit layer when neither the user nor a drafter's trained weights choose one
DEFAULT_EXIT_LAYER = 2

#: the drafter plugin when none is named: prompt lookup where the context's continuation has been accepted, the
#: Kangaroo adapter otherwise (``kangaroo`` is the paper's drafter alone; docs/benchmarks.md has the A/B)
DEFAULT_DRAFTER = "kangaroo-hybrid"
#: the stopping policy engines use unless told otherwise: cost-aware (the paper's fixed eta is ``threshold``)
DEFAULT_POLICY = "cost"


@attrs.frozen
class DecodeConfig:
    """How one generation is decoded.

    Attributes:
        eta: second early exit: drafting continues while the draft's top-1 probability is > eta (paper: 0.6).
            The low-confidence token is still proposed.
        gamma: at most this many draft tokens per round (paper: 6).
        exit_layer: first early exit: the drafter sees the target's hidden states after this many layers
            (paper: l=2 for 7B models). Must be smaller than the model's layer count (checked by the backend).
        max_new_tokens: exactly this many new tokens are produced unless an EOS token comes first.
        sampling: greedy (default) or sampled decoding, see :class:`SamplingConfig`.
    """

    eta: float = attrs.field(default=0.6, validator=_unit_interval)
    gamma: int = attrs.field(default=6, validator=_positive_int)
    exit_layer: int = attrs.field(default=DEFAULT_EXIT_LAYER, validator=_positive_int)
    max_new_tokens: int = attrs.field(default=128, validator=_positive_int)
    sampling: SamplingConfig = attrs.field(default=SamplingConfig(), validator=attrs.validators.instance_of(SamplingConfig))

    def replace(self, **changes) -> "DecodeConfig":
        return attrs.evolve(self, **changes)
