"""Training the ``learned`` policy's acceptance predictor (``kangaroo train-policy``): record (features, accepted)
from fixed-gamma greedy runs on training prompts, fit a logistic regression, save it in the predictor file format of
:mod:`kangaroo_policies.predictor`."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from kangaroo_core.errors import PredictorMismatchError
from kangaroo_core.interfaces import StoppingPolicy
from kangaroo_core.results import DraftStep
from kangaroo_policies.predictor import FEATURES, AcceptancePredictor, step_features


def fit(x: torch.Tensor, y: torch.Tensor, *, steps: int = 300, lr: float = 0.1, l2: float = 1e-3,
        seed: int = 0) -> tuple[AcceptancePredictor, dict]:
    """Logistic regression by full-batch gradient descent (Adam) on standardised features; returns it and a report."""
    torch.manual_seed(seed)
    x, y = x.double(), y.double()
    mean = x.mean(0)
    std = x.std(0, unbiased=False).clamp_min(1e-6) if len(x) > 1 else torch.ones(x.shape[1], dtype=torch.float64)
    z = (x - mean) / std
    weight = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    base = float(y.mean()) if len(y) else 0.5
    base = min(max(base, 1e-3), 1 - 1e-3)
    bias = torch.tensor([math.log(base / (1 - base))], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ weight + bias, y) + l2 * weight.square().sum()
        loss.backward()
        opt.step()
    predictor = AcceptancePredictor(weight.detach(), bias.detach(), mean, std)
    with torch.no_grad():
        p = predictor.predict_batch(x)
        logloss = float(torch.nn.functional.binary_cross_entropy(p.clamp(1e-9, 1 - 1e-9), y)) if len(y) else 0.0
        base_loss = -(base * math.log(base) + (1 - base) * math.log(1 - base))
        accuracy = float(((p > 0.5).double() == y).double().mean()) if len(y) else 0.0
    report = {"samples": len(y), "accept_rate": float(y.mean()) if len(y) else 0.0, "train_log_loss": logloss,
              "constant_log_loss": base_loss, "train_accuracy": accuracy, "steps": steps, "lr": lr, "l2": l2}
    return predictor, report


def round_samples(steps: Sequence[list[float]], drafted: int, accepted: int) -> list[tuple[list[float], int]]:
    """(features, accepted) of one round's drafts, conditional on every earlier draft being accepted.

    Drafts 1..m are positives, draft m+1 (the first rejection) is a negative; later drafts are dropped (their
    earlier drafts were not all accepted, so they say nothing about the conditional probability).
    """
    out = []
    for i, features in enumerate(steps[:drafted], start=1):
        if i <= accepted:
            out.append((features, 1))
        elif i == accepted + 1:
            out.append((features, 0))
    return out


def collect(engine, prompts: Sequence, recorder, max_new_tokens: int, log=print) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``engine`` (whose policy is ``recorder``, a :class:`RecordingPolicy`) on chat prompts; return (X, y)."""
    xs: list[list[float]] = []
    ys: list[int] = []
    for n, messages in enumerate(prompts, start=1):
        recorder.rounds = []
        result = engine.generate(list(messages), max_new_tokens=max_new_tokens)
        rounds = [r for r in result.rounds if r.drafted > 0]
        if len(rounds) != len(recorder.rounds):
            raise RuntimeError(f"recorded {len(recorder.rounds)} drafting rounds but the engine reports {len(rounds)}")
        for r, steps in zip(rounds, recorder.rounds):
            for features, label in round_samples(steps, r.drafted, r.accepted):
                xs.append(features)
                ys.append(label)
        if log is not None and (n % 10 == 0 or n == len(prompts)):
            log(f"kangaroo: train-policy: {n}/{len(prompts)} prompts, {len(ys)} samples")
    x = torch.tensor(xs, dtype=torch.float64).reshape(-1, len(FEATURES))
    return x, torch.tensor(ys, dtype=torch.float64)


def train_predictor(backend, drafter, prompts_file: str | Path, out_dir: str | Path, *, num_prompts: int = 64,
                    gamma: int = 6, max_new_tokens: int = 128, steps: int = 300, lr: float = 0.1, seed: int = 0,
                    command_line: str = "", log=print) -> dict:
    """Collect (features, accepted) from fixed-gamma greedy runs on training prompts, fit, save; return the report."""
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.engine import Engine
    from kangaroo_core.plugins import get_registry
    from kangaroo_tools.prompts import read_prompts

    if "specbench" in Path(prompts_file).name.lower().replace("-", "").replace("_", ""):
        raise PredictorMismatchError(f"refusing to train on {prompts_file}: Spec-Bench is for evaluation only")
    prompts = read_prompts(prompts_file, warn=log)
    random.Random(seed).shuffle(prompts)
    prompts = prompts[:num_prompts]
    config = DecodeConfig(eta=0.0, gamma=gamma, exit_layer=backend.exit_layer, max_new_tokens=max_new_tokens)
    recorder = RecordingPolicy()
    engine = Engine(backend, drafter, recorder, get_registry().resolve("verifier", "greedy")(), config)
    chats = [[{"role": role, "content": text} for role, text in p.messages] for p in prompts]
    x, y = collect(engine, chats, recorder, max_new_tokens, log=log)
    if len(y) == 0:
        raise PredictorMismatchError("no draft was recorded: nothing to train on")
    predictor, report = fit(x, y, steps=steps, lr=lr, seed=seed)
    # acceptance rate per draft index (conditional on earlier drafts accepted), for the report
    per_index = {}
    for i in range(1, gamma + 1):
        mask = x[:, 3] == i
        if mask.any():
            per_index[str(i)] = {"samples": int(mask.sum()), "accept_rate": float(y[mask].mean())}
    report.update({"prompts_file": str(prompts_file), "num_prompts": len(prompts), "gamma": gamma,
                   "max_new_tokens": max_new_tokens, "seed": seed, "per_index": per_index, "command": command_line,
                   "model": backend.model_name})
    predictor.save(out_dir, base_fingerprint=backend.fingerprint, exit_layer=backend.exit_layer,
                   extra={"training": report})
    return report


class RecordingPolicy(StoppingPolicy):
    """A fixed-gamma policy that records every draft's features, one list per drafting round (for training)."""

    name = "recording-fixed"

    def __init__(self):
        self.rounds: list[list[list[float]]] = []

    def start_round(self, tokens) -> None:
        self.rounds.append([])

    def keep_drafting(self, step: DraftStep) -> bool:
        self.rounds[-1].append(step_features(step))
        return True
