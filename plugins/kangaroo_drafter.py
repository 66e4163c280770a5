"""The Kangaroo self-drafter: the target's first l layers (shared, run by the backend) + adapter + shared LM head."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.errors import KangarooError
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, SelfDrafter
from kangaroo_plugins.adapter import METADATA_FILE, KangarooAdapter

#: Trained adapters shipped with kangaroo (one directory each); picked by base-model fingerprint and exit layer.
SHIPPED_ADAPTERS = Path(__file__).resolve().parent / "adapters"
UNTRAINED = "untrained"


def shipped_adapter_for(fingerprint: str, exit_layer: int) -> Path | None:
    """The shipped adapter trained for this base model at this exit layer, if there is one."""
    for meta_path in sorted(SHIPPED_ADAPTERS.glob(f"*/{METADATA_FILE}")):
        meta = json.loads(meta_path.read_text())
        if meta.get("base_model_fingerprint") == fingerprint and meta.get("exit_layer") == exit_layer:
            return meta_path.parent
    return None


class KangarooDrafter(SelfDrafter):
    """Drafts with ``lm_head(adapter(h_l))``.

    On a backend with ``adapter_runner(adapter_path)`` (the onnx backend) the adapter and the shared head run as the
    backend's exported adapter graph; the drafting logic is the same.

    Args:
        adapter: an adapter directory (``adapter.safetensors`` + ``adapter.json``); None for the shipped adapter of
            this base model and exit layer when there is one (else an untrained adapter); ``"untrained"`` for an
            adapter initialised from layer l's attention (output stays lossless, acceptance is low).
    """

    name = "kangaroo"

    def __init__(self, adapter: str | None = None):
        self.adapter_path = adapter
        self.adapter: KangarooAdapter | None = None

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "KangarooDrafter":
        return cls(**options)

    def resolve_adapter(self, backend: Backend) -> str | None:
        """The adapter directory to load for ``backend`` (None: an untrained adapter)."""
        if self.adapter_path == UNTRAINED:
            return None
        if self.adapter_path is not None:
            return self.adapter_path
        shipped = shipped_adapter_for(backend.fingerprint, backend.exit_layer)
        return str(shipped) if shipped else None

    def bind(self, backend: Backend) -> None:
        self.resolved_adapter = self.resolve_adapter(backend)
        factory = getattr(backend, "adapter_runner", None)
        if factory is not None:  # e.g. the onnx backend: the adapter + shared head run as one exported graph
            self.adapter, self.head, self.cache = None, None, None
            self.runner = factory(self.resolved_adapter)
            self.seen = 0
            return
        model = getattr(backend, "model", None)
        if model is None or not hasattr(backend, "lm_head"):
            raise KangarooError(f"the kangaroo drafter needs a PyTorch backend or one with adapter_runner(), not '{backend.name}'")
        if self.resolved_adapter is None:
            self.adapter = KangarooAdapter.from_base_layer(model, backend.exit_layer)
        else:
            self.adapter = KangarooAdapter.load(
                self.resolved_adapter, model, base_fingerprint=backend.fingerprint, exit_layer=backend.exit_layer
            )
        self.adapter.eval()
        self.head = self.adapter.drafting_head(backend.lm_head)  # resolved once: shared head or draft-vocab rows
        self.cache = self.adapter.new_cache()
        self.runner = None
        self.seen = 0

    def reset(self) -> None:
        if self.runner is not None:
            self.runner.reset()
        else:
            self.cache.reset()
        self.seen = 0

    @torch.inference_mode()
    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
        if self.runner is not None:
            logits = self.runner.advance(hidden, self.seen)  # [V]
            self.seen += hidden.shape[0]
            return logits
        out = self.adapter(hidden[None], self.seen, self.cache)  # [1, n, d]
        self.seen += hidden.shape[0]
        return self.head(out[0, -1])  # [V]

    def crop(self, length: int) -> None:
        if self.runner is not None:
            self.runner.crop(length)
        else:
            self.cache.crop(length)
        self.seen = min(self.seen, length)


@hookimpl
def register_drafters(register):
    register("kangaroo", KangarooDrafter)
