"""ONNX Runtime backend: the split target (shallow.onnx, deep.onnx) and the adapter (adapter.onnx) on InferenceSessions.

The graphs come from :mod:`kangaroo_backends.onnx_export`; without a ``bundle`` option they are exported on first use
into ``cache_dir()/onnx/<fingerprint>-l<exit layer>-<adapter key>`` (once; atomically, so a failed export leaves
nothing behind).

KV cache: each graph takes the past keys/values [1, past, kvh, hd] and returns only the n new positions'. Per layer
the backend keeps one preallocated buffer [1, capacity, kvh, hd] (a torch tensor on the session's device, doubled when
full) and, through IO binding, passes ``buffer[:, :past]`` as the past input and binds ``buffer[:, past:past+n]`` as
the output buffer of the new keys/values: ORT writes the new positions straight into the cache, nothing is copied
between calls, and :meth:`crop` only moves a length pointer (batch 1: a prefix of the seq axis is contiguous).
Inside the graph the attention still concatenates past and new keys (a temporary, as in any concat-KV export).

onnxruntime is imported lazily: the rest of kangaroo works without it, and this backend says how to install it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kangaroo_backends.loading import cache_dir, load_model
from kangaroo_backends.onnx_export import (FORMAT, FORMAT_VERSION, GRAPHS, MANIFEST, adapter_key, export_onnx, graph_io,
                                           import_onnxruntime)
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.errors import OnnxModelError, ProviderError
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def resolve_provider(ort, provider: str) -> str:
    """``auto``: CUDA when onnxruntime-gpu sees a GPU, else CPU; ``cpu`` / ``cuda``: that one or a ProviderError."""
    available = ort.get_available_providers()
    if provider == "auto":
        return PROVIDERS["cuda"] if PROVIDERS["cuda"] in available else PROVIDERS["cpu"]
    if provider not in PROVIDERS:
        raise ConfigError(f"provider must be one of auto, {', '.join(PROVIDERS)}, got {provider!r}")
    name = PROVIDERS[provider]
    if name not in available:
        hint = " (install onnxruntime-gpu: pip install 'kangaroo-decoding[onnx-gpu]', and a CUDA GPU)" if provider == "cuda" else ""
        raise ProviderError(f"onnxruntime provider {name} is not available; available: {', '.join(available)}{hint}")
    return name


def read_manifest(directory: Path, *, fingerprint: str, exit_layer: int, adapter: str | None = None) -> dict:
    """The export's manifest, checked against the loaded model, exit layer and (when given) adapter key."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise OnnxModelError(f"{directory} is not a kangaroo ONNX export (no {MANIFEST}); export one with `kangaroo export-onnx`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OnnxModelError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise OnnxModelError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    if manifest.get("base_model_fingerprint") != fingerprint:
        raise OnnxModelError(
            f"ONNX export {directory} was made for base model {manifest.get('base_model_fingerprint')}, "
            f"not for the loaded model {fingerprint}"
        )
    if manifest.get("exit_layer") != exit_layer:
        raise OnnxModelError(f"ONNX export {directory} is split at exit layer {manifest.get('exit_layer')}, but exit layer {exit_layer} was requested")
    if adapter is not None and manifest.get("adapter") != adapter:
        raise OnnxModelError(f"ONNX export {directory} contains adapter {manifest.get('adapter')}, not the requested adapter {adapter}")
    return manifest


def _file_opset(path: Path, manifest: dict):
    """The default-domain opset stamped in the file (the manifest's when the onnx package is not installed)."""
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    except Exception:
        return manifest.get("opset")


