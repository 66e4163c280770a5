"""ONNX Runtime bench methods for ``kangaroo bench`` (need the ``[onnx]`` extra; imports are lazy).

* ``ort_vanilla`` — optimum ``ORTModelForCausalLM`` greedy ``generate``: the fastest vanilla decoder a CPU user of the
  Hugging Face ecosystem would pick (one ONNX graph with KV cache, exported once by optimum and cached);
* ``vanilla_onnx`` — our engine on the ``onnx`` backend with no drafter (isolates the runtime from the speculation);
* ``kangaroo_onnx`` — our engine on the ``onnx`` backend with the run's drafter, adapter, policy and verifier.

All three run with as many onnxruntime intra-op threads as torch has (``kangaroo bench --threads``), so they compete
on the same cores as the torch methods. Each ``prepare`` exports what it needs on first use (and says so); the
exports live in the kangaroo cache and are reused by later runs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from kangaroo_core.bench_context import RUN_DEFAULT, BenchContext
from kangaroo_core.errors import KangarooError, MissingDependencyError
from kangaroo_core.hookspecs import hookimpl
from kangaroo_plugins.bench_methods import EngineMethod, HFGenerate, KangarooMethod, KangarooTreeMethod

INSTALL_HINT = "pip install optimum-onnx onnxruntime (kangaroo's [optimum] extra; optimum-onnx needs transformers 4.x)"


def _threads() -> int:
    return torch.get_num_threads()


def import_ort_model():
    """optimum's ``ORTModelForCausalLM``, or a one-line install hint."""
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except ImportError:
        raise MissingDependencyError(f"ort_vanilla needs optimum-onnx and onnxruntime: {INSTALL_HINT}") from None
    return ORTModelForCausalLM


def model_directory(model: Any) -> Path:
    """The HF directory the loaded model came from (a GGUF file's converted cache entry for the default model)."""
    path = Path(getattr(model.config, "_name_or_path", "") or "")
    if not (path / "config.json").is_file():
        raise KangarooError(f"ort_vanilla needs the model's HF directory, but {str(path)!r} is none")
    return path


