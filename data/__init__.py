"""The data every command finds by default, shipped inside the package (never a path outside it).

* ``specbench_dev.jsonl``: 30 Spec-Bench questions, 5 per subtask, for development and the demo (never trained on).
* ``train_prompts.jsonl.gz``: 8,940 training prompts, disjoint from Spec-Bench, gzip-compressed.

Sources and licences are in this folder's ``README.md``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEV_QUESTIONS = "specbench_dev.jsonl"
TRAIN_PROMPTS = "train_prompts.jsonl.gz"


def data_path(name: str) -> Path:
    """The shipped file ``name`` as a path (package data of a regular install or a checkout)."""
    return Path(str(files(__name__) / name))


def dev_questions() -> Path:
    return data_path(DEV_QUESTIONS)


def train_prompts() -> Path:
    return data_path(TRAIN_PROMPTS)
