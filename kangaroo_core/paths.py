"""Where kangaroo keeps what it can remake (converted models, ONNX exports, training work): one cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KANGAROO_CACHE_DIR``, else ``~/.cache/kangaroo`` (read on every call, so tests and tools can redirect it)."""
    root = os.environ.get("KANGAROO_CACHE_DIR") or Path.home() / ".cache" / "kangaroo"
    return Path(root)
