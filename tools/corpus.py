"""The self-distilled corpus: the target's own greedy answers to a prompt file, committed compactly in the repo.

Only token ids are stored (prompt and answer of every prompt) with the generation settings and the base model's
fingerprint; hidden states and soft labels are recomputed from it on demand by a batched teacher-forced pass
(:mod:`kangaroo_tools.features`), never committed.

Layout of a corpus directory::

    corpus.json              manifest: format, base model fingerprint, tokenizer/template, generation settings, the
                             split (seed, held-out count), the prompt file's digest and one entry per finished shard
    heldout-00000.safetensors
    train-00000.safetensors  one shard per ``shard_size`` prompts of the seeded plan (see :func:`plan`)
    ...

Shard tensors (B prompts; ids are uint16 when the vocabulary fits, else int32)::

    prompt_ids     [sum of prompt lengths]   the chat-templated prompts, concatenated
    prompt_offsets [B + 1] int64             prompt b is prompt_ids[prompt_offsets[b]:prompt_offsets[b + 1]]
    answer_ids     [sum of answer lengths]   the target's greedy answers (ending at EOS or at the token budget)
    answer_offsets [B + 1] int64

Shard metadata (safetensors string metadata): ``prompts`` — a JSON list of the prompts' ids.

Writing is incremental and resumable: every shard is written atomically (temp file + rename) and then recorded in
the manifest (also atomically), so an interrupted run loses at most the shard in progress and the next run — or
another sitting on another day — extends the same corpus. The held-out shards are generated one prompt at a time
by the engine's own target (exactly the answers ``kangaroo generate --vanilla`` gives, so the held-out CR simulation
is exact); training shards use batched generation for throughput.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicCache, DynamicLayer

from kangaroo_backends.hf_compat import cache_keyword
from kangaroo_core.errors import KangarooError
from kangaroo_core.files import read_json

FORMAT = "kangaroo-corpus"
FORMAT_VERSION = 1
MANIFEST = "corpus.json"
SPLITS = ("heldout", "train")


class CorpusError(KangarooError):
    """A corpus that cannot be used as asked (other base model, other settings, damaged files)."""


@attrs.frozen
class CorpusSettings:
    """Everything that decides the corpus' content; a corpus is only ever extended with the same settings."""

    max_new_tokens: int = 128
    max_prompt_tokens: int = 768
    heldout_prompts: int = 64
    seed: int = 0
    shard_size: int = 64

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class Record:
    """One prompt of the corpus: its id, its token ids and the target's answer."""

    prompt_id: str
    prompt: list[int]
    answer: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.answer


def file_digest(path: Path) -> str:
    """The prompts' digest: of the content, so a gzip-compressed copy of the same prompts extends the same corpus."""
    from kangaroo_tools.prompts import prompts_bytes

    return hashlib.sha256(prompts_bytes(path)).hexdigest()[:16]


