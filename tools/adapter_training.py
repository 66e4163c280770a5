"""Adapter training by self-distillation (paper §3.3): soft cross-entropy between the target's next-token
distribution and the draft's, on response tokens, with AdamW and a warm-up + cosine schedule.

Pipeline (``train_adapter``), each stage resumable inside one work directory:
    1. prompts   seeded sample of the prompt file, split train / held-out       → work/prompts.json
    2. data      the target answers every prompt, one forward pass records
                 layer-l states and top-K soft labels                          → work/shards/*.safetensors
    3. train     epochs of AdamW; after each epoch the adapter, optimizer state and metrics are checkpointed
                                                                               → work/checkpoints/epoch-NNN/
    4. vocab     optional draft vocabulary (--draft-vocab K): the K most frequent answer tokens
    5. report    adapter directory + training_report.json + training_curves.png → out/
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from kangaroo_core import metrics
from kangaroo_core.config import _non_negative_int, _positive_int, _unit_interval
from kangaroo_core.errors import KangarooError
from kangaroo_core.results import DraftStep
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_policies.threshold import ThresholdPolicy
from kangaroo_tools.features import build_shards, corpus_feature_shards, load_shards, split_prompts
from kangaroo_tools.prompts import read_prompts
from kangaroo_tools.replay import Answer, simulate_policy


@attrs.frozen
class TrainConfig:
    """Everything that determines a training run (recorded in the report)."""

    exit_layer: int = attrs.field(default=2, validator=_positive_int)
    num_prompts: int = attrs.field(default=640, validator=_positive_int)
    heldout_prompts: int = attrs.field(default=64, validator=_positive_int)
    max_new_tokens: int = attrs.field(default=128, validator=_positive_int)
    generation_batch_size: int = attrs.field(default=16, validator=_positive_int)
    top_k: int = attrs.field(default=32, validator=_positive_int)
    epochs: int = attrs.field(default=4, validator=_positive_int)
    batch_size: int = attrs.field(default=8, validator=_positive_int)
    lr: float = attrs.field(default=1e-3)
    warmup_fraction: float = attrs.field(default=0.05, validator=_unit_interval)
    weight_decay: float = attrs.field(default=0.0)
    grad_clip: float = attrs.field(default=1.0)
    ffn: bool = False
    separate_head: bool = False
    eta: float = attrs.field(default=0.6, validator=_unit_interval)
    gamma: int = attrs.field(default=6, validator=_positive_int)
    seed: int = 0
    record_layers: tuple = attrs.field(default=(), converter=tuple)  # extra layers to record for the l sweep
    draft_vocab: int = attrs.field(default=0, validator=_non_negative_int)  # 0: draft over the whole vocabulary

    def layers(self) -> list[int]:
        return sorted({self.exit_layer, *self.record_layers})


# -- loss and metrics ------------------------------------------------------------------------------------------------
def soft_cross_entropy(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of  -Σ_k p_target(k) · log q_draft(k)  with the target's top-K renormalised.

    draft_logits [N, V]; topk_ids [N, K]; topk_logprobs [N, K] (target log-probabilities) → scalar.
    """
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)  # [N, V]
    p = torch.softmax(topk_logprobs.float(), dim=-1)  # [N, K], renormalised over the K kept entries
    return -(p * log_q.gather(-1, topk_ids)).sum(-1).mean()


# -- batching -------------------------------------------------------------------------------------------------------
def _batches(records: list[dict], batch_size: int, rng: random.Random | None):
    order = list(range(len(records)))
    if rng is not None:
        rng.shuffle(order)
    for i in range(0, len(order), batch_size):
        yield [records[j] for j in order[i:i + batch_size]]


def _collate(batch: list[dict], dtype=torch.float32):
    width = max(r["hidden"].shape[0] for r in batch)
    d = batch[0]["hidden"].shape[1]
    hidden = torch.zeros(len(batch), width, d, dtype=dtype)
    select = torch.zeros(len(batch), width, dtype=torch.bool)  # positions whose next token is a response token
    ids, logps, targets = [], [], []
    for row, r in enumerate(batch):
        n, p = r["hidden"].shape[0], r["prompt_length"]
        hidden[row, :n] = r["hidden"].to(dtype)
        select[row, p - 1 : n - 1] = True
        ids.append(r["topk_ids"][p - 1 : n - 1])
        logps.append(r["topk_logprobs"][p - 1 : n - 1])
        targets.append(r["input_ids"][p:n])
    return hidden, select, torch.cat(ids), torch.cat(logps), torch.cat(targets)


