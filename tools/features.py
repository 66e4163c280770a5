"""Self-distillation data for adapter training: the target answers prompts itself, then one forward pass per
sequence records the adapter's inputs (layer-l hidden states) and soft labels (the target's top-K next-token
log-probabilities).

Everything is written in shards under a work directory, each shard atomically (temp file + rename), so an
interrupted run resumes at the first missing shard without losing finished work.

Shard tensors (B sequences, right-padded to T positions, K label entries):
    input_ids      [B, T] int32   prompt + response (response ends at EOS or the token budget)
    lengths        [B]    int32   real length of each sequence
    prompt_lengths [B]    int32   prompt length (labels count only for response tokens)
    hidden_l{L}    [B, T, d] fp16 output of layer L (= input of the adapter for exit layer L), one per layer
    deep           [B, T, d] fp16 the target's final normed hidden state (what verification hands a deep-context
                                  drafter for accepted positions; the LM head of row t predicts token t + 1)
    topk_ids       [B, T, K] int32  the target's K most likely next tokens at each position
    topk_logprobs  [B, T, K] fp16   their log-probabilities (full-vocabulary log-softmax)
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from kangaroo_core.errors import KangarooError
from kangaroo_tools.prompts import Prompt, encode_prompt


def split_prompts(prompts: Sequence[Prompt], count: int, heldout: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """A seeded shuffle: the first ``heldout`` prompts are held out, the next ``count`` are for training.

    The order depends only on the file and the seed, so a later run with a larger ``count`` keeps every finished
    shard and only adds new ones.
    """
    order = list(prompts)
    random.Random(seed).shuffle(order)
    if len(order) <= heldout:
        raise KangarooError(f"need more than {heldout} prompts to hold {heldout} out, got {len(order)}")
    return order[heldout: heldout + count], order[:heldout]


def generate_answers(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, eos_ids: set[int]) -> list[list[int]]:
    """Greedy answers of the target for a batch of prompts: the corpus generator (length-sorted batched generate),
    one batch; each cut after EOS."""
    from kangaroo_tools.corpus import batched_greedy_answers

    return batched_greedy_answers(model, prompt_ids, max_new_tokens, frozenset(eos_ids), max(1, len(prompt_ids)))


@torch.inference_mode()
def extract_features(model, sequences: list[list[int]], prompt_lengths: list[int], layers: Sequence[int], top_k: int,
                     matmul_dtype: torch.dtype | None = None) -> dict:
    """One forward pass over right-padded sequences → shard tensors (see module docstring).

    The LM head runs only where a label is needed (positions whose next token is a response token): on long RAG
    prompts the full-vocabulary logits of every prompt position would cost more than the rest of the pass.

    ``matmul_dtype`` (e.g. ``torch.bfloat16``): the model body's matrix products run in that dtype under autocast
    (residual stream, norms and the LM head stay in the model's dtype) — a faster, slightly perturbed pass for
    *training* features; held-out features, which judge agreement with the real target, never use it.
    """
    width = max(map(len, sequences))
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    select = torch.zeros_like(ids, dtype=torch.bool)
    for row, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        select[row, p - 1 : len(seq) - 1] = True
    head = model.lm_head.weight
    ids, mask, select = ids.to(head.device), mask.to(head.device), select.to(head.device)  # where the model is
    with torch.autocast(head.device.type, dtype=matmul_dtype, enabled=matmul_dtype is not None):
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    deep = out.last_hidden_state.to(head.dtype)
    logits = model.lm_head(deep[select])
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [N, V]
    top = torch.topk(logprobs, top_k, dim=-1)
    topk_ids = torch.zeros((*ids.shape, top_k), dtype=torch.int32, device=ids.device)
    topk_logprobs = torch.zeros((*ids.shape, top_k), dtype=torch.float16, device=ids.device)
    topk_ids[select] = top.indices.to(torch.int32)
    topk_logprobs[select] = top.values.to(torch.float16)
    shard = {
        "input_ids": ids.to(torch.int32),
        "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int32),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.int32),
        "topk_ids": topk_ids,
        "topk_logprobs": topk_logprobs,
    }
    for layer in layers:
        shard[f"hidden_l{layer}"] = out.hidden_states[layer].to(torch.float16)
    shard["deep"] = deep.to(torch.float16)
    return {name: tensor.cpu() for name, tensor in shard.items()}  # shards are files (a no-op on the CPU)


def shard_path(directory: Path, split: str, index: int) -> Path:
    return directory / f"{split}-{index:05d}.safetensors"


def build_shards(model, tokenizer, prompts: Sequence[Prompt], directory: Path, split: str, *, layers: Sequence[int],
                 batch_size: int, max_new_tokens: int, top_k: int, eos_ids: set[int], max_prompt_tokens: int = 768,
                 generate: bool = True, first_shard: int = 0) -> list[Path]:
    """Answer and featurise ``prompts`` in shards of ``batch_size``; existing shards are kept (resume).

    ``generate=False`` only collects the shards already written (train on the data so far). ``first_shard`` lets a
    second worker process start further along the same plan (workers never write the same shard concurrently
    unless they meet; shard writes are atomic, so even then nothing breaks).
    """
    directory.mkdir(parents=True, exist_ok=True)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    if not generate:
        return [p for i in range(len(batches)) if (p := shard_path(directory, split, i)).exists()]
    paths = []
    todo = [i for i in range(first_shard, len(batches)) if not shard_path(directory, split, i).exists()]
    bar = tqdm(total=len(batches) - first_shard, initial=len(batches) - first_shard - len(todo), desc=f"self-distill {split}", unit="shard")
    for index in range(first_shard, len(batches)):
        path = shard_path(directory, split, index)
        paths.append(path)
        if path.exists():
            continue
        prompt_ids = [encode_prompt(tokenizer, p)[-max_prompt_tokens:] for p in batches[index]]
        answers = generate_answers(model, tokenizer, prompt_ids, max_new_tokens, eos_ids)
        sequences = [p + a for p, a in zip(prompt_ids, answers)]
        shard = extract_features(model, sequences, [len(p) for p in prompt_ids], layers, top_k)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in shard.items()}, tmp, metadata={"prompt_ids": json.dumps([p.id for p in batches[index]])})
        tmp.replace(path)
        bar.update(1)
    bar.close()
    return paths


def load_shards(paths: Sequence[Path], layer: int) -> Iterator[dict]:
    """Per-sequence records (unpadded) for one exit layer: ids, prompt_length, hidden [n, d], topk ids/logprobs."""
    for path in paths:
        try:
            shard = load_file(path)
        except (SafetensorError, OSError) as exc:
            raise KangarooError(f"feature shard {path} is damaged ({exc}); delete it to recompute it") from None
        key = f"hidden_l{layer}"
        if key not in shard:
            raise KangarooError(f"{path} has no layer-{layer} states (recorded: {sorted(k for k in shard if k.startswith('hidden_l'))})")
        for row in range(shard["lengths"].shape[0]):
            n = int(shard["lengths"][row])
            yield {
                "input_ids": shard["input_ids"][row, :n].long(),
                "prompt_length": int(shard["prompt_lengths"][row]),
                "hidden": shard[key][row, :n],
                "topk_ids": shard["topk_ids"][row, :n].long(),
                "topk_logprobs": shard["topk_logprobs"][row, :n],
                **({"deep": shard["deep"][row, :n]} if "deep" in shard else {}),
            }


def corpus_feature_shards(corpus, model, directory: Path, split: str, *, layers: Sequence[int], top_k: int,
                          batch_size: int = 8, max_prompts: int | None = None, progress: bool = True,
                          matmul_dtype: torch.dtype | None = None, pool=None) -> list[Path]:
    """Recompute hidden states and soft labels from a committed corpus (:mod:`kangaroo_tools.corpus`) by a batched
    teacher-forced pass: one feature shard per ``batch_size`` sequences, under ``directory`` (a cache, never
    committed; existing shards are kept, so an interrupted pass resumes). ``max_prompts`` bounds the split;
    ``matmul_dtype``: see :func:`extract_features` (callers keep such shards in their own directory).

    ``pool`` (a :class:`kangaroo_tools.ray_pool.LazyPool`): the missing shards are computed by its Ray workers (the
    same function on the same model, checked by fingerprint) and written here as they finish."""
    from kangaroo_tools.corpus import read_shard

    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    missing: list[tuple[Path, list]] = []  # (path, records) of the shards to compute, in plan order
    taken = 0
    names = corpus.shard_names(split)
    bar = tqdm(total=max_prompts or sum(corpus.manifest()["shards"][n]["prompts"] for n in names),
               desc=f"features {split}", unit="prompt", disable=not progress)
    for name in names:
        if max_prompts is not None and taken >= max_prompts:
            break
        records = read_shard(corpus.directory / name)
        if max_prompts is not None:
            records = records[: max_prompts - taken]
        taken += len(records)
        records = sorted(records, key=lambda r: len(r.tokens))  # batches of similar lengths: little padding
        stem = name.removesuffix(".safetensors")
        for sub in range(0, len(records), batch_size):
            path = directory / f"{stem}-{sub // batch_size:03d}.safetensors"
            paths.append(path)
            batch = records[sub:sub + batch_size]
            if path.exists():
                bar.update(len(batch))
            else:
                missing.append((path, batch))
    if missing and pool is not None:
        workers = pool.get()
        if workers.model.fingerprint != corpus.manifest()["base_model_fingerprint"]:
            raise KangarooError(f"the Ray workers hold model {workers.model.fingerprint}, not the corpus' base model "
                                f"{corpus.manifest()['base_model_fingerprint']}")
        finished = workers.run(missing, lambda actor, job: actor.features.remote(
            [r.tokens for r in job[1]], [len(r.prompt) for r in job[1]], list(layers), top_k, matmul_dtype),
            name=lambda job: job[0].name)
    else:
        finished = ((job, extract_features(model, [r.tokens for r in job[1]], [len(r.prompt) for r in job[1]], layers,
                                           top_k, matmul_dtype)) for job in missing)
    for (path, batch), shard in finished:
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in shard.items()}, tmp,
                  metadata={"prompt_ids": json.dumps([r.prompt_id for r in batch])})
        tmp.replace(path)
        bar.update(len(batch))
    bar.close()
    return paths
