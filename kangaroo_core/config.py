"""Configuration value objects.

Validators guard only invariants; an invalid value fails at construction with a message naming the field.
"""

from __future__ import annotations

import attrs

from kangaroo_core.errors import KangarooError


class ConfigError(KangarooError, ValueError):
    """A configuration value is out of range. The message names the field."""


def _check(cond: bool, field: str, value, rule: str) -> None:
    if not cond:
        raise ConfigError(f"{field} must be {rule}, got {value!r}")


def _unit_interval(_inst, attribute, value) -> None:
    _check(isinstance(value, (int, float)) and 0.0 <= value <= 1.0, attribute.name, value, "in [0, 1]")


def _positive_int(_inst, attribute, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, attribute.name, value, "an integer >= 1")


def _non_negative_int(_inst, attribute, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, attribute.name, value, "an integer >= 0")


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
    """

    eta: float = attrs.field(default=0.6, validator=_unit_interval)
    gamma: int = attrs.field(default=6, validator=_positive_int)
    exit_layer: int = attrs.field(default=2, validator=_positive_int)
    max_new_tokens: int = attrs.field(default=128, validator=_positive_int)

    def replace(self, **changes) -> "DecodeConfig":
        return attrs.evolve(self, **changes)
