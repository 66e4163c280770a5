"""The bench-method extension point.

A bench method is one way of generating a reply (transformers ``generate``, our engine, a third-party decoder...).
The harness loads the model once into a :class:`BenchContext`, calls :meth:`BenchMethod.prepare` once per method,
then :meth:`BenchMethod.run` for every question turn, timing nothing itself: each method reports its own seconds for
the generation call only (not tokenisation, not setup).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kangaroo_core.results import RoundResult

if TYPE_CHECKING:
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_core.interfaces import Backend

Messages = Sequence[dict[str, str]]


@attrs.frozen
class MethodResult:
    """One generation by one bench method.

    Attributes:
        token_ids: the new tokens (EOS included when generation stopped on it), at most ``max_new_tokens``.
        seconds: wall time of the generation call (prefill included).
        rounds: per-verification-round statistics when the method has them (our engine), else None.
        target_passes: full-depth forward passes of the target after the prefill, when known without ``rounds``
            (transformers methods); gives the compression rate CR = tokens after the first / passes.
        generated_tokens: tokens the method really produced before truncation to ``max_new_tokens`` / EOS
            (transformers' assisted generation can overshoot); None: ``len(token_ids)``.
    """

    token_ids: list[int]
    seconds: float
    rounds: list[RoundResult] | None = None
    target_passes: int | None = None
    generated_tokens: int | None = None


class BenchContext:
    """What every method of one bench run shares: the loaded backend (model loaded once), the decode config and the
    engine plugin choices (drafter, policy, verifier, adapter)."""

    def __init__(self, backend: "Backend", config: "DecodeConfig", *, drafter: str = "kangaroo",
                 policy: str = "threshold", verifier: str = "auto", adapter: str | None = None,
                 policy_options: dict[str, Any] | None = None):
        self.backend, self.config = backend, config
        self.drafter, self.policy, self.verifier, self.adapter = drafter, policy, verifier, adapter
        self.policy_options = dict(policy_options or {})
        self._backends = {backend.exit_layer: backend}
        self._encoder: "Engine | None" = None

    @property
    def model(self) -> Any:
        """The transformers model behind the backend (None for a backend without one)."""
        return getattr(self.backend, "model", None)

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.backend.eos_token_ids

    def encode(self, messages: Messages) -> list[int]:
        """Prompt token ids of a conversation (chat template, generation prompt added), exactly as the engine does."""
        if self._encoder is None:
            self._encoder = self.engine(drafter=None)
        return self._encoder.encode(list(messages))

    def backend_at(self, exit_layer: int) -> "Backend":
        """The backend split at ``exit_layer``, sharing the loaded weights (the torch backend re-splits in place)."""
        if exit_layer not in self._backends:
            base = self.backend
            model = getattr(base, "model", None)
            if model is None:
                from kangaroo_core.errors import BenchError

                raise BenchError(f"the '{base.name}' backend cannot be re-split at exit layer {exit_layer}")
            self._backends[exit_layer] = type(base)(model, base.tokenizer, exit_layer, base.model_name)
        return self._backends[exit_layer]

    def engine(self, *, drafter: str | None | object = "default", config: "DecodeConfig | None" = None,
               adapter: str | None | object = "default", exit_layer: int | None = None, policy: Any = None,
               verifier: Any = None, policy_options: dict[str, Any] | None = None,
               backend: "Backend | None" = None) -> "Engine":
        """An engine on the shared backend (or ``backend``). ``drafter=None``: the target alone; every other default
        (drafter, adapter, policy and its options, verifier) comes from the context."""
        from kangaroo_core.engine import Engine

        config = config or self.config
        if exit_layer is not None:
            config = config.replace(exit_layer=exit_layer)
        drafter = self.drafter if drafter == "default" else drafter
        adapter = self.adapter if adapter == "default" else adapter
        if policy is None:  # the run's policy with the run's options; another policy starts from its defaults
            policy, policy_options = self.policy, self.policy_options if policy_options is None else policy_options
        return Engine.build(config=config, backend=backend or self.backend_at(config.exit_layer), drafter=drafter,
                            policy=policy, verifier=verifier or self.verifier, adapter=adapter,
                            policy_options=policy_options or None)


class BenchMethod(abc.ABC):
    """A way of generating a reply, measured by ``kangaroo bench``.

    Lifecycle: ``create(config, **options)`` → ``prepare(context)`` once (build engines, check the model; raise to
    report the method as failed) → ``run(messages, max_new_tokens)`` per question turn.
    """

    #: Registered name, e.g. ``"hf_vanilla"``.
    name: str = ""

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "BenchMethod":
        return cls(**options)

    @abc.abstractmethod
    def prepare(self, context: BenchContext) -> None:
        """Set up on the shared model (called once, before the warm-up)."""

    @abc.abstractmethod
    def run(self, messages: Messages, max_new_tokens: int) -> MethodResult:
        """Reply to a conversation (a list of ``{"role", "content"}`` ending with a user turn)."""


def trim(tokens: Sequence[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut a token list after the first EOS and at ``max_new_tokens``."""
    out: list[int] = []
    for token in tokens[:max_new_tokens]:
        out.append(int(token))
        if token in eos:
            break
    return out