class GraphRunner:
    """One InferenceSession with its KV cache in preallocated buffers, run through IO binding."""

    def __init__(self, session, name: str, num_layers: int, exit_layer: int, manifest: dict, device: torch.device):
        self.session, self.name, self.device = session, name, device
        self.inputs, self.outputs = graph_io(name, num_layers, exit_layer)
        self.layers = (len(self.inputs) - 2) // 2
        self.kv_shape = (manifest["num_key_value_heads"], manifest["head_dim"])
        self.capacity = min(256, manifest["max_position_embeddings"])
        self.device_type = "cuda" if device.type == "cuda" else "cpu"
        self.device_id = device.index or 0
        self.cache = [torch.empty(1, self.capacity, *self.kv_shape, device=device) for _ in range(2 * self.layers)]
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for i, old in enumerate(self.cache):
            new = torch.empty(1, capacity, *self.kv_shape, device=self.device)
            new[:, : self.length] = old[:, : self.length]
            self.cache[i] = new
        self.capacity = capacity

    def _bind(self, binding, name: str, tensor: torch.Tensor, output: bool = False) -> None:
        dtype = np.int64 if tensor.dtype == torch.long else np.float32
        (binding.bind_output if output else binding.bind_input)(
            name, self.device_type, self.device_id, dtype, tuple(tensor.shape), tensor.data_ptr()
        )

    def run(self, first: torch.Tensor, out_shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Feed ``first`` ([1, n] ids or [1, n, d] states) at the next n positions; return the non-KV outputs."""
        n, start = first.shape[1], self.length
        if start + n > self.capacity:
            self._grow(start + n)
        binding = self.session.io_binding()
        self._bind(binding, self.inputs[0], first)
        positions = torch.arange(start, start + n, device=self.device)[None]
        self._bind(binding, "position_ids", positions)
        for i, buffer in enumerate(self.cache):
            self._bind(binding, self.inputs[2 + i], buffer[:, :start])
        results = [torch.empty(shape, device=self.device) for shape in out_shapes]
        outputs = self.outputs[: len(out_shapes)]
        for name, tensor in zip(outputs, results):
            self._bind(binding, name, tensor, output=True)
        for i, buffer in enumerate(self.cache):
            self._bind(binding, self.outputs[len(out_shapes) + i], buffer[:, start:start + n], output=True)
        self.session.run_with_iobinding(binding)
        self.length = start + n
        return results


class OnnxAdapterRunner:
    """The exported adapter + shared head, for :class:`~kangaroo_plugins.kangaroo_drafter.KangarooDrafter`."""

    def __init__(self, runner: GraphRunner, hidden_size: int, vocab_size: int):
        self.runner, self.hidden_size, self.vocab_size = runner, hidden_size, vocab_size

    def reset(self) -> None:
        self.runner.reset()

    def crop(self, length: int) -> None:
        self.runner.crop(length)

    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Layer-l states [n, d] of positions start.. → next-token logits [V] after the last one."""
        if self.runner.length != start:
            raise RuntimeError(f"adapter cache holds {self.runner.length} positions, drafter expected {start}")
        n = hidden.shape[0]
        x = hidden.to(device=self.runner.device, dtype=torch.float32)[None].contiguous()
        logits, _ = self.runner.run(x, [(1, self.vocab_size), (1, n, self.hidden_size)])
        return logits[0]


class OnnxBackend(Backend):
    """The target model on onnxruntime (CPUExecutionProvider, or CUDAExecutionProvider with onnxruntime-gpu).

    Options: ``provider`` (auto | cpu | cuda), ``bundle`` (a directory from ``kangaroo export-onnx``; default: the
    export cache), ``threads`` (intra-op threads per session; default: onnxruntime's choice).
    """

    name = "onnx"

    def __init__(self, model, tokenizer, exit_layer: int, model_name: str = "model", *, provider: str = "auto",
                 bundle: str | Path | None = None, threads: int | None = None, quiet: bool = False):
        from kangaroo_backends.torch_eager import describe_split_model

        self.ort = import_onnxruntime()
        # self.model is kept for exporting and for validating adapters; it never runs per token
        describe_split_model(self, model, tokenizer, exit_layer, model_name)
        self.provider = resolve_provider(self.ort, provider)
        self.device = torch.device("cuda", 0) if self.provider == PROVIDERS["cuda"] else torch.device("cpu")
        self.bundle = Path(bundle).expanduser() if bundle is not None else None
        self.threads = threads
        self.quiet = quiet
        self.adapter_path: str | None = None
        self.loaded: tuple[Path, str] | None = None
        self.manifest: dict | None = None

    @classmethod
    def create(cls, config: DecodeConfig, model: Any = None, dtype: str = "float32", provider: str = "auto",
               bundle: str | None = None, threads: int | None = None, **options: Any) -> "OnnxBackend":
        if options:
            raise ConfigError(f"unknown onnx backend option(s): {', '.join(sorted(options))}")
        if dtype != "float32":
            raise ConfigError(f"the onnx backend runs float32 graphs only, got dtype {dtype!r}")
        import_onnxruntime()  # the install hint before a model load
        loaded, tokenizer, name = load_model(model, dtype=torch.float32)
        return cls(loaded, tokenizer, config.exit_layer, name, provider=provider, bundle=bundle,
                   threads=None if threads is None else int(threads))

    # -- export / sessions -----------------------------------------------------------------------------------------
    def export_dir(self, adapter_path: str | None = None) -> Path:
        if self.bundle is not None:
            return self.bundle
        return cache_dir() / "onnx" / f"{self.fingerprint}-l{self.exit_layer}-{adapter_key(adapter_path)}"

    def _load_adapter(self, adapter_path: str | None):
        from kangaroo_plugins.adapter import KangarooAdapter

        if adapter_path is None:
            return KangarooAdapter.from_base_layer(self.model, self.exit_layer)
        return KangarooAdapter.load(adapter_path, self.model, base_fingerprint=self.fingerprint, exit_layer=self.exit_layer)

    def _session(self, path: Path, manifest: dict):
        ort = self.ort
        if not path.is_file():
            raise OnnxModelError(f"ONNX file {path} is missing; re-export with `kangaroo export-onnx` (or delete {path.parent})")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # Three sessions take turns every few milliseconds: threads spinning after one session's run would steal
        # the cores the next session needs, so idle threads sleep instead of spinning.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        try:
            session = ort.InferenceSession(str(path), options, providers=[self.provider])
        except Exception as exc:  # onnxruntime raises its own exception types
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "opset" in message.lower():
                raise OnnxModelError(
                    f"{path} uses ONNX opset {_file_opset(path, manifest)}, which onnxruntime {ort.__version__} cannot "
                    f"run: upgrade onnxruntime or re-export with `kangaroo export-onnx --opset` (e.g. 17)"
                ) from None
            raise OnnxModelError(f"cannot load {path} (corrupt or not an ONNX file? delete {path.parent} and re-export): {message}") from None
        if self.provider not in session.get_providers():
            raise ProviderError(f"onnxruntime could not use {self.provider} for {path.name} (got {', '.join(session.get_providers())})")
        return session

    def _ensure(self, adapter_path: str | None) -> None:
        key = adapter_key(adapter_path)
        directory = self.export_dir(adapter_path)
        if self.loaded == (directory, key):
            return
        if self.bundle is None and not (directory / MANIFEST).is_file():
            if directory.exists():
                raise OnnxModelError(f"{directory} is an incomplete ONNX export (no {MANIFEST}); delete it to re-export")
            print(f"kangaroo: no ONNX export of {self.model_name} at exit layer {self.exit_layer} yet; exporting "
                  f"once to {directory}", file=sys.stderr)
            export_onnx(self.model, directory, exit_layer=self.exit_layer, adapter=self._load_adapter(adapter_path),
                        adapter_path=adapter_path, fingerprint=self.fingerprint, model_name=self.model_name,
                        quiet=self.quiet)
        manifest = read_manifest(directory, fingerprint=self.fingerprint, exit_layer=self.exit_layer, adapter=key)
        runners = {}
        for name in GRAPHS:
            entry = manifest.get("graphs", {}).get(name)
            if not entry:
                raise OnnxModelError(f"{directory / MANIFEST} lists no {name} graph")
            session = self._session(directory / entry["file"], manifest)
            expected_in, expected_out = graph_io(name, self.num_layers, self.exit_layer)
            got_in = [i.name for i in session.get_inputs()]
            got_out = [o.name for o in session.get_outputs()]
            if got_in != expected_in or got_out != expected_out:
                raise OnnxModelError(f"{directory / entry['file']}: inputs/outputs {got_in} → {got_out} are not those of a {name} graph")
            runners[name] = GraphRunner(session, name, self.num_layers, self.exit_layer, manifest, self.device)
        self.shallow_runner, self.deep_runner, self.adapter_graph = runners["shallow"], runners["deep"], runners["adapter"]
        self.manifest, self.loaded, self.adapter_path = manifest, (directory, key), adapter_path

    def adapter_runner(self, adapter_path: str | None) -> OnnxAdapterRunner:
        """The exported adapter for the Kangaroo drafter (exports the bundle with this adapter if needed)."""
        self._load_adapter(adapter_path)  # same validation (AdapterMismatchError) as the torch backend
        self._ensure(adapter_path)
        return OnnxAdapterRunner(self.adapter_graph, self.hidden_size, self.vocab_size)

    # -- cache -----------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._ensure(self.adapter_path)
        self.shallow_runner.reset()
        self.deep_runner.reset()

    def crop(self, length: int) -> None:
        self.shallow_runner.crop(length)
        self.deep_runner.crop(length)

    def cache_lengths(self) -> tuple[int, int]:
        if self.loaded is None:
            return 0, 0
        return self.shallow_runner.length, self.deep_runner.length

    # -- the split model -------------------------------------------------------------------------------------------
    def shallow(self, token_ids: Sequence[int]) -> torch.Tensor:
        if self.loaded is None:  # the hot path never re-checks the export (reset() does, once per generation)
            self._ensure(self.adapter_path)
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)[None]
        (hidden,) = self.shallow_runner.run(ids, [(1, ids.shape[1], self.hidden_size)])
        return hidden[0]

    def deep(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.loaded is None:
            self._ensure(self.adapter_path)
        x = hidden.to(device=self.device, dtype=torch.float32)[None].contiguous()
        (logits,) = self.deep_runner.run(x, [(1, x.shape[1], self.vocab_size)])
        return logits[0]


@hookimpl
def register_backends(register):
    register("onnx", OnnxBackend)
