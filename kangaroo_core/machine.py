"""What this machine is, for caches keyed by it: the CPU's model and instruction-set flags; and torch's threads
beside a backend that runs on its own thread pool."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields of Linux ``/proc/cpuinfo`` (empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    return first


@functools.cache
def cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model name and instruction-set flags (Linux ``/proc/cpuinfo``),
    else the platform's processor string. A library built for one CPU can crash another with an illegal
    instruction, so a cache directory shared between machines keeps one build per CPU (and one measured cost curve:
    kernels run at different speeds on different CPUs)."""
    first = _cpuinfo()
    found = [first.get(k, "") for k in ("model name", "flags", "Features", "CPU part")]  # x86, then Arm's names
    return "|".join(found) if any(found) else f"{platform.machine()}|{platform.processor()}"


#: the instruction-set extensions the kernels choose between, named in a bench's results
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
                "amx_tile", "asimd", "asimddp", "sve")
#: what caps the kernel paths below the CPU's: kangaroo's own kernels, torch's ATen and the oneDNN ones torch calls
ISA_CAPS = ("KANGAROO_ISA", "KANGAROO_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_description() -> dict[str, str]:
    """The CPU a measurement ran on, for results files: model name, family/model/stepping, the kernel-relevant flags,
    the count of logical CPUs, and the caps on the kernel paths in force (:func:`forced_paths`), if any."""
    first = _cpuinfo()
    flags = set((first.get("flags") or first.get("Features") or "").split())
    out = {"model": first.get("model name") or platform.processor() or platform.machine(),
           "family_model_stepping": "/".join(first.get(k, "?") for k in ("cpu family", "model", "stepping")),
           "kernel_flags": " ".join(f for f in KERNEL_FLAGS if f in flags),
           "logical_cpus": str(os.cpu_count())}
    if forced_paths():
        out["forced_isa"] = forced_paths()
    return out


def forced_paths() -> str:
    """The kernel paths capped below what the CPU has (:data:`ISA_CAPS`), e.g. to run an AVX2-only CPU's paths on an
    AVX-512 one; empty when none is."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_CAPS
                    if os.environ.get(name, "auto").lower() not in ("", "auto", "native", "all"))


def cpu_line(description: dict[str, str] | None = None) -> str:
    """One line of :func:`cpu_description` for a report."""
    d = description or cpu_description()
    forced = f" · {d['forced_isa']}" if "forced_isa" in d else ""
    return (f"{d['model']} (family/model/stepping {d['family_model_stepping']}, {d['logical_cpus']} logical CPUs; "
            f"{d['kernel_flags'] or 'no listed SIMD flags'}){forced}")


@contextlib.contextmanager
def host_threads(backend):
    """torch's intra-op threads set to ``backend.host_threads`` (if any) for the loop's own tensor work; restored after."""
    import torch

    wanted, before = getattr(backend, "host_threads", None), torch.get_num_threads()
    if wanted is not None and wanted != before:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