def plan(prompt_ids: Sequence[str], settings: CorpusSettings) -> dict[str, list[list[str]]]:
    """The fixed plan: a seeded shuffle; the first ``heldout_prompts`` are held out; the rest are for training, both
    cut into shards of ``shard_size`` in plan order (so every sitting fills the same shards)."""
    order = list(prompt_ids)
    random.Random(settings.seed).shuffle(order)
    if len(order) <= settings.heldout_prompts:
        raise CorpusError(f"need more than {settings.heldout_prompts} prompts to hold {settings.heldout_prompts} out, got {len(order)}")
    split = {"heldout": order[: settings.heldout_prompts], "train": order[settings.heldout_prompts:]}
    size = settings.shard_size
    return {name: [ids[i:i + size] for i in range(0, len(ids), size)] for name, ids in split.items()}


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Corpus:
    """A corpus directory: read its manifest and shards, or extend it."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.manifest_path = self.directory / MANIFEST

    # -- manifest ----------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def manifest(self) -> dict:
        if not self.exists():
            raise CorpusError(f"{self.directory} is not a kangaroo corpus (no {MANIFEST}); build one with `kangaroo corpus build`")
        manifest = read_json(self.manifest_path, CorpusError)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise CorpusError(f"{self.manifest_path}: not a {FORMAT} v{FORMAT_VERSION} manifest")
        if not isinstance(manifest.get("shards"), dict) or not isinstance(manifest.get("base_model_fingerprint"), str):
            raise CorpusError(f"{self.manifest_path}: missing or malformed 'shards' / 'base_model_fingerprint'")
        return manifest

    def check(self, *, fingerprint: str | None = None) -> dict:
        """The manifest, refused in one line when it was made for another base model."""
        manifest = self.manifest()
        if fingerprint is not None and manifest["base_model_fingerprint"] != fingerprint:
            raise CorpusError(
                f"corpus {self.directory} holds answers of base model {manifest['base_model_fingerprint']}, "
                f"not of the loaded model {fingerprint}"
            )
        return manifest

    def _start(self, *, fingerprint: str, model_name: str, prompts_file: Path, settings: CorpusSettings,
               template: str | None) -> dict:
        """Create the manifest, or check that the existing one was made with the same model and settings."""
        identity = {"base_model_fingerprint": fingerprint, "settings": settings.to_dict(),
                    "prompts_digest": file_digest(prompts_file), "chat_template_digest": _digest_text(template)}
        if self.exists():
            manifest = self.manifest()
            for key, value in identity.items():
                if manifest.get(key) != value:
                    raise CorpusError(f"corpus {self.directory} was made with a different {key.replace('_', ' ')} "
                                      f"({manifest.get(key)!r}, now {value!r}); use another directory")
            return manifest
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model_name,
                    "prompts_file": prompts_file.name.removesuffix(".gz"), **identity, "shards": {}}
        _atomic_write_text(self.manifest_path, json.dumps(manifest, indent=1) + "\n")
        return manifest

    def _record_shard(self, manifest: dict, name: str, entry: dict) -> None:
        manifest["shards"][name] = entry
        manifest["shards"] = dict(sorted(manifest["shards"].items()))
        _atomic_write_text(self.manifest_path, json.dumps(manifest, indent=1) + "\n")

    # -- reading -----------------------------------------------------------------------------------------------
    def shard_names(self, split: str) -> list[str]:
        return [name for name in self.manifest()["shards"] if name.startswith(f"{split}-")]

    def records(self, split: str, *, limit: int | None = None) -> Iterator[Record]:
        """The records of one split in plan order (``limit``: at most that many prompts)."""
        if split not in SPLITS:
            raise CorpusError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        count = 0
        for name in self.shard_names(split):
            for record in read_shard(self.directory / name):
                if limit is not None and count >= limit:
                    return
                count += 1
                yield record

    def summary(self) -> dict:
        manifest = self.manifest()
        out = {"directory": str(self.directory), "base_model_fingerprint": manifest["base_model_fingerprint"],
               "settings": manifest["settings"]}
        for split in SPLITS:
            entries = [e for n, e in manifest["shards"].items() if n.startswith(f"{split}-")]
            if not all(isinstance(e, dict) and {"prompts", "prompt_tokens", "answer_tokens", "seconds"} <= set(e)
                       for e in entries):
                raise CorpusError(f"{self.manifest_path}: a {split} shard entry lacks its counts")
            out[split] = {"shards": len(entries), "prompts": sum(e["prompts"] for e in entries),
                          "prompt_tokens": sum(e["prompt_tokens"] for e in entries),
                          "answer_tokens": sum(e["answer_tokens"] for e in entries),
                          "generation_seconds": round(sum(e["seconds"] for e in entries), 1)}
        return out


def prompt_template(tokenizer) -> str:
    """What decides how prompts are written: the chat template, or the plain form for a model without one."""
    from kangaroo_core.engine import PLAIN_QUESTION

    return getattr(tokenizer, "chat_template", None) or f"plain: {PLAIN_QUESTION}"


def _digest_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _flat(seqs: Sequence[Sequence[int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    return flat.to(dtype), lengths.cumsum(0)


def write_shard(path: Path, records: Sequence[Record], vocab_size: int) -> None:
    """One shard, atomically."""
    dtype = torch.uint16 if vocab_size <= 65536 else torch.int32
    prompt_ids, prompt_offsets = _flat([r.prompt for r in records], dtype)
    answer_ids, answer_offsets = _flat([r.answer for r in records], dtype)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"prompt_ids": prompt_ids, "prompt_offsets": prompt_offsets, "answer_ids": answer_ids,
               "answer_offsets": answer_offsets}, tmp, metadata={"prompts": json.dumps([r.prompt_id for r in records])})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its file 0600; a shard is as readable as any file here
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_shard(path: Path) -> list[Record]:
    try:
        tensors = load_file(path)
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            ids = json.loads((handle.metadata() or {})["prompts"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise CorpusError(f"corpus shard {path} is damaged or not a corpus shard: {exc}") from None
    try:
        p_ids, p_off = tensors["prompt_ids"].to(torch.int64).tolist(), tensors["prompt_offsets"].tolist()
        a_ids, a_off = tensors["answer_ids"].to(torch.int64).tolist(), tensors["answer_offsets"].tolist()
    except KeyError as exc:
        raise CorpusError(f"corpus shard {path} lacks tensor {exc}") from None
    if not (len(ids) + 1 == len(p_off) == len(a_off)):
        raise CorpusError(f"corpus shard {path}: {len(ids)} prompt ids but {len(p_off) - 1} prompts stored")
    return [Record(pid, p_ids[p_off[b]:p_off[b + 1]], a_ids[a_off[b]:a_off[b + 1]]) for b, pid in enumerate(ids)]


# -- generation ------------------------------------------------------------------------------------------------------
class _PreallocatedLayer(DynamicLayer):
    """transformers' full-attention cache layer over one buffer sized for the whole answer.

    ``DynamicLayer`` concatenates the past with every new token (a copy of the whole past per layer and step); this
    writes the new keys/values into place and hands attention a view of the filled part, the same values in the same
    order, so the answers are unchanged (a few per cent more tokens/s at batch 8 on SmolLM2, docs/training.md).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        # (transformers 4.x passes the keys only, 5.x the keys and values)
        batch, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = key_states.new_empty(batch, heads, self.capacity, dim)
        self._values = key_states.new_empty(batch, heads, self.capacity, dim)
        self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # 4.x: cache_kwargs; 5.x: kwargs=
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if end > self.capacity:
            raise CorpusError(f"generation ran past its preallocated cache ({end} > {self.capacity} positions)")
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """transformers' default cache for ``config`` with every full-attention layer preallocated for ``capacity``
    positions (sliding-window layers keep transformers' own layer, which trims itself)."""
    cache = DynamicCache(config=config)
    cache.layers = [_PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.inference_mode()
def batched_greedy_answers(model, prompt_ids: Sequence[list[int]], max_new_tokens: int, eos_ids: frozenset[int],
                           batch_size: int) -> list[list[int]]:
    """Greedy answers with transformers' batched ``generate`` (left padding, a preallocated cache); prompts of
    similar length are batched together so little is padded. Each answer is cut after its first EOS."""
    pad = min(eos_ids) if eos_ids else 0
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    answers: dict[int, list[int]] = {}
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = max(len(prompt_ids[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            seq = prompt_ids[i]
            ids[r, width - len(seq):] = torch.tensor(seq)
            mask[r, width - len(seq):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)  # the cache follows the keys (device and dtype)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                             eos_token_id=sorted(eos_ids) or None,
                             **{cache_keyword(model): preallocated_cache(model.config, width + max_new_tokens)})
        for r, i in enumerate(rows):
            row = out[r, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            answers[i] = row[:cut]
    return [answers[i] for i in range(len(prompt_ids))]


def engine_greedy_answers(engine, prompt_ids: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers one prompt at a time with the engine's target alone (exactly what ``--vanilla`` emits)."""
    return [engine.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids for ids in prompt_ids]


@attrs.frozen
class ShardJob:
    """One shard of the plan to answer: its split, its index and its prompts in plan order."""

    split: str
    index: int
    prompts: tuple  # of kangaroo_tools.prompts.Prompt

    @property
    def name(self) -> str:
        return shard_name(self.split, self.index)


@attrs.frozen
class ModelFacts:
    """What a corpus records of the model that answers it (also what each remote worker reports of the model it
    loaded, so a worker with another model is refused before anything is written)."""

    fingerprint: str
    model_name: str
    template: str
    vocab_size: int

    @classmethod
    def of(cls, backend) -> "ModelFacts":
        return cls(backend.fingerprint, str(backend.model_name), prompt_template(backend.tokenizer), backend.vocab_size)


def pending(corpus: Corpus, prompts_file: str | Path, settings: CorpusSettings, facts: ModelFacts, *,
            max_train_shards: int | None = None, splits: Sequence[str] = SPLITS, log=print) -> tuple[dict, list[ShardJob]]:
    """The manifest (created, or checked against ``facts`` and ``settings``) and the shards it still lacks, held-out
    first, in plan order (``max_train_shards``: at most that many training shards)."""
    from kangaroo_tools.prompts import read_prompts

    prompts_file = Path(prompts_file)
    prompts = {p.id: p for p in read_prompts(prompts_file, warn=log)}
    manifest = corpus._start(fingerprint=facts.fingerprint, model_name=facts.model_name, prompts_file=prompts_file,
                             settings=settings, template=facts.template)
    layout = plan(list(prompts), settings)
    todo = [ShardJob(split, i, tuple(prompts[pid] for pid in ids)) for split in splits
            for i, ids in enumerate(layout[split]) if shard_name(split, i) not in manifest["shards"]]
    if max_train_shards is not None:
        train = [job for job in todo if job.split == "train"][:max_train_shards]
        todo = [job for job in todo if job.split != "train"] + train
    return manifest, todo


def answer_shard(engine, job: ShardJob, settings: CorpusSettings, batch_size: int = 8) -> tuple[list[Record], dict]:
    """The target's answers to one shard's prompts, and the shard's manifest entry. The same function answers in
    process and on a remote worker, so a shard's answers do not depend on where it ran."""
    from kangaroo_tools.prompts import encode_prompt

    backend = engine.backend
    t0 = time.perf_counter()
    prompt_ids = [encode_prompt(backend.tokenizer, prompt)[-settings.max_prompt_tokens:] for prompt in job.prompts]
    if job.split == "heldout":
        answers = engine_greedy_answers(engine, prompt_ids, settings.max_new_tokens)
    else:
        answers = batched_greedy_answers(backend.base_model(), prompt_ids, settings.max_new_tokens,
                                         backend.eos_token_ids, batch_size)
    seconds = time.perf_counter() - t0
    records = [Record(prompt.id, p, a) for prompt, p, a in zip(job.prompts, prompt_ids, answers)]
    answer_tokens = sum(len(a) for a in answers)
    entry = {
        "prompts": len(records), "prompt_tokens": sum(len(p) for p in prompt_ids), "answer_tokens": answer_tokens,
        "seconds": round(seconds, 2), "answer_tokens_per_second": round(answer_tokens / seconds, 2),
        "generator": "engine" if job.split == "heldout" else f"hf-generate-batch{batch_size}-preallocated",
        "threads": torch.get_num_threads(),
        "device": str(backend.base_model().device),  # a GPU's greedy answers may part from the CPU's at near-ties
    }
    return records, entry


def save_shard(corpus: Corpus, manifest: dict, job: ShardJob, records: Sequence[Record], entry: dict,
               vocab_size: int) -> None:
    """Write a finished shard atomically, then record it in the manifest (also atomically): only the process that
    owns the manifest calls this, so no shard is written twice."""
    write_shard(corpus.directory / job.name, records, vocab_size)
    corpus._record_shard(manifest, job.name, entry)


def build(corpus: Corpus, engine, prompts_file: str | Path, settings: CorpusSettings = CorpusSettings(), *,
          max_train_shards: int | None = None, batch_size: int = 8, deadline: float | None = None,
          progress: bool = True, log=print, splits: Sequence[str] = SPLITS) -> dict:
    """Fill the corpus' missing shards (held-out first), in plan order; returns :meth:`Corpus.summary`.

    ``engine`` is an :class:`~kangaroo_core.engine.Engine` of the target alone (``drafter=None``) on the torch
    backend. ``max_train_shards`` / ``deadline`` (a ``time.time()`` value) bound one sitting; finished shards stay.
    (:mod:`kangaroo_tools.corpus_ray` answers the same shards on a pool of Ray workers.)
    """
    from tqdm.auto import tqdm

    facts = ModelFacts.of(engine.backend)
    manifest, todo = pending(corpus, prompts_file, settings, facts, max_train_shards=max_train_shards, splits=splits,
                             log=log)
    bar = tqdm(total=len(todo), desc="corpus shards", unit="shard", disable=not progress)
    for job in todo:
        if deadline is not None and time.time() > deadline:
            log("deadline reached; the corpus keeps every finished shard")
            break
        records, entry = answer_shard(engine, job, settings, batch_size)
        save_shard(corpus, manifest, job, records, entry, facts.vocab_size)
        bar.update(1)
        bar.set_postfix(tok_s=f"{entry['answer_tokens_per_second']:.1f}")
    bar.close()
    return corpus.summary()
