"""Where a torch model runs: ``--device`` and ``--dtype`` names resolved once, with one-line errors.

Every module and tensor the drafters, runners, verifiers and trees create follows the backend's ``device`` and
``dtype`` (read from the model's parameters), so only the backend needs to be told.
"""

from __future__ import annotations

import torch

from kangaroo_core.config import ConfigError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype by name (``float32``, ``bfloat16``, ``float16``, ``float64``)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch device; refused in one line when CUDA is asked for and absent."""
    if name is None:
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        build = f"this torch {torch.__version__} was built without CUDA" if torch.version.cuda is None else \
            f"torch {torch.__version__} sees no CUDA device"
        raise ConfigError(f"--device {name} asks for CUDA, but {build}; install a CUDA build of torch on a machine with "
                          f"an NVIDIA GPU, or use --device cpu")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= count:
        raise ConfigError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings on CUDA are wrong without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
