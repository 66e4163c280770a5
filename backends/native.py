"""The small-batch verify kernels (``small_batch_linear.c``, ``small_batch_attention.c``), built once per machine with
the system C compiler into one library.

Built at first use into ``$KANGAROO_CACHE_DIR/native/<hash>.so`` (the hash covers the sources, the compiler flags,
the compiler's version and, for ``-march=native`` builds, the CPU's model and instruction sets, so an edit, another
compiler or a cache directory shared with another CPU rebuilds) and loaded with :mod:`ctypes`; it links OpenMP
against the ``libgomp`` that torch has already loaded, so both share one thread pool. Nothing depends on it: without
a C compiler, on a platform where the build fails, or with ``KANGAROO_NATIVE=0``, :func:`small_batch_kernel` and
:func:`small_batch_attention` return ``None`` and the reason, and the backend runs the plain transformers path.

``KANGAROO_MARCH=ARCH`` (e.g. ``x86-64-v3``: AVX2 and FMA, no AVX-512) builds every library for that architecture
instead of ``-march=native`` (:func:`target_flags`): a build for a CPU other than this one — the one an emulator runs
(``qemu-x86_64 -cpu EPYC-Rome``, whose compiler runs natively and would otherwise put this CPU's AVX-512 into the
library), or one build for a cache shared by many CPUs (no CPU identity in its key then).
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

from kangaroo_core.machine import cpu_identity
from kangaroo_core.paths import cache_dir

SOURCES = ("small_batch_linear.c", "small_batch_attention.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
#: names the architecture the libraries are built for instead of this CPU's (``-march=`` value; see the module doc)
MARCH_ENV = "KANGAROO_MARCH"
MAX_ROWS = 8  # rows the linear kernel computes per sweep of a weight block (more rows: chunks of 8 over that block)


@functools.cache
def sources_digest() -> str:
    """A digest of every C source this package builds: measurements of its kernels (the cost policy's curves) are
    stale once one of them changes."""
    files = sorted(f for f in resources.files("kangaroo_backends").iterdir() if f.name.endswith(".c"))
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()[:16]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def target_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` with ``-march=native`` replaced by ``-march=$KANGAROO_MARCH`` when that is set (and not ``native``)."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march or march == "native":
        return tuple(flags)
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in flags)


def build_library(compiler: str, sources: dict[str, bytes], flags: tuple[str, ...], stem: str,
                  main: str | None = None) -> Path:
    """Compile ``sources`` (every one, or only ``main``, which includes the others) into
    ``cache_dir()/native/<stem>-<hash>.so`` once; the hash covers the sources, the flags, the compiler's version and,
    with ``-march=native``, :func:`cpu_identity` (``-march=native`` may be replaced first: :func:`target_flags`)."""
    flags = target_flags(flags)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(str(exc)) from None
    cpu = cpu_identity() if "-march=native" in flags else ""
    key = hashlib.sha256(b"".join(sources.values()) + " ".join(flags).encode() + version.encode()
                         + cpu.encode()).hexdigest()[:20]
    target = cache_dir() / "native" / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        paths = []
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
            if main is None or name == main:
                paths.append(Path(tmp) / name)
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([compiler, *flags, *map(str, paths), "-o", str(out)], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(str(exc)) from None
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(out, target)  # atomic: a concurrent or interrupted build never leaves half a library
    return target


def build_packaged(sources: tuple[str, ...], flags: tuple[str, ...], stem: str, what: str,
                   main: str | None = None) -> tuple[Path | None, str]:
    """Build the package's own C ``sources`` (see :func:`build_library`): ``(path, "")``, or ``(None, why not)`` —
    ``KANGAROO_NATIVE=0``, no compiler, or the build failed (``what`` names the library in that message)."""
    if os.environ.get("KANGAROO_NATIVE", "1") == "0":
        return None, "disabled by KANGAROO_NATIVE=0"
    cc = compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    texts = {name: resources.files("kangaroo_backends").joinpath(name).read_bytes() for name in sources}
    try:
        return build_library(cc, texts, flags, stem, main=main), ""
    except RuntimeError as exc:
        return None, f"building {what} failed: {exc}"


@functools.lru_cache(maxsize=None)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The built library, or ``(None, why not)``."""
    import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share torch's OpenMP runtime)

    path, why = build_packaged(SOURCES, FLAGS, "small_batch", "the small-batch kernel")
    if path is None:
        return None, why
    try:
        return ctypes.CDLL(str(path)), ""
    except OSError as exc:
        return None, f"loading the small-batch kernel failed: {exc}"


def _function(name: str, argtypes: list) -> tuple[object | None, str]:
    library, why = _library()
    if library is None:
        return None, why
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = argtypes
    return function, ""


def small_batch_kernel() -> tuple[object | None, str]:
    """``(function, "")`` or ``(None, why not)``; the function is ``small_batch_linear(x, w, y, n, in, out, threads)``."""
    return _function("small_batch_linear", [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int])


def small_batch_attention() -> tuple[object | None, str]:
    """``(function, "")`` or ``(None, why not)``; the function is ``small_batch_attention(query, key, value, mask, out,
    heads, kv_heads, rows, keys, head_dim, query_head_stride, query_row_stride, kv_head_stride, kv_row_stride,
    mask_row_stride, scale, threads)`` (see the C source)."""
    return _function("small_batch_attention",
                     [ctypes.c_void_p] * 5 + [ctypes.c_long] * 10 + [ctypes.c_float, ctypes.c_int])
