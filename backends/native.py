"""The small-batch verify kernel (``small_batch_linear.c``), built once per machine with the system C compiler.

Built at first use into ``$KANGAROO_CACHE_DIR/native/<hash>.so`` (the hash covers the source, the compiler flags and
the compiler's version, so an edit or another compiler rebuilds) and loaded with :mod:`ctypes`; it links OpenMP
against the ``libgomp`` that torch has already loaded, so both share one thread pool. Nothing depends on it: without
a C compiler, on a platform where the build fails, or with ``KANGAROO_NATIVE=0``, :func:`small_batch_kernel` returns
``None`` and the reason, and the backend runs the plain transformers path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from kangaroo_core.paths import cache_dir

SOURCE = "small_batch_linear.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS = 8  # rows per call the kernel handles; more go to BLAS (a GEMM is efficient there)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(compiler: str, source: bytes) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:20]
    target = cache_dir() / "native" / f"small_batch_linear-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / SOURCE
        src.write_bytes(source)
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(out, target)  # atomic: a concurrent or interrupted build never leaves half a library
    return target


@functools.lru_cache(maxsize=None)
def small_batch_kernel() -> tuple[object | None, str]:
    """``(function, "")`` or ``(None, why not)``; the function is ``small_batch_linear(x, w, y, n, in, out, threads)``."""
    if os.environ.get("KANGAROO_NATIVE", "1") == "0":
        return None, "disabled by KANGAROO_NATIVE=0"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found (set CC, or install gcc)"
    import torch  # noqa: F401  (loads torch's libgomp first, so the kernel shares torch's OpenMP runtime)

    source = resources.files("kangaroo_backends").joinpath(SOURCE).read_bytes()
    try:
        library = ctypes.CDLL(str(_build(compiler, source)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building the small-batch kernel failed: {exc}"
    function = library.small_batch_linear
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    return function, ""