def _draft_logits(adapter: KangarooAdapter, head, hidden: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    out = adapter(hidden, 0)  # [B, T, d]
    return adapter.full_logits(out[select], head)  # [N, V]: training and the loss always see every token


def draft_vocab_from_records(records: Sequence[dict], size: int, always: Sequence[int] = ()) -> list[int]:
    """The ``size`` tokens the target emits most often in its own answers (response tokens; ties by id), plus
    ``always`` (EOS): the draft vocabulary. Frequency-ranked, as FR-Spec does for draft heads."""
    counts: dict[int, int] = {}
    for r in records:
        for token in r["input_ids"][r["prompt_length"]:].tolist():
            counts[token] = counts.get(token, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(set(ranked) | set(always))


def vocab_coverage(records: Sequence[dict], vocab: Sequence[int]) -> float:
    """Share of response tokens inside ``vocab`` (the ceiling on draft accuracy it leaves)."""
    keep = set(vocab)
    tokens = [t for r in records for t in r["input_ids"][r["prompt_length"]:].tolist()]
    return sum(t in keep for t in tokens) / max(len(tokens), 1)


def teacher_forced_answer(record: dict, predicted: torch.Tensor, probs: torch.Tensor, confidence: torch.Tensor,
                          max_new_tokens: int, eos_ids: frozenset[int]) -> Answer:
    """The replay's :class:`~kangaroo_tools.replay.Answer` of one held-out answer from the adapter's teacher-forced
    predictions for its response tokens (row i predicts response token i; the prefill emits token 0, so the draft
    for token k + 1 is row k + 1). No off-path drafts: accepted / emitted counts are exact."""
    answer = record["input_ids"][record["prompt_length"]:].tolist()
    steps = [DraftStep(index=1, token=int(predicted[i]), probs=probs[i], confidence=float(confidence[i]))
             for i in range(1, len(answer))]
    prompt = record["input_ids"][: record["prompt_length"]].tolist()
    return Answer("heldout", prompt, answer, steps, {}, max_new_tokens, frozenset(eos_ids))


@torch.no_grad()
def evaluate(adapter: KangarooAdapter, head, records: list[dict], config: TrainConfig, eos_ids=frozenset()) -> dict:
    """Held-out loss, teacher-forced top-1 agreement with the target, and greedy CR / CTAR(1..gamma) of the
    threshold policy at (eta, gamma), replayed exactly (:func:`kangaroo_tools.replay.simulate_policy`)."""
    adapter.eval()
    losses, agree, total, all_rounds = [], 0, 0, []
    policy = ThresholdPolicy(eta=config.eta)
    for batch in _batches(records, config.batch_size, None):
        hidden, select, topk_ids, topk_logps, targets = _collate(batch, head.weight.dtype)
        logits = _draft_logits(adapter, head, hidden, select)
        losses.append(float(soft_cross_entropy(logits, topk_ids, topk_logps)) * len(targets))
        probs = torch.softmax(adapter.restrict(logits).float(), dim=-1)  # what the drafter proposes from
        confidence, predicted = probs.max(-1)
        target_top1 = topk_ids[:, 0]
        agree += int((predicted == target_top1).sum())
        total += len(targets)
        offset = 0
        for r in batch:
            n = r["hidden"].shape[0] - r["prompt_length"]
            rows = slice(offset, offset + n)
            offset += n
            answer = teacher_forced_answer(r, predicted[rows], probs[rows], confidence[rows], config.max_new_tokens, eos_ids)
            all_rounds += simulate_policy(answer, policy, config.gamma)
    adapter.train()
    summary = metrics.round_summary(all_rounds, config.gamma)
    return {"loss": sum(losses) / max(total, 1), "top1_agreement": agree / max(total, 1), "tokens": total,
            "rounds": summary["rounds"], "cr": summary["cr"] or 0.0, "ctar": summary["ctar"] or [0.0] * config.gamma}


# -- checkpoints ----------------------------------------------------------------------------------------------------
def _save_checkpoint(directory: Path, adapter, optimizer, scheduler, history: list[dict]) -> None:
    tmp = directory.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.state_dict().items() if "rotary_emb" not in k}, tmp / "adapter.safetensors")
    state = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": state["param_groups"], "scheduler": scheduler.state_dict(), "history": history, "state": {}}
    for pid, entry in state["state"].items():
        meta["state"][str(pid)] = {}
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{name}"] = value.contiguous()
            else:
                meta["state"][str(pid)][name] = value
    save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps(meta))
    tmp.replace(directory)


def _load_checkpoint(directory: Path, adapter, optimizer, scheduler) -> list[dict]:
    adapter.load_state_dict(load_file(directory / "adapter.safetensors"), strict=False)
    meta = json.loads((directory / "state.json").read_text())
    tensors = load_file(directory / "optimizer.safetensors")
    state = {int(pid): dict(entries) for pid, entries in meta["state"].items()}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict(meta["scheduler"])
    return meta["history"]


