"""ONNX Runtime backend: the split target (shallow.onnx, deep.onnx, head.onnx) on InferenceSessions.

The graphs come from :mod:`kangaroo_backends.onnx_export` (the bundle's format: :mod:`kangaroo_backends.onnx_bundle`);
without a ``bundle`` option they are exported on first use into
``cache_dir()/onnx/v<format>.<graph revision>/<fingerprint>-l<exit layer>`` (once; atomically, so a failed export
leaves nothing behind). Drafters that run their own network here export it themselves into
:meth:`OnnxBackend.artifact_dir` and run it with :meth:`OnnxBackend.open_graph` (same provider, threads and in-place KV
buffers as the backend's graphs).

KV cache: each graph takes the past keys/values [1, past, kvh, hd] and returns only the n new positions'. Per layer
the backend keeps one preallocated buffer [1, capacity, kvh, hd] (a torch tensor on the session's device, doubled when
full) and, through IO binding, passes ``buffer[:, :past]`` as the past input and binds ``buffer[:, past:past+n]`` as
the output buffer of the new keys/values: ORT writes the new positions straight into the cache, nothing is copied
between calls, and :meth:`crop` only moves a length pointer (batch 1: a prefix of the seq axis is contiguous).
Inside the graph the attention still concatenates past and new keys (a temporary, as in any concat-KV export).

Masks are inputs: the runner feeds each graph's ``attention_bias`` / ``sliding_bias`` (causal for a chain call, the
token tree's for a tree call: :class:`~kangaroo_core.tree.TreeAttention`) and the RoPE positions (the slots for a chain
call, the nodes' depths for a tree), so the same graphs verify chains and trees.

onnxruntime is imported lazily: the rest of kangaroo works without it, and this backend says how to install it.
"""

from __future__ import annotations

import copy

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from kangaroo_backends.loading import cache_dir, gguf_source, load_model
from kangaroo_backends.families import SLIDING, sliding_window
from kangaroo_backends import gguf_nbits
from kangaroo_backends.onnx_bundle import (BIAS_INPUTS, EXPORT_KEY, GRAPHS, MANIFEST, WEIGHTS, export_kernel,
                                           export_weights, graph_file, graph_io, read_manifest, rows_exact)
