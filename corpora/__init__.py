"""The committed self-distilled corpora (``kangaroo corpus build``), one folder per model, shipped with the package."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEFAULT_CORPUS = "smollm2-135m-instruct"


def corpus_path(name: str = DEFAULT_CORPUS) -> Path:
    """The shipped corpus folder ``name`` (in a checkout: ``corpora/NAME``, where ``corpus build`` extends it)."""
    return Path(str(files(__name__) / name))
