"""The one way an engine is put together: its whole description (:class:`EngineSpec`) and the pieces built from it.

:func:`kangaroo_core.engine.assemble` turns a spec into an :class:`~kangaroo_core.engine.Engine`; ``Engine.build``,
the command line, the bench, the server and the transformers integration all go through it. Building follows one
order so that each piece is made once and for the layer it will run at:

1. every plugin name and option is checked against the registry (a typo costs no model load);
2. the drafter is built: it knows which exit layer its trained adapter wants for a model;
3. the backend is loaded (or a loaded one reused) and split at that layer, unless the spec names one;
4. the policy, verifier and tree shaper are built for the settled config.
"""

from __future__ import annotations

from typing import Any

import attrs

from kangaroo_core.config import (DEFAULT_DRAFTER, DEFAULT_POLICY, ConfigError, DecodeConfig, SamplingConfig,
                                  not_lossless_under_sampling)
from kangaroo_core.interfaces import Backend, SelfDrafter, StoppingPolicy, TreeShaper, Verifier
from kangaroo_core.plugins import get_registry


def _options(value: Any) -> dict[str, Any]:
    return dict(value or {})


@attrs.frozen(hash=False)
class EngineSpec:
    """Everything that describes an engine: the model, where it runs, and each piece with its options.

    A piece is a registered plugin name (looked up once, when the engine is assembled) or an object used as it is.
    ``drafter=None`` describes the target alone. ``verifier="auto"`` is greedy at temperature 0 and speculative
    sampling otherwise. ``exit_layer=None`` splits at the layer the drafter's adapter was trained at for this model
    (``config.exit_layer`` when it has none); a number forces that layer. ``device`` and ``dtype`` go to the backend
    as options when set (``cpu``, ``cuda``, ``cuda:N``; ``float32``, ``bfloat16``, ``float16``).
    ``adapter`` is the drafter's ``adapter`` option, spelt out because every entry point has it.
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str | Backend = "torch"
    backend_options: dict[str, Any] = attrs.field(factory=dict, converter=_options)
    drafter: str | SelfDrafter | None = DEFAULT_DRAFTER
    drafter_options: dict[str, Any] = attrs.field(factory=dict, converter=_options)
    adapter: str | None = None
    policy: str | StoppingPolicy = DEFAULT_POLICY
    policy_options: dict[str, Any] = attrs.field(factory=dict, converter=_options)
    verifier: str | Verifier = "auto"
    verifier_options: dict[str, Any] = attrs.field(factory=dict, converter=_options)
    tree: str | TreeShaper | None = None
    tree_options: dict[str, Any] = attrs.field(factory=dict, converter=_options)
    exit_layer: int | None = None
    config: DecodeConfig = DecodeConfig()

    def replace(self, **changes: Any) -> "EngineSpec":
        """A copy with ``changes``, e.g. ``spec.replace(policy="fixed")``."""
        return attrs.evolve(self, **changes)

    def target_alone(self) -> "EngineSpec":
        """The same engine without drafting: one token per pass, the reference for losslessness and speed."""
        return self.replace(drafter=None, tree=None)

    def all_backend_options(self) -> dict[str, Any]:
        """What the backend plugin is created with: the model, device and dtype when set, then its own options."""
        fixed = {"model": self.model, "device": self.device, "dtype": self.dtype}
        return {**{k: v for k, v in fixed.items() if k == "model" or v is not None}, **self.backend_options}

    def all_drafter_options(self) -> dict[str, Any]:
        """What the drafter plugin is created with: its own options, then ``adapter`` when set."""
        return {**self.drafter_options, **({"adapter": self.adapter} if self.adapter is not None else {})}

    def describe(self) -> dict[str, Any]:
        """The description as plain data (objects by their registered name), for results files."""
        out = attrs.asdict(self, recurse=False)
        for key in ("backend", "drafter", "policy", "verifier", "tree"):
            if out[key] is not None and not isinstance(out[key], str):
                out[key] = getattr(out[key], "name", "") or type(out[key]).__name__
        out["config"] = attrs.asdict(self.config)
        return out


@attrs.frozen
class Pieces:
    """What :func:`build_pieces` made: the arguments of :class:`~kangaroo_core.engine.Engine`."""

    backend: Backend
    drafter: SelfDrafter | None
    policy: StoppingPolicy
    verifier: Verifier
    config: DecodeConfig
    tree: TreeShaper | None


def verifier_name(spec: EngineSpec, config: DecodeConfig) -> str | Verifier:
    """The verifier the spec asks for under ``config``'s sampling ("auto" settled by the temperature)."""
    if spec.verifier == "auto":
        return "greedy" if config.sampling.greedy else "speculative"
    return spec.verifier