def _latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("epoch-*") if p.is_dir() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


# -- the pipeline ---------------------------------------------------------------------------------------------------
def train_adapter(backend, prompts_file: str | Path | None, work_dir: str | Path, out_dir: str | Path,
                  config: TrainConfig, *, command_line: str = "", log=lambda m: print(m, file=sys.stderr),
                  generate: bool = True, corpus=None, progress: bool = True) -> dict:
    """Run (or resume) the whole pipeline for ``backend``'s model; returns the training report.

    ``generate=False`` trains on the training shards recorded so far (the held-out shards must exist). With a
    ``corpus`` (:class:`kangaroo_tools.corpus.Corpus`) nothing is generated: its held-out split is the evaluation
    set, its first ``num_prompts`` training answers the training set, and features are recomputed from it.
    """
    if not 1 <= config.exit_layer < backend.num_layers:
        raise KangarooError(f"exit_layer must be in [1, {backend.num_layers - 1}], got {config.exit_layer}")
    work, out = Path(work_dir), Path(out_dir)
    if corpus is not None:
        manifest = corpus.check(fingerprint=backend.fingerprint)  # another base model's answers: refused in one line
        # the held-out replay's token budget is the one the answers were generated with
        config = attrs.evolve(config, max_new_tokens=manifest["settings"]["max_new_tokens"])
        prompts = None
    else:
        prompts = read_prompts(prompts_file, warn=log)  # a file without usable prompts is refused before anything is made
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = backend.base_model(), backend.tokenizer
    torch.manual_seed(config.seed)
    timings = {}

    # 1. prompts
    t0 = time.perf_counter()
    plan_path = work / "prompts.json"
    source = {"corpus": str(Path(corpus.directory).resolve())} if corpus is not None else {
        "prompts_file": str(Path(prompts_file).resolve()), "heldout_prompts": config.heldout_prompts,
        "seed": config.seed, "max_new_tokens": config.max_new_tokens,
        "generation_batch_size": config.generation_batch_size}
    plan_key = {**source, "top_k": config.top_k, "layers": config.layers(), "fingerprint": backend.fingerprint}
    if prompts is not None:
        train_prompts, heldout_prompts = split_prompts(prompts, config.num_prompts, config.heldout_prompts, config.seed)
    if plan_path.exists() and json.loads(plan_path.read_text()).get("key") != plan_key:
        raise KangarooError(f"{work} holds data of another configuration; use a new --work-dir")
    plan_path.write_text(json.dumps({"key": plan_key}))
    timings["prompts"] = time.perf_counter() - t0

    # 2. data: self-distilled answers + features
    t0 = time.perf_counter()
    shard_kwargs = dict(layers=config.layers(), batch_size=config.generation_batch_size,
                        max_new_tokens=config.max_new_tokens, top_k=config.top_k, eos_ids=set(backend.eos_token_ids))
    if corpus is not None:
        feature_kwargs = dict(layers=config.layers(), top_k=config.top_k, progress=progress)
        heldout_paths = corpus_feature_shards(corpus, model, work / "features", "heldout", **feature_kwargs)
        train_paths = corpus_feature_shards(corpus, model, work / "features", "train", max_prompts=config.num_prompts,
                                            **feature_kwargs)
    else:
        heldout_paths = build_shards(model, tokenizer, heldout_prompts, work / "shards", "heldout", **shard_kwargs)
        train_paths = build_shards(model, tokenizer, train_prompts, work / "shards", "train", generate=generate,
                                   **shard_kwargs)
    if not train_paths:
        raise KangarooError(f"no training shards in {work / 'shards'} yet")
    timings["data"] = time.perf_counter() - t0
    train_records = list(load_shards(train_paths, config.exit_layer))
    heldout_records = list(load_shards(heldout_paths, config.exit_layer))
    count = lambda rs: sum(r["hidden"].shape[0] for r in rs)
    response = lambda rs: sum(r["hidden"].shape[0] - r["prompt_length"] for r in rs)

    # 3. train
    t0 = time.perf_counter()
    head = backend.shared_head()
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = KangarooAdapter.from_base_layer(model, config.exit_layer, ffn=config.ffn, separate_head=config.separate_head)
    adapter.train()
    params = [p for p in adapter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(train_records) / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    warmup = max(1, int(total_steps * config.warmup_fraction))
    schedule = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # one checkpoint series per (training configuration, data): a run with other settings never resumes this one
    # (the draft vocabulary is chosen after training, so it does not start a new series)
    trained = {k: v for k, v in attrs.asdict(config).items() if k != "draft_vocab"}
    run_key = json.dumps({**trained, "train_shards": [p.name for p in train_paths]}, sort_keys=True)
    checkpoints = work / "checkpoints" / hashlib.sha256(run_key.encode()).hexdigest()[:16]
    checkpoints.mkdir(parents=True, exist_ok=True)
    history: list[dict] = []
    latest = _latest_checkpoint(checkpoints)
    if latest is not None:
        history = _load_checkpoint(latest, adapter, optimizer, scheduler)
        log(f"resuming after {latest.name}")
    else:
        history.append({"epoch": 0, "train_loss": None, **evaluate(adapter, head, heldout_records, config, backend.eos_token_ids)})
    rng = random.Random(config.seed)
    for _ in range(len(history) - 1):  # replay the shuffles of finished epochs so a resumed run is the same run
        list(_batches(train_records, config.batch_size, rng))
    for epoch in range(len(history), config.epochs + 1):
        losses = []
        bar = tqdm(_batches(train_records, config.batch_size, rng), total=steps_per_epoch, desc=f"epoch {epoch}/{config.epochs}", unit="batch")
        for batch in bar:
            hidden, select, topk_ids, topk_logps, _ = _collate(batch, head.weight.dtype)
            loss = soft_cross_entropy(_draft_logits(adapter, head, hidden, select), topk_ids, topk_logps)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        metrics = evaluate(adapter, head, heldout_records, config, backend.eos_token_ids)
        history.append({"epoch": epoch, "train_loss": sum(losses) / len(losses), **metrics})
        log(f"epoch {epoch}: train loss {history[-1]['train_loss']:.3f}, held-out loss {metrics['loss']:.3f}, "
            f"top-1 agreement {metrics['top1_agreement']:.3f}, CR {metrics['cr']:.3f}")
        _save_checkpoint(checkpoints / f"epoch-{epoch:03d}", adapter, optimizer, scheduler, history)
    timings["train"] = time.perf_counter() - t0

    # 4. the draft vocabulary (optional): the most frequent answer tokens; final metrics are measured with it
    final = history[-1]
    vocab_report = None
    if config.draft_vocab:
        vocab = draft_vocab_from_records(train_records, config.draft_vocab, sorted(backend.eos_token_ids))
        adapter.set_draft_vocab(vocab)
        final = {"epoch": config.epochs, "train_loss": history[-1]["train_loss"],
                 **evaluate(adapter, head, heldout_records, config, backend.eos_token_ids)}
        vocab_report = {"size": len(vocab), "heldout_coverage": vocab_coverage(heldout_records, vocab),
                        "full_vocabulary": {k: history[-1][k] for k in ("top1_agreement", "cr", "ctar")}}
        log(f"draft vocabulary: {len(vocab)} tokens cover {vocab_report['heldout_coverage']:.3f} of held-out answer "
            f"tokens; top-1 agreement {final['top1_agreement']:.3f}, CR {final['cr']:.3f}")

    # 5. report
    out.mkdir(parents=True, exist_ok=True)
    adapter.save(out, base_fingerprint=backend.fingerprint, exit_layer=config.exit_layer,
                 extra={"training": {"epochs": config.epochs, "heldout_top1_agreement": final["top1_agreement"],
                                     "heldout_cr": final["cr"]}})
    report = {
        "command_line": command_line,
        "config": attrs.asdict(config),
        "model": backend.model_name,
        "base_model_fingerprint": backend.fingerprint,
        "data": {"train_prompts": sum(1 for _ in train_records), "heldout_prompts": len(heldout_records),
                 "train_tokens": count(train_records), "train_response_tokens": response(train_records),
                 "heldout_tokens": count(heldout_records), "heldout_response_tokens": response(heldout_records)},
        "wall_seconds": timings,
        "history": history,
        "final": final,
        "draft_vocab": vocab_report,
        "adapter_parameters": sum(p.numel() for p in adapter.parameters()),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_history(history, out / "training_curves.png")
    return report


def plot_history(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    train = [(h["epoch"], h["train_loss"]) for h in history if h["train_loss"] is not None]
    if train:
        ax1.plot(*zip(*train), marker="o", label="train")
    ax1.plot(epochs, [h["loss"] for h in history], marker="o", label="held-out")
    ax1.set(xlabel="epoch", ylabel="soft cross-entropy", title="loss")
    ax1.legend()
    ax2.plot(epochs, [h["top1_agreement"] for h in history], marker="o", label="top-1 agreement")
    ax2.plot(epochs, [h["cr"] - 1 for h in history], marker="s", label="CR − 1 (greedy, eta, gamma)")
    ax2.set(xlabel="epoch", title="held-out")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
