"""The bench-method extension point.

A bench method is one way of generating a reply (transformers ``generate``, our engine, a third-party decoder...).
The harness loads the model once into a :class:`BenchContext`, calls :meth:`BenchMethod.prepare` once per method,
then :meth:`BenchMethod.run` for every question turn, timing nothing itself: each method reports its own seconds for
the generation call only (not tokenisation, not setup).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kangaroo_core.interfaces import BenchMethod, Messages, MethodResult

if TYPE_CHECKING:
    from kangaroo_core.assembly import EngineSpec
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_core.interfaces import Backend

__all__ = ["RUN_DEFAULT", "BenchContext", "BenchMethod", "Messages", "MethodResult", "trim"]


class _RunDefault:
    """The sentinel meaning "the bench run's own choice" (so that no real value, not even an adapter directory
    named ``default``, can be mistaken for it)."""

    def __repr__(self) -> str:
        return "RUN_DEFAULT"


RUN_DEFAULT: Any = _RunDefault()


class BenchContext:
    """What every method of one bench run shares: the loaded backend (model loaded once) and the run's engine
    description (:class:`~kangaroo_core.assembly.EngineSpec`: drafter, policy, verifier, adapter, tree, config)."""

    def __init__(self, backend: "Backend", spec: "EngineSpec"):
        self.backend, self.spec = backend, spec
        self.config = spec.config.replace(exit_layer=backend.exit_layer)
        self.tree = spec.tree  # the run's --tree: the shaper of the tree methods (None: theirs, "dynamic")
        self.tree_options = dict(spec.tree_options)  # the run's --tree-budget / --tree-topk / --tree-depth
        self._backends = {backend.exit_layer: backend}
        self._encoder: "Engine | None" = None

    @property
    def model(self) -> Any:
        """The transformers model behind the backend (None for a backend without one)."""
        return self.backend.base_model()

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
        """The backend split at ``exit_layer``, sharing the loaded weights (:meth:`Backend.resplit`)."""
        if exit_layer not in self._backends:
            try:
                self._backends[exit_layer] = self.backend.resplit(exit_layer)
            except NotImplementedError as exc:
                from kangaroo_core.errors import BenchError

                raise BenchError(str(exc)) from None
        return self._backends[exit_layer]

    def shared_backend(self, key: Any, build: "Callable[[], Backend]") -> "Backend":
        """A further backend the run's methods share (e.g. an onnx backend over the loaded model), built once per key."""
        if key not in self._backends:
            self._backends[key] = build()
        return self._backends[key]

    def engine(self, *, drafter: Any = RUN_DEFAULT, config: "DecodeConfig | None" = None,
               adapter: Any = RUN_DEFAULT, exit_layer: int | None = None, policy: Any = None,
               verifier: Any = None, policy_options: dict[str, Any] | None = None,
               backend: "Backend | None" = None, tree: Any = None, tree_options: dict[str, Any] | None = None,
               ) -> "Engine":
        """An engine on the shared backend (or ``backend``), assembled from the run's description with these
        changes. ``drafter=None``: the target alone; every other default (drafter, adapter, policy and its options,
        verifier) comes from the run. ``tree``: a tree shaper name (options: ``tree_options`` over the run's
        ``--tree-*`` flags) for token-tree rounds."""
        from kangaroo_core.engine import assemble

        config = config or self.config
        if exit_layer is not None:
            config = config.replace(exit_layer=exit_layer)
        spec = self.spec
        if policy is not None:  # another policy starts from its own defaults
            spec = spec.replace(policy=policy, policy_options=policy_options)
        elif policy_options is not None:
            spec = spec.replace(policy_options=policy_options)
        spec = spec.replace(config=config, exit_layer=config.exit_layer, verifier=verifier or spec.verifier,
                            drafter=spec.drafter if drafter is RUN_DEFAULT else drafter,
                            adapter=spec.adapter if adapter is RUN_DEFAULT else adapter,
                            tree=tree, tree_options={**self.tree_options, **(tree_options or {})} if tree else None)
        if not isinstance(spec.drafter, str):  # a drafter object (or none) takes no options by name
            spec = spec.replace(drafter_options=None, adapter=None)
        return assemble(spec, backend=backend or self.backend_at(config.exit_layer))


def trim(tokens: Sequence[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut a token list after the first EOS and at ``max_new_tokens``."""
    from kangaroo_core.results import cut_at_eos

    return cut_at_eos(tokens, eos, max_new_tokens)
