"""A backend that logs every pass of the split target: the torch backend, plus one record per ``shallow`` / ``deep``.

Each record says which part ran (``shallow``: M[:l], ``deep``: M[l:] + the head), at which position its first new
entry went, over how many positions, and how long the call took. With the option ``log=PATH`` (on the command line
``--pass-log PATH`` or ``--backend-option log=PATH``) each record is also appended to PATH as one JSON line.

The computation is the torch backend's own, so the output is token-identical to ``--backend torch``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.flags import Flag
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import DeepOutput


@attrs.frozen
class Pass:
    """One call of ``shallow`` or ``deep``."""

    part: str  # "shallow" or "deep"
    start: int  # the absolute position of its first new cache entry
    positions: int  # how many positions it ran over (tree nodes included)
    ms: float  # wall-clock milliseconds of the call


class PassLogBackend(TorchBackend):
    """The torch backend, recording every pass in ``passes`` (the current generation's: ``reset`` empties it) and,
    when ``log`` is set, appending each as a JSON line to that file."""

    name = "pass-log"
    # The torch backend's flags (--kernels) and one of our own: `--pass-log FILE` sets the option `log`.
    flags = TorchBackend.flags + (
        Flag("--pass-log", "log", metavar="FILE",
             help="Append one JSON line per shallow/deep pass (part, start, positions, ms) to FILE."),
    )

    def __init__(self, *args: Any, log: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.log = log
        self.passes: list[Pass] = []

    @classmethod
    def create(cls, config: DecodeConfig, model: Any = None, dtype: str = "float32", kernels: str = "auto",
               log: str | None = None) -> "PassLogBackend":
        # The keywords of create are the backend's options: the registry refuses any other name before loading.
        backend = super().create(config, model=model, dtype=dtype, kernels=kernels)
        backend.log = log
        return backend

    def resplit(self, exit_layer: int) -> "PassLogBackend":
        other = super().resplit(exit_layer)  # type(self)(...): a PassLogBackend over the same weights
        other.log = self.log
        return other

    def reset(self) -> None:
        super().reset()
        self.passes.clear()

    def shallow(self, token_ids: Sequence[int], start: int, tree=None) -> torch.Tensor:
        began = time.perf_counter()
        hidden = super().shallow(token_ids, start, tree)
        self._record("shallow", start, len(token_ids), began)
        return hidden

    def deep(self, hidden: torch.Tensor, start: int, rows: Sequence[int] | None = None, tree=None) -> DeepOutput:
        began = time.perf_counter()
        out = super().deep(hidden, start, rows=rows, tree=tree)
        self._record("deep", start, int(hidden.shape[0]), began)
        return out

    def _record(self, part: str, start: int, positions: int, began: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time of the work, not of queueing it
        record = Pass(part, start, positions, round((time.perf_counter() - began) * 1000, 3))
        self.passes.append(record)
        if self.log is not None:
            with Path(self.log).open("a") as f:
                f.write(json.dumps(attrs.asdict(record)) + "\n")


@hookimpl
def register_backends(register):
    register("pass-log", PassLogBackend)