def optimum_export(model: Any, fingerprint: str, *, quiet: bool = False) -> Path:
    """optimum's ONNX export of ``model`` (with KV cache), cached under ``cache_dir()/ort/<fingerprint>``; atomic."""
    from kangaroo_core.paths import cache_dir

    target = cache_dir() / "ort" / fingerprint
    if (target / "model.onnx").is_file():
        return target
    ort_model_cls = import_ort_model()
    source = model_directory(model)
    if not quiet:
        print(f"kangaroo: exporting {source} once with optimum for ort_vanilla; cached in {target}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        with warnings.catch_warnings():  # the tracer's warnings say nothing actionable to a bench user
            warnings.simplefilter("ignore")
            exported = ort_model_cls.from_pretrained(source, export=True, use_cache=True, local_files_only=True)
        exported.save_pretrained(tmp)
        os.replace(tmp, target)  # a failed export leaves no half cache entry behind
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class ORTVanilla(HFGenerate):
    """optimum ``ORTModelForCausalLM.generate`` (CPUExecutionProvider; CUDA with onnxruntime-gpu and a GPU)."""

    name = "ort_vanilla"
    rank = 5

    def __init__(self, provider: str = "auto"):
        self.provider = provider

    def load_model(self, context: BenchContext) -> Any:
        from kangaroo_backends.onnx_backend import resolve_provider
        from kangaroo_backends.onnx_toolkit import import_onnxruntime

        ort = import_onnxruntime()
        ort_model_cls = import_ort_model()
        if context.model is None:
            raise KangarooError("ort_vanilla needs a backend holding a transformers model")
        directory = optimum_export(context.model, context.backend.fingerprint)
        options = ort.SessionOptions()
        options.intra_op_num_threads = _threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        return ort_model_cls.from_pretrained(directory, provider=resolve_provider(ort, self.provider),
                                             session_options=options, local_files_only=True)


class _OnnxEngine:
    """Mixin: the method's engine runs on an ``onnx`` backend sharing the bench's loaded model."""

    provider = "auto"
    weights = "float32"  # "gguf": the GGUF file's own blocks as MatMulNBits (float32 activations)
    accuracy_level = None  # with weights "gguf": 4 = int8 activations (lossy by choice); None = the backend's default
    spinning = "all"  # the onnx backend's ``spinning`` option (kangaroo_backends.onnx_backend.SPINNING)
    kernel = "auto"  # the onnx backend's ``kernel`` option for gguf weights (kangaroo_backends.onnx_backend.KERNELS)

    def onnx_backend(self, context: BenchContext):
        from kangaroo_backends.onnx_backend import OnnxBackend

        base = context.backend
        if (base.runtime == "onnxruntime" and getattr(base, "weights", "float32") == self.weights
                and self.accuracy_level in (None, getattr(base, "accuracy_level", None))
                and self.spinning == getattr(base, "spinning", "all")
                and self.kernel == getattr(getattr(base, "options", None), "kernel", "auto")):
            return base
        if context.model is None:
            raise KangarooError(f"{self.name} needs a backend holding the transformers model to export")
        return context.shared_backend(  # one backend (and export) per weights for the whole run
            ("onnx", self.provider, self.weights, self.accuracy_level, self.spinning, self.kernel),
            lambda: OnnxBackend(context.model, context.tokenizer, base.exit_layer, base.model_name,
                                provider=self.provider, threads=_threads(), weights=self.weights,
                                accuracy_level=self.accuracy_level, spinning=self.spinning, kernel=self.kernel))


class VanillaOnnx(_OnnxEngine, EngineMethod):
    """Our engine on onnxruntime, no drafter: one token per pass."""

    name = "vanilla_onnx"
    rank = 6

    def __init__(self, provider: str = "auto"):
        self.provider = provider

    def make_engine(self, context: BenchContext):
        return context.engine(drafter=None, backend=self.onnx_backend(context))


class KangarooOnnx(_OnnxEngine, KangarooMethod):
    """Our engine on onnxruntime with drafting (the adapter exported into the same bundle)."""

    name = "kangaroo_onnx"
    target_alone = "vanilla_onnx"
    rank = 7

    def __init__(self, provider: str = "auto", **options: Any):
        super().__init__(**options)
        self.provider = provider

    def make_engine(self, context: BenchContext):
        config = self.config_for(context)
        if config.exit_layer != context.backend.exit_layer:
            raise KangarooError(f"{self.name} runs at the bench's --exit-layer only")
        return context.engine(config=config, backend=self.onnx_backend(context), adapter=self.adapter_or_default,
                              policy=self.policy, policy_options=self.policy_options,
                              drafter=self.drafter or RUN_DEFAULT, **self.tree_arguments(context))


class KangarooOnnxHybrid(KangarooOnnx):
    """The hybrid drafter (prompt lookup where it has been accepted, the adapter otherwise) on onnxruntime."""

    name = "kangaroo_onnx_hybrid"
    rank = 7
    drafter = "kangaroo-hybrid"


class KangarooOnnxTree(KangarooOnnx, KangarooTreeMethod):
    """Token trees on onnxruntime (the same graphs verify chains and trees; options as ``kangaroo_tree``)."""

    name = "kangaroo_onnx_tree"
    rank = 7


class VanillaOnnxGguf(VanillaOnnx):
    """The target alone on onnxruntime with the GGUF file's own 4/8-bit weights (MatMulNBits, float32 activations)."""

    name = "vanilla_onnx_gguf"
    rank = 8
    weights = "gguf"


class KangarooOnnxGguf(KangarooOnnx):
    """Kangaroo on onnxruntime with the GGUF file's own 4/8-bit weights (the adapter graph stays float32)."""

    name = "kangaroo_onnx_gguf"
    target_alone = "vanilla_onnx_gguf"
    rank = 9
    weights = "gguf"


class VanillaOnnxGgufInt8(VanillaOnnxGguf):
    """The target alone on the GGUF file's own blocks with int8 activations (accuracy level 4: lossy by choice)."""

    name = "vanilla_onnx_gguf_int8"
    rank = 8
    accuracy_level = 4


class VanillaOnnxGgufInt8Spin(VanillaOnnxGgufInt8):
    """``vanilla_onnx_gguf_int8`` with only the deep graph's threads busy-waiting between ops (``spinning=deep``;
    the default spins every session's during its runs): kept for comparison with earlier results."""

    name = "vanilla_onnx_gguf_int8_spin"
    rank = 8
    spinning = "deep"


class KangarooOnnxGgufInt8(KangarooOnnxGguf):
    """Kangaroo on the GGUF file's own blocks with int8 activations; identical to ``vanilla_onnx_gguf_int8``."""

    name = "kangaroo_onnx_gguf_int8"
    target_alone = "vanilla_onnx_gguf_int8"
    rank = 9
    accuracy_level = 4


class VanillaOnnxGgufInt8Nbits(VanillaOnnxGgufInt8):
    """``vanilla_onnx_gguf_int8`` on onnxruntime's MatMulNBits instead of kangaroo's block kernel (the comparison)."""

    name = "vanilla_onnx_gguf_int8_nbits"
    kernel = "matmulnbits"


class KangarooOnnxGgufInt8Nbits(KangarooOnnxGgufInt8):
    """``kangaroo_onnx_gguf_int8`` on MatMulNBits; identical to ``vanilla_onnx_gguf_int8_nbits``."""

    name = "kangaroo_onnx_gguf_int8_nbits"
    target_alone = "vanilla_onnx_gguf_int8_nbits"
    kernel = "matmulnbits"


@hookimpl
def register_bench_methods(register):
    register("ort_vanilla", ORTVanilla)
    register("vanilla_onnx", VanillaOnnx)
    register("kangaroo_onnx", KangarooOnnx)
    register("kangaroo_onnx_hybrid", KangarooOnnxHybrid)
    register("kangaroo_onnx_tree", KangarooOnnxTree)
    register("vanilla_onnx_gguf", VanillaOnnxGguf)
    register("kangaroo_onnx_gguf", KangarooOnnxGguf)
    register("vanilla_onnx_gguf_int8", VanillaOnnxGgufInt8)
    register("kangaroo_onnx_gguf_int8", KangarooOnnxGgufInt8)
    register("vanilla_onnx_gguf_int8_spin", VanillaOnnxGgufInt8Spin)
    register("vanilla_onnx_gguf_int8_nbits", VanillaOnnxGgufInt8Nbits)
    register("kangaroo_onnx_gguf_int8_nbits", KangarooOnnxGgufInt8Nbits)
