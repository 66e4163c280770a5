"""The Kangaroo self-drafter: the target's first l layers (shared, run by the backend) + adapter + shared LM head."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from kangaroo_backends.onnx_toolkit import DEFAULT_OPSET, DEFAULT_TOLERANCE
from kangaroo_core.errors import KangarooError
from kangaroo_core.interfaces import Backend, DraftRunner, SelfDrafter
from kangaroo_plugins.kangaroo.adapter import METADATA_FILE, KangarooAdapter
from kangaroo_plugins.kangaroo.networks import load_adapter
from kangaroo_plugins.kangaroo.runners import make_runner

#: Trained adapters shipped with kangaroo (one directory each); picked by base-model fingerprint and exit layer.
SHIPPED_ADAPTERS = Path(__file__).resolve().parent / "adapters"
UNTRAINED = "untrained"


def shipped_adapter_for(fingerprint: str, exit_layer: int) -> Path | None:
    """The shipped adapter trained for this base model at this exit layer, if there is one: the one marked
    ``"default": true`` in its ``adapter.json`` when several fit (the others are picked by name, see
    :func:`shipped_adapter_named`)."""
    fitting = []
    for meta_path in sorted(SHIPPED_ADAPTERS.glob(f"*/{METADATA_FILE}")):
        meta = json.loads(meta_path.read_text())
        if meta.get("base_model_fingerprint") == fingerprint and meta.get("exit_layer") == exit_layer:
            fitting.append((not meta.get("default", False), meta_path.parent))
    return min(fitting)[1] if fitting else None


def shipped_default_adapter(fingerprint: str) -> Path | None:
    """The shipped adapter for this base model at any exit layer: the one marked ``"default": true``, else the
    first by name."""
    fitting = []
    for meta_path in sorted(SHIPPED_ADAPTERS.glob(f"*/{METADATA_FILE}")):
        meta = json.loads(meta_path.read_text())
        if meta.get("base_model_fingerprint") == fingerprint:
            fitting.append((not meta.get("default", False), meta_path.parent))
    return min(fitting)[1] if fitting else None


def adapter_exit_layer(directory: str | Path, fingerprint: str | None = None) -> int | None:
    """The exit layer an adapter directory was trained at (None when it has no readable ``adapter.json``, or, given
    a ``fingerprint``, when it was made for another base model: loading it then says so in one line)."""
    try:
        meta = json.loads((Path(directory) / METADATA_FILE).read_text())
        layer = meta.get("exit_layer")
    except (OSError, ValueError, AttributeError):
        return None
    if fingerprint is not None and meta.get("base_model_fingerprint") != fingerprint:
        return None
    return layer if isinstance(layer, int) else None


def shipped_adapter_named(name: str) -> Path | None:
    """A shipped adapter by directory name (e.g. ``smollm2-135m-instruct-l2-paper``), if there is one."""
    candidate = SHIPPED_ADAPTERS / name
    return candidate if "/" not in name and (candidate / METADATA_FILE).is_file() else None


class KangarooDrafter(SelfDrafter):
    """Drafts with ``head(adapter(h_l))``, on whichever runtime the backend uses (see
    :mod:`kangaroo_plugins.kangaroo.runners`): the drafting logic is the same on torch and onnxruntime.

    Args:
        onnx_opset / onnx_tolerance: how its adapter graph is exported and validated on an onnxruntime backend.
        adapter: an adapter directory (``adapter.safetensors`` + ``adapter.json``) or the name of a shipped one;
            None for the default shipped adapter of this base model and exit layer when there is one (else an
            untrained adapter); ``"untrained"`` for an adapter initialised from layer l's attention (output stays
            lossless, acceptance is low).
        merge_steps: in a batch, run the drafting streams' steps as one pass where the runner can (default); False
            takes them one by one (the same logits: for comparing the two).
    """

    name = "kangaroo"

    def __init__(self, adapter: str | None = None, onnx_opset: int = DEFAULT_OPSET,
                 onnx_tolerance: float = DEFAULT_TOLERANCE, merge_steps: bool = True):
        self.adapter_path = adapter
        self.merge_steps = bool(merge_steps)
        self.onnx_export = {"opset": int(onnx_opset), "tolerance": float(onnx_tolerance)}  # its graph, on onnxruntime
        self.runner: DraftRunner | None = None

    def resolve_adapter(self, backend: Backend) -> str | None:
        """The adapter directory to load for ``backend`` (None: an untrained adapter)."""
        if self.adapter_path == UNTRAINED:
            return None
        if self.adapter_path is not None:
            shipped = shipped_adapter_named(self.adapter_path) if not Path(self.adapter_path).exists() else None
            return str(shipped) if shipped else self.adapter_path
        shipped = shipped_adapter_for(backend.fingerprint, backend.exit_layer)
        if shipped is None and (elsewhere := shipped_default_adapter(backend.fingerprint)) is not None:
            warnings.warn(f"kangaroo: the adapter shipped for this model ({elsewhere.name}) was trained at exit layer "
                          f"{adapter_exit_layer(elsewhere)}, not {backend.exit_layer}: drafting with an untrained "
                          f"adapter (lossless, slow); split at exit layer {adapter_exit_layer(elsewhere)} to use it",
                          stacklevel=2)
        return str(shipped) if shipped else None

    def preferred_exit_layer(self, fingerprint: str) -> int | None:
        """The exit layer of the adapter it will load: the given one's, else the default shipped one's for this
        base model (so ``--model gemma3-270m`` runs at the layer its shipped adapter was trained at)."""
        if self.adapter_path == UNTRAINED:
            return None
        if self.adapter_path is not None:
            path = Path(self.adapter_path)
            shipped = shipped_adapter_named(self.adapter_path) if not path.exists() else None
            return adapter_exit_layer(shipped or path, fingerprint)
        shipped = shipped_default_adapter(fingerprint)
        return adapter_exit_layer(shipped) if shipped else None

    def bind(self, backend: Backend) -> None:
        model = backend.base_model()
        if model is None or backend.shared_head() is None:
            raise KangarooError(f"the kangaroo drafter builds its adapter from the target's weights; the "
                                f"'{backend.name}' backend exposes no base model")
        self.resolved_adapter = self.resolve_adapter(backend)
        if self.resolved_adapter is None:
            adapter = KangarooAdapter.from_base_layer(model, backend.exit_layer)
        else:
            adapter = load_adapter(self.resolved_adapter, model, base_fingerprint=backend.fingerprint,
                                   exit_layer=backend.exit_layer)
        self.adapter = adapter.eval()
        self.runner = make_runner(backend, self.adapter, self.resolved_adapter, **self.onnx_export)
        # a deep-context adapter asks the engine for the target's deep states of the accepted positions
        self.wants_deep_states = adapter.reads_deep_states

    def fork(self, backend: Backend) -> "KangarooDrafter":
        clone = copy.copy(self)
        clone.runner = self.runner.fork()
        return clone

    @property
    def default_predictor(self) -> Path | None:
        """The ``learned`` policy's acceptance predictor made for this adapter (``<adapter>/predictor/``), if the
        adapter ships one."""
        if getattr(self, "resolved_adapter", None) is None:
            return None
        directory = Path(self.resolved_adapter) / "predictor"
        return directory if directory.is_dir() else None

    @property
    def seen(self) -> int:
        return self.runner.length if self.runner is not None else 0

    def reset(self) -> None:
        self.runner.reset()

    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
        # hidden holds positions start..len(token_ids)-1; the runner refuses a start that is not its cache length
        return self.runner.advance(hidden, len(token_ids) - hidden.shape[0])  # [V]

    def advance_many(self, calls) -> list[torch.Tensor]:
        """Several forks' draft steps: their runner's merged pass where it has one (torch, deep-context adapter)."""
        if not (self.merge_steps and hasattr(self.runner, "advance_many")):
            return super().advance_many(calls)
        return self.runner.advance_many([(d.runner, hidden, len(ids) - hidden.shape[0]) for d, ids, hidden in calls])

    def crop(self, length: int) -> None:
        self.runner.crop(length)

    def observe_deep(self, start: int, hidden: torch.Tensor) -> None:
        self.runner.observe_deep(start, hidden)

    # -- token trees (every runner takes a tree mask: eager PyTorch and the exported graphs) -----------------------
    @property
    def drafts_trees(self) -> bool:
        return self.runner is not None and type(self.runner).advance_tree is not DraftRunner.advance_tree

    def advance_tree(self, token_ids: Sequence[int], paths, hidden: torch.Tensor, start: int, tree) -> torch.Tensor:
        return self.runner.advance_tree(hidden, start, tree)  # [m, V]

    def keep(self, positions: Sequence[int]) -> None:
        self.runner.keep(positions)
