"""The Kangaroo self-drafter: the target's first l layers (shared, run by the backend) + adapter + shared LM head."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.errors import KangarooError
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, SelfDrafter
from kangaroo_plugins.adapter import KangarooAdapter


class KangarooDrafter(SelfDrafter):
    """Drafts with ``lm_head(adapter(h_l))``.

    On a backend with ``adapter_runner(adapter_path)`` (the onnx backend) the adapter and the shared head run as the
    backend's exported adapter graph; the drafting logic is the same.

    Args:
        adapter: an adapter directory (``adapter.safetensors`` + ``adapter.json``), or None for an untrained adapter
            initialised from layer l's attention (output stays lossless, acceptance is low).
    """

    name = "kangaroo"

    def __init__(self, adapter: str | None = None):
        self.adapter_path = adapter
        self.adapter: KangarooAdapter | None = None
        self.trained = adapter is not None

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "KangarooDrafter":
        return cls(**options)

    def bind(self, backend: Backend) -> None:
        factory = getattr(backend, "adapter_runner", None)
        if factory is not None:  # e.g. the onnx backend: the adapter + shared head run as one exported graph
            self.adapter, self.lm_head, self.cache = None, None, None
            self.runner = factory(self.adapter_path)
            self.seen = 0
            return
        model = getattr(backend, "model", None)
        if model is None or not hasattr(backend, "lm_head"):
            raise KangarooError(f"the kangaroo drafter needs a PyTorch backend or one with adapter_runner(), not '{backend.name}'")
        if self.adapter_path is None:
            self.adapter = KangarooAdapter.from_base_layer(model, backend.exit_layer)
        else:
            self.adapter = KangarooAdapter.load(
                self.adapter_path, model, base_fingerprint=backend.fingerprint, exit_layer=backend.exit_layer
            )
        self.adapter.eval()
        self.lm_head = backend.lm_head
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
        return self.adapter.logits(out[0, -1], self.lm_head)  # [V]

    def crop(self, length: int) -> None:
        if self.runner is not None:
            self.runner.crop(length)
        else:
            self.cache.crop(length)
        self.seen = min(self.seen, length)


@hookimpl
def register_drafters(register):
    register("kangaroo", KangarooDrafter)
