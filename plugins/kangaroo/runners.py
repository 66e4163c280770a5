"""Where the Kangaroo adapter runs: eager PyTorch, or its exported graph on the onnx backend's onnxruntime.

The drafter picks a runner by :attr:`Backend.runtime <kangaroo_core.interfaces.Backend.runtime>`; both keep their
own KV cache of the adapter's single attention layer and honour the :class:`~kangaroo_core.interfaces.DraftRunner`
contract (explicit ``start``, crop).
"""

from __future__ import annotations

import torch

from kangaroo_backends.torch_eager import check_start
from kangaroo_core.errors import KangarooError, OnnxExportError
from kangaroo_core.interfaces import Backend, DraftRunner
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter, adapter_key


class TorchAdapterRunner(DraftRunner):
    """``head(adapter(h))`` in eager PyTorch; the drafting head (shared or draft-vocabulary rows) is resolved once."""

    def __init__(self, adapter: KangarooAdapter, shared_head: torch.nn.Module):
        self.adapter = adapter.eval()
        self.head = adapter.drafting_head(shared_head)
        self.cache = adapter.new_cache()

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    def reset(self) -> None:
        self.cache.reset()

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    @torch.inference_mode()
    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        check_start("adapter", start, self.length)
        out = self.adapter(hidden[None], start, self.cache)  # [1, n, d]
        return self.head(out[0, -1])  # [V]


class OnnxAdapterRunner(DraftRunner):
    """The exported adapter graph (see :mod:`kangaroo_plugins.kangaroo.onnx_graph`) on the backend's onnxruntime;
    exported once per (base model, exit layer, adapter) into the backend's artefact directory."""

    def __init__(self, backend: Backend, adapter: KangarooAdapter, adapter_path: str | None, *, opset: int,
                 tolerance: float):
        from kangaroo_plugins.kangaroo.onnx_graph import (GRAPH_FILE, INPUTS, MANIFEST, OUTPUTS, export_adapter_graph,
                                                          read_adapter_manifest)

        key = adapter_key(adapter_path)
        directory = backend.artifact_dir() / "kangaroo" / f"l{backend.exit_layer}-{key}"
        if not (directory / MANIFEST).is_file():
            try:
                export_adapter_graph(adapter, backend.shared_head(), directory, fingerprint=backend.fingerprint,
                                     exit_layer=backend.exit_layer, key=key, opset=opset, tolerance=tolerance,
                                     quiet=getattr(backend, "quiet", False))
            except OSError as exc:  # e.g. a read-only bundle exported without this adapter
                raise OnnxExportError(f"cannot export the adapter graph into {directory}: {exc}; export the bundle "
                                      f"with this adapter (`kangaroo export-onnx --adapter DIR`)") from None
        read_adapter_manifest(directory, fingerprint=backend.fingerprint, exit_layer=backend.exit_layer, key=key)
        self.graph = backend.open_graph(directory / GRAPH_FILE, INPUTS, OUTPUTS, kv_layers=1)
        self.hidden_size, self.vocab_size, self.device = backend.hidden_size, backend.vocab_size, backend.device

    @property
    def length(self) -> int:
        return self.graph.length

    def reset(self) -> None:
        self.graph.reset()

    def crop(self, length: int) -> None:
        self.graph.crop(length)

    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        check_start("adapter", start, self.length)
        x = hidden.to(device=self.device, dtype=torch.float32)[None].contiguous()
        logits, _ = self.graph.run(x, [(1, self.vocab_size), (1, x.shape[1], self.hidden_size)])
        return logits[0]


def make_runner(backend: Backend, adapter: KangarooAdapter, adapter_path: str | None, *, opset: int,
                tolerance: float) -> DraftRunner:
    """The runner for ``backend.runtime``; a one-line error for a runtime the drafter cannot run on."""
    if backend.runtime == "torch":
        return TorchAdapterRunner(adapter, backend.shared_head())
    if backend.runtime == "onnxruntime":
        return OnnxAdapterRunner(backend, adapter, adapter_path, opset=opset, tolerance=tolerance)
    raise KangarooError(f"the kangaroo drafter runs on the torch or onnxruntime runtimes, not on the '{backend.name}' "
                        f"backend's runtime '{backend.runtime}'")
