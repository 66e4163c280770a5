"""A logistic-regression acceptance predictor for the ``learned`` stopping policy: features and the file format
(training it is a tool: :mod:`kangaroo_tools.policy_training`).

Features of one draft (all cheap: computed from the drafter's distribution the engine already has):
top-1 probability, top-1 − top-2 margin, entropy (nats), and the draft's 1-based index in its round.
The model predicts P(draft accepted | every earlier draft of the round accepted).

Files (no pickle): ``predictor.safetensors`` (weight [F], bias [1], mean [F], std [F]: features are standardised
before the linear layer) and ``predictor.json`` (format, feature names, base-model fingerprint, exit layer, training
report). Loading a file made for another base model or exit layer is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kangaroo_core.errors import PredictorMismatchError
from kangaroo_core.results import DraftStep

FORMAT = "kangaroo-acceptance-predictor/1"
FEATURES = ("top1_prob", "top1_top2_margin", "entropy", "draft_index")
WEIGHTS, META = "predictor.safetensors", "predictor.json"


def draft_features(probs: torch.Tensor, index: int) -> list[float]:
    """The feature vector of a draft with next-token distribution ``probs`` [V] at 1-based ``index``."""
    probs = probs.float()
    top = probs.topk(2).values
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum()
    return [float(top[0]), float(top[0] - top[1]), float(entropy), float(index)]


def step_features(step: DraftStep) -> list[float]:
    return draft_features(step.probs, step.index)


class AcceptancePredictor:
    """sigmoid(weight · (x − mean) / std + bias) on :data:`FEATURES`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor | None = None,
                 std: torch.Tensor | None = None, meta: dict | None = None):
        n = len(FEATURES)
        self.weight = weight.double().reshape(n)
        self.bias = bias.double().reshape(1)
        self.mean = torch.zeros(n, dtype=torch.float64) if mean is None else mean.double().reshape(n)
        self.std = torch.ones(n, dtype=torch.float64) if std is None else std.double().reshape(n)
        self.meta = dict(meta or {})
        # plain floats: the per-draft prediction is a few multiply-adds, no tensor ops
        self._w = [float(w / s) for w, s in zip(self.weight, self.std)]
        self._b = float(self.bias[0]) - sum(float(m) * w for m, w in zip(self.mean, self._w))

    @classmethod
    def random(cls, seed: int = 0) -> "AcceptancePredictor":
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(len(FEATURES), generator=g, dtype=torch.float64), torch.randn(1, generator=g, dtype=torch.float64))

    def predict(self, features: Sequence[float]) -> float:
        z = self._b + sum(w * x for w, x in zip(self._w, features))
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def predict_batch(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(((x.double() - self.mean) / self.std) @ self.weight + self.bias)

    # -- files -----------------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, *, base_fingerprint: str, exit_layer: int, extra: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous(), "mean": self.mean.contiguous(),
                   "std": self.std.contiguous()}, str(directory / WEIGHTS))
        meta = {**self.meta, **(extra or {}), "format": FORMAT, "features": list(FEATURES),
                "base_model_fingerprint": base_fingerprint, "exit_layer": exit_layer}
        (directory / META).write_text(json.dumps(meta, indent=2) + "\n")
        self.meta = meta
        return directory

    @classmethod
    def load(cls, directory: str | Path, *, base_fingerprint: str | None = None, exit_layer: int | None = None) -> "AcceptancePredictor":
        """Load a predictor; refuse one made for another base model (fingerprint) or exit layer when they are given."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / META).read_text())
            tensors = load_file(str(directory / WEIGHTS))
        except (OSError, json.JSONDecodeError, ValueError) as exc:
            raise PredictorMismatchError(f"cannot read predictor {directory}: {exc}") from None
        if meta.get("format") != FORMAT or meta.get("features") != list(FEATURES):
            raise PredictorMismatchError(f"predictor {directory}: unknown format {meta.get('format')!r} or features")
        if base_fingerprint is not None and meta.get("base_model_fingerprint") != base_fingerprint:
            raise PredictorMismatchError(
                f"predictor {directory} was made for base model {meta.get('base_model_fingerprint')}, "
                f"not for the loaded model {base_fingerprint}")
        if exit_layer is not None and meta.get("exit_layer") != exit_layer:
            raise PredictorMismatchError(
                f"predictor {directory} was made for exit layer {meta.get('exit_layer')}, not {exit_layer}")
        try:
            return cls(tensors["weight"], tensors["bias"], tensors["mean"], tensors["std"], meta)
        except (KeyError, RuntimeError) as exc:
            raise PredictorMismatchError(f"predictor {directory}: malformed weights ({exc})") from None