def build_verifier(spec: EngineSpec, config: DecodeConfig) -> Verifier:
    """The spec's verifier for ``config`` (built again when an engine changes its sampling settings)."""
    return _piece("verifier", verifier_name(spec, config), config, spec.verifier_options)


def check_spec(spec: EngineSpec, *, backend_loaded: bool = False) -> None:
    """Every plugin name and option of ``spec`` checked, before any model loads (also where it loads elsewhere)."""
    registry = get_registry()
    named = [("backend", spec.backend, spec.all_backend_options()), ("drafter", spec.drafter, spec.all_drafter_options()),
             ("policy", spec.policy, spec.policy_options), ("tree", spec.tree, spec.tree_options),
             ("verifier", verifier_name(spec, spec.config), spec.verifier_options)]
    for kind, piece, options in named:
        if isinstance(piece, str) and not (kind == "backend" and backend_loaded):
            registry.check_options(kind, piece, options)
    verifier = named[-1][1]
    if isinstance(verifier, str) and not spec.config.sampling.greedy and not registry.resolve("verifier", verifier).samples:
        raise not_lossless_under_sampling(verifier, spec.config.sampling.temperature)


def build_pieces(spec: EngineSpec, backend: Backend | None = None) -> Pieces:
    """Every piece of ``spec``, each built once (``backend``: an already loaded backend to reuse)."""
    check_spec(spec, backend_loaded=backend is not None)
    drafter, backend = _drafter_and_backend(spec, backend)
    config = spec.config.replace(exit_layer=backend.exit_layer)
    return Pieces(backend, drafter, _piece("policy", spec.policy, config, spec.policy_options),
                  build_verifier(spec, config), config, _piece("tree", spec.tree, config, spec.tree_options))


def load_backend(spec: EngineSpec, backend: Backend | None = None) -> Backend:
    """Only the backend of ``spec``, loaded (or ``backend`` reused) and split where the engine would split it: for
    applications that build several engines on one loaded model (the bench) or none at all (exports)."""
    return _drafter_and_backend(spec, backend)[1]


def _drafter_and_backend(spec: EngineSpec, backend: Backend | None):
    """The drafter, then the backend split for it (both made from the config at the layer the spec asks for)."""
    config = spec.config if spec.exit_layer is None else spec.config.replace(exit_layer=spec.exit_layer)
    drafter = _piece("drafter", spec.drafter, config, spec.all_drafter_options())
    if backend is None:
        backend = _piece("backend", spec.backend, config, spec.all_backend_options())
    return drafter, split_for(backend, drafter, spec.exit_layer)


def split_for(backend: Backend, drafter: SelfDrafter | None, exit_layer: int | None) -> Backend:
    """``backend`` split at ``exit_layer``, else at the layer ``drafter`` prefers for this model (weights shared)."""
    layer = exit_layer
    if layer is None and drafter is not None:
        layer = drafter.preferred_exit_layer(backend.fingerprint)
    if layer is None or layer == backend.exit_layer:
        return backend
    try:
        return backend.resplit(layer)
    except NotImplementedError:
        why = "was asked for" if exit_layer is not None else "is where the drafter's adapter was trained"
        raise ConfigError(f"exit layer {layer} {why} and the '{backend.name}' backend (split at "
                          f"{backend.exit_layer}) cannot re-split; load it at layer {layer}") from None


def check_sampling(verifier: Verifier, sampling: SamplingConfig) -> None:
    """A verifier that is not lossless under sampling is refused at temperature > 0."""
    if not sampling.greedy and not verifier.samples:
        raise not_lossless_under_sampling(verifier.name or type(verifier).__name__, sampling.temperature)


def _piece(kind: str, piece: Any, config: DecodeConfig, options: dict[str, Any]) -> Any:
    if isinstance(piece, str):
        return get_registry().create(kind, piece, config, options)
    return piece
