"""Logit processing and random draws shared by the drafter side (engine) and the sampling verifier.

Processing is exactly transformers' ``generate(do_sample=True, temperature=t, top_k=k, top_p=p)``:
``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` → ``TopPLogitsWarper`` (each only when it changes something:
t != 1, k != 0, p < 1; filtered logits become -inf), so "the target alone" means the same thing here and there.
Processing runs in float32 (transformers' sampling loop casts the logits to float32 first); the probabilities are
then taken in float64 on the CPU, where every random draw happens (one CPU ``torch.Generator`` per generation, whatever the model's device).

Shapes: ``[..., V]`` logits in, ``[..., V]`` out (one row per position).
"""

from __future__ import annotations

import torch

from kangaroo_core.config import SamplingConfig


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as transformers' warpers; requires ``sampling.temperature > 0``."""
    if sampling.greedy:
        raise ValueError("process_logits needs temperature > 0 (temperature 0 is greedy: use target_probs)")
    scores = logits
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k != 0:
        k = min(sampling.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if sampling.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - sampling.top_p)
        sorted_remove[..., -1:] = False  # keep at least one token
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -float("inf"))
    return scores


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution tokens are sampled from, float64 on the CPU, [..., V].

    Temperature 0 is the limit temperature → 0: a point mass on the argmax.
    """
    logits = logits.detach().cpu()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float64)
    # processed in float32 like transformers' sampling loop (it casts the logits first), whatever the model's dtype
    return torch.softmax(process_logits(logits.float(), sampling).to(torch.float64), dim=-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A fresh CPU generator for one generation: seeded with ``seed``, or randomly when it is None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from ``probs`` [V] (non-negative, positive sum)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator) -> float:
    """One number from U[0, 1)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))