from kangaroo_backends.onnx_export import export_onnx
from kangaroo_backends.onnx_toolkit import attention_bias, import_onnxruntime
from kangaroo_backends.ort_rotary import fuse_rotary
from kangaroo_backends.kv_cache import check_start
from kangaroo_backends.native import sources_digest
from kangaroo_backends.torch_backend import describe_split_model
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.errors import OnnxModelError, ProviderError
from kangaroo_core.files import read_json
from kangaroo_core.flags import Flag
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, DeepOutput

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: ``spinning`` option values: whose intra-op threads busy-wait between the ops of a run instead of sleeping (they
#: stop when the run ends: ``session.force_spinning_stop``). Waking a sleeping thread costs microseconds, paid by each
#: parallel op of a ~1,500-node pass. Each session has its own thread pool, but its threads stop spinning when its run
#: ends, so they never take the cores of the next session's run; what did take them was torch's own idle team, woken
#: by the loop's tensor work between runs (the backend's ``host_threads`` keeps that work on one thread). Default
#: ``all``; ``none`` for a machine shared with other busy processes.
SPINNING = ("none", "deep", "all")
#: ``attention`` option values: how each layer's attention over the KV cache runs on CPU. ``auto``: kangaroo's
#: custom op that reads the cache in place (:mod:`kangaroo_backends.ort_attention`) where it can be built and the
#: graphs mark their attention (graph revision 6), the graphs as exported otherwise; ``in_place``: the op or an error;
#: ``exported``: the graphs as exported (standard ONNX: concatenate, transpose, MatMul, Softmax, MatMul).
ATTENTION = ("auto", "in_place", "exported")
#: ``kernel`` option values: how ``gguf`` weights are multiplied on CPU. ``auto``: kangaroo's block kernel
#: (:mod:`kangaroo_backends.block_weights`: every block read once for all the rows of a verify pass) where it can be
#: built and the CPU has AVX2, onnxruntime's MatMulNBits otherwise; ``blocks``: the block kernel or an error;
#: ``matmulnbits``: MatMulNBits (Q4_0, Q4_1 and Q8_0 only).
KERNELS = ("auto", "blocks", "matmulnbits")


def resolve_kernel(kernel: str, provider: str, level: int) -> str:
    """``blocks`` or ``matmulnbits`` for the ``kernel`` option on this provider, at this accuracy level."""
    if kernel == "matmulnbits":
        return kernel
    from kangaroo_backends import block_weights, ort_attention

    why = None
    if provider != PROVIDERS["cpu"]:
        why = f"it runs on CPU only (provider {provider})"
    elif level not in (0, 1, 4):
        why = f"it computes at accuracy level 0/1 or 4, not {level}"
    elif ort_attention.library()[0] is None:
        why = ort_attention.library()[1]
    elif block_weights.isa() == "none":
        why = "this CPU has no AVX2 and FMA"
    if why is None:
        return "blocks"
    if kernel == "blocks":
        raise ConfigError(f"kernel=blocks: kangaroo's block kernel is not available: {why}")
    return "matmulnbits"


def provider_for_device(device: str | None, provider: str) -> str:
    """``--device`` spelt as an onnxruntime provider: ``cpu`` → cpu, ``cuda`` → cuda (``cuda:N`` is not chosen
    here: onnxruntime's CUDA provider runs on device 0); a device that contradicts ``--provider`` is refused."""
    if device is None:
        return provider
    wanted = {"cpu": "cpu", "cuda": "cuda", "cuda:0": "cuda"}.get(str(device))
    if wanted is None:
        raise ConfigError(f"the onnx backend runs on --device cpu or cuda (onnxruntime's CUDA provider, device 0), "
                          f"got {device!r}")
    if provider not in ("auto", wanted):
        raise ConfigError(f"--device {device} contradicts --provider {provider}")
    return wanted


def resolve_provider(ort, provider: str) -> str:
    """``auto``: CUDA when onnxruntime-gpu sees a GPU, else CPU; ``cpu`` / ``cuda``: that one or a ProviderError."""
    available = ort.get_available_providers()
    if provider == "auto":
        return PROVIDERS["cuda"] if PROVIDERS["cuda"] in available else PROVIDERS["cpu"]
    if provider not in PROVIDERS:
        raise ConfigError(f"provider must be one of auto, {', '.join(PROVIDERS)}, got {provider!r}")
    name = PROVIDERS[provider]
    if name not in available:
        hint = " (install onnxruntime-gpu, kangaroo's [onnx-gpu] extra, and have a CUDA GPU)" if provider == "cuda" else ""
        raise ProviderError(f"onnxruntime provider {name} is not available; available: {', '.join(available)}{hint}")
    return name


def _one_of(choices: tuple[str, ...]):
    def check(_inst, attribute, value) -> None:
        if value not in choices:
            raise ConfigError(f"{attribute.name} must be one of {', '.join(choices)}, got {value!r}")
    return check


def _integer(value):
    """An integer given as a whole float or a numeral (``--backend-option threads=2.0``) as an int; anything else as it
    is, for the validator to name."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _threads(_inst, attribute, value) -> None:
    if value is not None and not (_is_int(value) and value >= 1):
        raise ConfigError(f"threads must be an integer >= 1 (or None: onnxruntime's choice), got {value!r}")


def _accuracy_level(inst, attribute, value) -> None:
    if inst.weights == "float32" and value is not None:
        raise ConfigError("accuracy_level applies to weights=gguf only")
    if value is not None and not (_is_int(value) and 0 <= value <= 4):
        raise ConfigError(f"accuracy_level must be an integer 0..4, got {value!r}")


def _path(value):
    return Path(value).expanduser() if isinstance(value, (str, os.PathLike)) else value


def _bundle(_inst, attribute, value) -> None:
    if value is not None and not isinstance(value, Path):
        raise ConfigError(f"bundle must be a directory (a path) or None, got {value!r}")


@attrs.frozen
class OnnxOptions:
    """The onnx backend's options, validated once, when made: a bad value is one :class:`ConfigError` line naming
    the option. A backend keeps its options (:meth:`OnnxBackend.resplit` reuses them)."""

    #: ``auto``: CUDA when onnxruntime-gpu sees a GPU, else CPU (:func:`resolve_provider`)
    provider: str = attrs.field(default="auto", validator=_one_of(("auto", *PROVIDERS)))
    #: a directory from ``kangaroo export-onnx``; None: the export cache (exported on first use)
    bundle: Path | None = attrs.field(default=None, converter=_path, validator=_bundle)
    #: intra-op threads per session; None: onnxruntime's choice
    threads: int | None = attrs.field(default=None, converter=_integer, validator=_threads)
    #: ``float32``, or ``gguf``: the GGUF file's own blocks (MatMulNBits)
    weights: str = attrs.field(default="float32", validator=_one_of(WEIGHTS))
    #: MatMulNBits' accuracy level for ``gguf`` weights (0..4; None: 1, float32 activations)
    accuracy_level: int | None = attrs.field(default=None, converter=_integer, validator=_accuracy_level)
    #: whose threads busy-wait between the ops of a run (:data:`SPINNING`)
    spinning: str = attrs.field(default="all", validator=_one_of(SPINNING))
    #: how the attention over the KV cache runs on CPU (:data:`ATTENTION`)
    attention: str = attrs.field(default="auto", validator=_one_of(ATTENTION))
    #: how ``gguf`` weights are multiplied (:data:`KERNELS`)
    kernel: str = attrs.field(default="auto", validator=_one_of(KERNELS))

    @property
    def level(self) -> int:
        """The accuracy level asked for: 0 for float32 weights, 1 (float32 activations) by default for gguf ones."""
        if self.weights == "float32":
            return 0
        return 1 if self.accuracy_level is None else self.accuracy_level


def _file_opset(path: Path, manifest: dict):
    """The default-domain opset stamped in the file (the manifest's when the onnx package is not installed)."""
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    except Exception:
        return manifest.get("opset")


class Binder:
    """IO binding of torch tensors (by pointer) to a session's inputs and outputs, for the per-token loop.

    A deep pass binds ~120 buffers (every layer's past and new keys/values); onnxruntime's Python wrappers rebuild a
    device object and check capture state on each (half of the ~1.1 ms per token that binding took). This calls the
    bindings underneath with one device object made once (measured: 4-bit int8 target alone, 1 thread, +2.7 % tok/s),
    falling back to the public wrappers where an onnxruntime build lacks them (same results: tested).
    """

    def __init__(self, device: torch.device):
        from onnxruntime.capi import onnxruntime_inference_collection as collection

        self.device_type = "cuda" if device.type == "cuda" else "cpu"
        self.device_id = device.index or 0
        self.raw = hasattr(collection, "C") and hasattr(collection.C, "SessionIOBinding")
        if self.raw:
            self.c_device = collection.OrtDevice.make(self.device_type, self.device_id)._get_c_device()
            self.new_binding = collection.C.SessionIOBinding

    def binding(self, session):
        return self.new_binding(session._sess) if self.raw else session.io_binding()

    def bind(self, binding, name: str, tensor: torch.Tensor, output: bool = False) -> None:
        dtype = np.int64 if tensor.dtype == torch.long else np.float32
        self._bind_function(binding, output)(name, *self._where(), dtype, tuple(tensor.shape), tensor.data_ptr())

    def bind_cache(self, binding, past: dict[str, int], new: dict[str, int], past_shape: tuple[int, ...],
                   new_shape: tuple[int, ...]) -> None:
        """Bind float32 cache memory by address (name → address): the past slots as inputs, the new ones as outputs.
        No tensor views: making one per buffer cost more than binding it, four buffers per layer every pass."""
        where = self._where()
        bind_input, bind_output = self._bind_function(binding, False), self._bind_function(binding, True)
        for name, address in past.items():
            bind_input(name, *where, np.float32, past_shape, address)
        for name, address in new.items():
            bind_output(name, *where, np.float32, new_shape, address)

    def _where(self) -> tuple:
        return (self.c_device,) if self.raw else (self.device_type, self.device_id)

    @staticmethod
    def _bind_function(binding, output: bool):
        return binding.bind_output if output else binding.bind_input

    def run(self, session, binding) -> None:
        if self.raw:
            session._sess.run_with_iobinding(binding, None)
        else:
            session.run_with_iobinding(binding)


class GraphRunner:
    """One InferenceSession with its KV cache in preallocated buffers, run through IO binding.

    A graph with KV takes ``[first, position_ids, <biases>, past_key.0, past_value.0, ..., <extra>]`` and returns
    ``[outputs..., new_key.0, new_value.0, ...]``; one without (``kv_layers=0``) takes ``[first]`` only. The bias
    inputs it names (``attention_bias``; ``sliding_bias`` with the model's ``window``) are built here per call.
    """

    def __init__(self, session, inputs: list[str], outputs: list[str], kv_layers: int, kv_shape: tuple[int, int],
                 max_positions: int, device: torch.device, window: int | None = None, plain_session=None,
                 plain_one_row: bool = True):
        self.session, self.device = session, device
        self.plain_session = plain_session  # a 4-bit export's prefill graph: the prompt's pass (nothing cached yet)
        # ... and the one-row calls, where its one-row kernel is the row-by-row graph's (not where it computes at
        # another accuracy level than the graph: an int8 export's float32-activation prefill graph)
        self.plain_one_row = plain_one_row
        self.binder = Binder(device)
        self.inputs, self.outputs = inputs, outputs
        self.past_names = [name for name in inputs if name.startswith("past_")]
        self.new_names = [name for name in outputs if name.startswith("new_")]
        if len(self.past_names) != 2 * kv_layers or len(self.new_names) != 2 * kv_layers:
            raise OnnxModelError(f"graph inputs/outputs {inputs} → {outputs} do not hold {kv_layers} KV layers")
        kinds = {name: kind for kind, name in BIAS_INPUTS.items()}
        self.biases = {name: (window if kinds[name] == SLIDING else None) for name in inputs if name in kinds}
        self.layers = kv_layers
        self.kv_shape = kv_shape
        self.slot_bytes = 4 * math.prod(kv_shape)  # one position of one float32 buffer [1, capacity, *kv_shape]
        self.capacity = min(256, max_positions)
        self.cache = [torch.empty(1, self.capacity, *self.kv_shape, device=device) for _ in range(2 * self.layers)]
        self.length = 0

    def fork(self) -> "GraphRunner":
        """The same graph (session shared) with KV buffers of its own: one per stream decoded in a batch."""
        clone = copy.copy(self)
        clone.binder = Binder(self.device)
        clone.cache = [torch.empty_like(buffer) for buffer in self.cache]
        clone.length = 0
        return clone

    def reset(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep(self, positions: Sequence[int]) -> None:
        """Keep exactly these cached positions (ascending), compacted to the front."""
        valid = [p for p in positions if p < self.length]
        if valid == list(range(len(valid))):
            self.length = len(valid)
            return
        index = torch.as_tensor(valid, dtype=torch.long, device=self.device)
        for buffer in self.cache:
            buffer[:, : len(valid)] = buffer.index_select(1, index)
        self.length = len(valid)

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for i, old in enumerate(self.cache):
            new = torch.empty(1, capacity, *self.kv_shape, device=self.device)
            new[:, : self.length] = old[:, : self.length]
            self.cache[i] = new
        self.capacity = capacity

    def run(self, first: torch.Tensor, out_shapes: list[tuple[int, ...]],
            extra: dict[str, torch.Tensor] | None = None, tree=None) -> list[torch.Tensor]:
        """Feed ``first`` ([1, n] ids or [1, n, d] states) at the next n slots; return the non-KV outputs.

        ``extra``: further graph inputs by name (e.g. a drafter graph's side inputs), fed as they are. ``tree``
        (a :class:`~kangaroo_core.tree.TreeAttention`): the rows are tree nodes (their positions and visibility)."""
        n, start = first.shape[1], self.length
        # a 4-bit export's prefill graph: the prompt's pass, and one-row calls where its one-row kernel is the graph's
        plain = self.plain_session is not None and (start == 0 or (n == 1 and self.plain_one_row))
        session = self.plain_session if plain else self.session
        binding = self.binder.binding(session)
        first = first.contiguous()
        self.binder.bind(binding, self.inputs[0], first)
        kept = [first]  # the bound buffers must outlive the run
        for name, tensor in (extra or {}).items():
            tensor = tensor.to(self.device).contiguous()
            kept.append(tensor)
            self.binder.bind(binding, name, tensor)
        results = [torch.empty(shape, device=self.device) for shape in out_shapes]
        for name, tensor in zip(self.outputs, results):
            self.binder.bind(binding, name, tensor, output=True)
        if not self.layers:
            self.binder.run(session, binding)
            return results
        if start + n > self.capacity:
            self._grow(start + n)
        if tree is None:
            positions = torch.arange(start, start + n, device=self.device)[None]
        else:
            positions = tree.position_ids(self.device)[None]
        self.binder.bind(binding, "position_ids", positions)
        kept.append(positions)
        for name, window in self.biases.items():
            bias = attention_bias(n, start, window, tree, self.device)
            kept.append(bias)
            self.binder.bind(binding, name, bias)
        offset = start * self.slot_bytes
        self.binder.bind_cache(binding, {name: buffer.data_ptr() for name, buffer in zip(self.past_names, self.cache)},
                               {name: buffer.data_ptr() + offset for name, buffer in zip(self.new_names, self.cache)},
                               (1, start, *self.kv_shape), (1, n, *self.kv_shape))
        self.binder.run(session, binding)
        self.length = start + n
        return results


class OnnxBackend(Backend):
    """The target model on onnxruntime (CPUExecutionProvider, or CUDAExecutionProvider with onnxruntime-gpu).

    Options (:class:`OnnxOptions`, validated once and kept in :attr:`options`): ``provider`` (auto | cpu | cuda),
    ``bundle`` (a directory from ``kangaroo export-onnx``; default: the export cache), ``threads`` (intra-op threads
    per session; default: onnxruntime's choice), ``weights`` / ``accuracy_level``, ``spinning`` (:data:`SPINNING`:
    whose threads busy-wait between the ops of a run; default ``all``), ``attention`` (:data:`ATTENTION`).
    """

    @property
    def kernel_sources(self) -> str:
        """A digest of the package's C kernels (:func:`~kangaroo_backends.native.sources_digest`)."""
        return sources_digest()

    name = "onnx"
    runtime = "onnxruntime"
    supports_trees = True
    flags = (
        Flag("--provider", "provider", choices=("auto", *PROVIDERS),
             help="onnxruntime execution provider (default auto: CUDA when available, else CPU)."),
        Flag("--onnx-dir", "bundle", metavar="DIR", exists=True,
             help="A directory from `kangaroo export-onnx` (default: export once into the cache)."),
        Flag("--onnx-weights", "weights", choices=WEIGHTS,
             help="float32 (default); gguf runs every linear layer as MatMulNBits over the GGUF file's own 4/8-bit "
                  "blocks (the weights transformers dequantizes from the file; float32 activations)."),
        Flag("--onnx-accuracy-level", "accuracy_level", type=int, choices=None, metavar="0-4",
             help="With --onnx-weights gguf: MatMulNBits accuracy level. 1 (default) float32 activations; 4 int8 "
                  "activations (faster; lossy vs transformers, still lossless vs this backend's target alone)."),
        Flag("--onnx-spinning", "spinning", choices=SPINNING,
             help="2+ threads: whose threads busy-wait between ops during a run, stopping when it ends (default "
                  "all: every session's; none: threads sleep between ops, for a CPU shared with other busy work)."),
        Flag("--onnx-kernel", "kernel", choices=KERNELS,
             help="With --onnx-weights gguf, on CPU: auto (default) multiplies by kangaroo's block kernel (every "
                  "block read once for all rows of a verify pass; built once with the C compiler, AVX2) where it can, "
                  "else MatMulNBits; blocks: the block kernel, refusing to fall back; matmulnbits: onnxruntime's."),
        Flag("--onnx-attention", "attention", choices=ATTENTION,
             help="On CPU: auto (default) runs each layer's attention as kangaroo's op reading the KV cache in place "
                  "(built once with the C compiler; graphs exported since revision 6), else as exported; in_place: "
                  "the op, refusing to fall back; exported: the graphs' own ONNX attention."),
    )

    def __init__(self, model, tokenizer, exit_layer: int, model_name: str = "model", *,
                 options: OnnxOptions | None = None, quiet: bool = False, gguf_path: str | Path | None = None,
                 **fields: Any):
        """``options``, or its fields as keywords (``provider=``, ``bundle=``, ...: :class:`OnnxOptions`);
        ``gguf_path``: the GGUF file of ``model`` (default: the file it was loaded from) for ``weights="gguf"``."""
        if options is None:
            options = OnnxOptions(**fields)
        elif fields:
            raise TypeError(f"OnnxBackend takes options= or its fields as keywords, not both (got {', '.join(fields)})")
        self.ort = import_onnxruntime()
        self.options = options
        bundle, weights = options.bundle, options.weights
        self.attention, self.spinning = options.attention, options.spinning
        self.weights, self.accuracy_level = weights, options.level
        self.rows_exact = True  # what this code exports; a bundle says otherwise below
        self.rows_why: str | None = None  # why a bundle's verify passes are not exact (inexact_multi_position)
        self.kernel = None  # gguf weights: blocks or matmulnbits (resolved below, with the provider)
        if bundle is not None and (bundle / MANIFEST).is_file():  # a bundle says what it holds
            try:
                manifest = read_json(bundle / MANIFEST, OnnxModelError)
                self.weights, self.accuracy_level = export_weights(manifest)
                self._check_rows(manifest, model.config)
                self.kernel = export_kernel(manifest)
            except (OnnxModelError, AttributeError, TypeError, ValueError):
                pass  # reported with the full manifest check when the sessions open
        self.gguf_path = None
        if weights == "gguf" and bundle is None:
            self.gguf_path = Path(gguf_path) if gguf_path is not None else gguf_source(model)
            if self.gguf_path is None or not self.gguf_path.is_file():
                raise ConfigError("weights=gguf needs a model loaded from a GGUF file (--model FILE.gguf, or the "
                                  "default SmolLM2 GGUF)")
        # self.model is kept for exporting and for drafters that build their weights from it; it never runs per token
        describe_split_model(self, model, tokenizer, exit_layer, model_name)
        self.provider = resolve_provider(self.ort, options.provider)
        self.device = torch.device("cuda", 0) if self.provider == PROVIDERS["cuda"] else torch.device("cpu")
        self.host_threads = 1 if self.provider == PROVIDERS["cpu"] else None  # torch's glue beside onnxruntime's pools
        if self.weights == "gguf" and bundle is None:
            self.kernel = resolve_kernel(options.kernel, self.provider, self.accuracy_level)
        self.bundle = bundle
        self.threads = options.threads
        self.quiet = quiet
        self.manifest: dict | None = None
        self.shallow_runner = self.deep_runner = self.head_runner = None
        self.swapped: set[Path] = set()  # the graph files whose attention runs in place

    @classmethod
    def create(cls, config: DecodeConfig, model: Any = None, device: str | None = None, dtype: str = "float32",
               provider: str = "auto", bundle: str | None = None, threads: int | None = None, weights: str = "float32",
               accuracy_level: int | None = None, spinning: str = "all", attention: str = "auto",
               kernel: str = "auto") -> "OnnxBackend":
        provider = provider_for_device(device, provider)
        options = OnnxOptions(provider=provider, bundle=bundle, threads=threads, weights=weights,
                              accuracy_level=accuracy_level, spinning=spinning, attention=attention, kernel=kernel)
        if dtype != "float32":
            raise ConfigError(f"the onnx backend runs float32 graphs only, got dtype {dtype!r}")
        import_onnxruntime()  # the install hint before a model load
        loaded, tokenizer, name = load_model(model, dtype=torch.float32)
        return cls(loaded, tokenizer, config.exit_layer, name, options=options)

    def base_model(self):
        return self.model

    @property
    def inexact_multi_position(self) -> str | None:
        # measured: at float32 activations MatMulNBits' kernel for two or more rows differs from its one-row kernel in
        # the last bits, so those 4-bit graphs compute each row on its own (gguf_nbits.row_by_row); at int8
        # activations (level 4) the kernel itself computes each row alone where the CPU has AVX-512, not on AVX2 alone
        # (gguf_nbits.rows_at_once: measured, see _check_rows); a 4-bit bundle exported before either cannot verify
        # losslessly
        if self.rows_exact:
            return None
        return self.rows_why or (
            "this 4-bit ONNX export multiplies several rows at once (MatMulNBits' multi-row kernel differs from "
            "one-row passes in the last bits), so a verify pass does not reproduce one-token passes; re-export it "
            "(kangaroo export-onnx --weights gguf) to draft")

    def _check_rows(self, manifest: dict, config) -> None:
        """:attr:`rows_exact` (and :attr:`rows_why`) for an export's manifest on this CPU: its layout says whether its
        passes reproduce one-position passes, and an int8 export that multiplies all rows at once does so only where
        MatMulNBits' int8 kernel is row-exact (:func:`~kangaroo_backends.gguf_nbits.row_difference`: CPUs with
        AVX-512, not AVX2 alone), measured here, on the provider's CPU."""
        self.rows_exact, self.rows_why = rows_exact(manifest), None
        weights = manifest.get("weights")
        if not (self.rows_exact and isinstance(weights, dict) and weights.get("rows") == gguf_nbits.ROWS_AT_ONCE
                and self._on_cpu()):
            return
        found = gguf_nbits.row_difference(export_weights(manifest)[1], gguf_nbits.linear_ks(config))
        if found:
            self.rows_exact = False
            self.rows_why = (f"this 4-bit ONNX export multiplies all rows of a pass in one int8 MatMulNBits call, "
                             f"which is not row-exact on this CPU ({found}; onnxruntime's AVX2 kernel takes another "
                             f"path for one row than for several), so a verify pass does not reproduce one-token "
                             f"passes; re-export it on this machine (it then goes row by row) or use --onnx-kernel "
                             f"blocks to draft")

    def _on_cpu(self) -> bool:
        """Whether the graphs run on onnxruntime's CPU provider (before the provider is resolved: unless cuda was
        asked for)."""
        provider = getattr(self, "provider", None)
        return provider == PROVIDERS["cpu"] if provider else self.options.provider != "cuda"

    def resplit(self, exit_layer: int) -> "OnnxBackend":
        if self.bundle is not None:
            try:
                exported = json.loads((Path(self.bundle) / MANIFEST).read_text()).get("exit_layer")
            except (OSError, ValueError, AttributeError):
                exported = None
            if exported != exit_layer:
                raise ConfigError(f"the onnx export {self.bundle} is split at exit layer {exported}; it cannot be "
                                  f"re-split at {exit_layer}")
        return type(self)(self.model, self.tokenizer, exit_layer, self.model_name, options=self.options,
                          quiet=self.quiet, gguf_path=self.gguf_path)

    # -- export / sessions -----------------------------------------------------------------------------------------
    def export_dir(self) -> Path:
        if self.bundle is not None:
            return self.bundle
        suffix = "" if self.weights == "float32" else f"-gguf-a{self.accuracy_level}"
        suffix += "-blocks" if self.kernel == "blocks" else ""
        level = self.accuracy_level
        if (self.weights == "gguf" and self.kernel != "blocks" and level in gguf_nbits.ROW_INDEPENDENT_LEVELS
                and not gguf_nbits.rows_at_once(level, gguf_nbits.linear_ks(self.model.config))):
            suffix += "-rows"  # int8 graphs going row by row on this CPU: apart from the all-rows-at-once ones
        return cache_dir() / "onnx" / EXPORT_KEY / f"{self.fingerprint}-l{self.exit_layer}{suffix}"

    def artifact_dir(self) -> Path:
        """Where drafters keep their own exported graphs for this backend: inside the export (one directory to ship)."""
        self._ensure()
        return self.export_dir() / "drafters"

    def session(self, path: Path, spin: bool = False, swap: bool = True):
        """An InferenceSession on this backend's provider and threads (for the backend's and drafters' graphs);
        ``spin``: its threads busy-wait between the ops of a run (see :data:`SPINNING`); ``swap``: the graph may have
        attention over a KV cache to run in place (:data:`ATTENTION`)."""
        ort = self.ort
        if not path.is_file():
            raise OnnxModelError(f"ONNX file {path} is missing; re-export with `kangaroo export-onnx` (or delete {path.parent})")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # Several sessions take turns every few milliseconds, each with its own thread pool: a pool spinning after its
        # run would take the cores the next session needs, so spinning ones stop when their run ends (SPINNING)
        spinning = spin or self.spinning == "all"
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if spinning:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        source = self._attention_swapped(path, options, swap)
        try:
            session = ort.InferenceSession(str(path) if source is None else source, options, providers=[self.provider])
        except Exception as exc:  # onnxruntime raises its own exception types
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "opset" in message.lower():
                raise OnnxModelError(
                    f"{path} uses ONNX opset {_file_opset(path, self.manifest or {})}, which onnxruntime "
                    f"{ort.__version__} cannot run: upgrade onnxruntime or re-export with `kangaroo export-onnx --opset` (e.g. 17)"
                ) from None
            raise OnnxModelError(f"cannot load {path} (corrupt or not an ONNX file? delete {path.parent} and re-export): {message}") from None
        if self.provider not in session.get_providers():
            raise ProviderError(f"onnxruntime could not use {self.provider} for {path.name} (got {', '.join(session.get_providers())})")
        return session

    def _attention_swapped(self, path: Path, options, swap: bool = True) -> bytes | None:
        """The graph to load: with its attention swapped for the in-place op (``swap``; see :data:`ATTENTION`), or
        None for the file as it is. kangaroo's op library is registered in ``options`` where the graph needs it: for
        the swapped attention, and in any case for the block kernel's products."""
        from kangaroo_backends import ort_attention

        swap = swap and self.attention != "exported"
        if not swap and self.kernel != "blocks":
            return None
        library, why = ort_attention.library()
        if self.provider != PROVIDERS["cpu"]:
            library, why = None, f"it runs on CPU only (provider {self.provider})"
        if swap and library is None and self.attention == "in_place":
            raise ConfigError(f"attention=in_place: kangaroo's attention op is not available: {why}")
        import onnx

        try:
            proto = onnx.load(str(path))
        except Exception:  # noqa: BLE001  (a corrupt file: onnxruntime's own load says so, in the caller's words)
            return None
        blocks = ort_attention.uses_ops(proto)  # before the swap adds nodes of the same domain
        if blocks:
            ort_attention.require(path)
        # not marked: a bundle exported before graph revision 6, or a drafter's own graph
        swapped = swap and library is not None and ort_attention.swap_attention(proto) > 0
        rotated = library is not None and fuse_rotary(proto) > 0
        if blocks or swapped or rotated:
            options.register_custom_ops_library(str(ort_attention.library()[0]))
        if swapped:
            self.swapped.add(path)
        return proto.SerializeToString() if swapped or rotated else None

    def open_graph(self, path: Path, inputs: list[str], outputs: list[str], kv_layers: int,
                   plain_path: Path | None = None, spin: bool = False, plain_one_row: bool = True) -> GraphRunner:
        """Run an ONNX graph of the backend's KV layout (see :class:`GraphRunner`); checks its input/output names.
        ``plain_path``: a graph with the same inputs and outputs for the calls with nothing cached yet and, with
        ``plain_one_row``, the one-row calls (a 4-bit export's prefill graph: see
        :func:`~kangaroo_backends.gguf_nbits.row_by_row` and
        :data:`~kangaroo_backends.onnx_export.PREFILL_ACCURACY_LEVEL`).
        ``spin``: its threads busy-wait between ops (the backend's deep graph; see :data:`SPINNING`)."""
        # the op pays only where a cache is read: a prefill graph that runs the prompt alone (nothing cached) keeps the
        # exported attention, whose matrix products beat the op's row-by-row kernel on hundreds of rows (773 rows, 1
        # thread, SmolLM2's int8 deep prefill graph: 2,226 ms exported, 2,517 ms swapped)
        sessions = [self.session(p, spin=spin, swap=kv_layers > 0 and (p == path or plain_one_row))
                    for p in (path, plain_path) if p is not None]
        for file, session in zip((path, plain_path), sessions):
            got_in, got_out = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
            if got_in != inputs or got_out != outputs:
                raise OnnxModelError(f"{file}: inputs/outputs {got_in} → {got_out}, expected {inputs} → {outputs}")
        session = sessions[0]
        head_dim = self.model.config.hidden_size // self.model.config.num_attention_heads
        head_dim = getattr(self.model.config, "head_dim", None) or head_dim
        return GraphRunner(session, inputs, outputs, kv_layers, (self.model.config.num_key_value_heads, head_dim),
                           self.max_context, self.device, window=sliding_window(self.model.config),
                           plain_session=sessions[1] if len(sessions) > 1 else None, plain_one_row=plain_one_row)

    def _ensure(self) -> None:
        """Export (once) and open the three graphs; called when a generation starts, never per token."""
        if self.manifest is not None:
            return
        directory = self.export_dir()
        if self.bundle is None and not (directory / MANIFEST).is_file():
            if directory.exists():
                raise OnnxModelError(f"{directory} is an incomplete ONNX export (no {MANIFEST}); delete it to re-export")
            print(f"kangaroo: no ONNX export of {self.model_name} at exit layer {self.exit_layer} yet; exporting "
                  f"once to {directory}", file=sys.stderr)
            export_onnx(self.model, directory, exit_layer=self.exit_layer, fingerprint=self.fingerprint,
                        model_name=self.model_name, quiet=self.quiet, weights=self.weights, gguf_path=self.gguf_path,
                        accuracy_level=self.accuracy_level, kernel=self.kernel or "matmulnbits")
        manifest = read_manifest(directory, fingerprint=self.fingerprint, exit_layer=self.exit_layer)
        if self.bundle is None and (export_weights(manifest), export_kernel(manifest)) != (
                (self.weights, self.accuracy_level), self.kernel):
            raise OnnxModelError(f"ONNX export {directory} has weights {export_weights(manifest)} "
                                 f"({export_kernel(manifest)}), not {(self.weights, self.accuracy_level)} "
                                 f"({self.kernel}); delete it to re-export")
        self.weights, self.accuracy_level = export_weights(manifest)
        self._check_rows(manifest, self.model.config)
        runners = {}
        for name in GRAPHS:
            inputs, outputs = graph_io(name, self.model.config, self.exit_layer)
            kv_layers = sum(i.startswith("past_") for i in inputs) // 2
            prefill = graph_file(directory, manifest, name, directory / MANIFEST, key="prefill_file", optional=True)
            same_level = manifest["graphs"][name].get("prefill_accuracy_level", self.accuracy_level) == self.accuracy_level
            runners[name] = self.open_graph(graph_file(directory, manifest, name, directory / MANIFEST), inputs, outputs,
                                            kv_layers, plain_path=prefill, plain_one_row=same_level,
                                            spin=name == "deep" and self.spinning == "deep")
        unmarked = [path for path in (graph_file(directory, manifest, name, directory / MANIFEST)
                                      for name in ("shallow", "deep")) if path not in self.swapped]
        if self.attention == "in_place" and unmarked:
            raise ConfigError(f"attention=in_place: {unmarked[0]} does not mark its attention (exported before graph "
                              "revision 6); re-export it")
        self.shallow_runner, self.deep_runner, self.head_runner = runners["shallow"], runners["deep"], runners["head"]
        self.manifest = manifest

    def stream_view(self) -> "OnnxBackend":
        """This backend with KV buffers of its own (sessions and weights shared); its passes run one stream at a time
        (:meth:`Backend.shallow_many`'s default): continuous batching, passes not merged."""
        self._ensure()
        view = copy.copy(self)
        view.shallow_runner, view.deep_runner = self.shallow_runner.fork(), self.deep_runner.fork()
        return view

    # -- cache -----------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._ensure()
        self.shallow_runner.reset()
        self.deep_runner.reset()

    def keep(self, positions: Sequence[int]) -> None:
        self.shallow_runner.keep(positions)
        self.deep_runner.keep(positions)

    def crop(self, length: int) -> None:
        self.shallow_runner.crop(length)
        self.deep_runner.crop(length)

    def cache_lengths(self) -> tuple[int, int]:
        if self.manifest is None:
            return 0, 0
        return self.shallow_runner.length, self.deep_runner.length

    # -- the split model -------------------------------------------------------------------------------------------
    def shallow(self, token_ids: Sequence[int], start: int, tree=None) -> torch.Tensor:
        self._ensure()
        check_start("shallow", start, self.shallow_runner.length)
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)[None]
        (hidden,) = self.shallow_runner.run(ids, [(1, ids.shape[1], self.hidden_size)], tree=tree)
        return hidden[0]

    def deep(self, hidden: torch.Tensor, start: int, rows: Sequence[int] | None = None, tree=None) -> DeepOutput:
        self._ensure()
        check_start("deep", start, self.deep_runner.length)
        x = hidden.to(device=self.device, dtype=torch.float32)[None].contiguous()
        (final,) = self.deep_runner.run(x, [(1, x.shape[1], self.hidden_size)], tree=tree)  # [1, n, d]
        picked = final if rows is None else final[:, torch.as_tensor(list(rows), dtype=torch.long, device=self.device)]
        (logits,) = self.head_runner.run(picked, [(1, picked.shape[1], self.vocab_size)])
        return DeepOutput(logits=logits[0], hidden=final[0])


@hookimpl
def register_backends(register):
    register("onnx", OnnxBackend)
