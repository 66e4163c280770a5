"""What this machine is, for caches keyed by it: the CPU's model and instruction-set flags."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model name and instruction-set flags (Linux ``/proc/cpuinfo``),
    else the platform's processor string. A library built for one CPU can crash another with an illegal
    instruction, so a cache directory shared between machines keeps one build per CPU (and one measured cost curve:
    kernels run at different speeds on different CPUs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first = {}
    for line in lines:
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    found = [first.get(k, "") for k in ("model name", "flags", "Features", "CPU part")]  # x86, then Arm's names
    return "|".join(found) if any(found) else f"{platform.machine()}|{platform.processor()}"
