"""Adapter training by self-distillation (paper §3.3): soft cross-entropy between the target's next-token
distribution and the draft's (or an acceptance-oriented variant), on response tokens, with AdamW and a warm-up +
cosine schedule.

Pipeline (``train_adapter``), each stage resumable inside one work directory:
    1. prompts   seeded sample of the prompt file, split train / held-out       → work/prompts.json
    2. data      the target answers every prompt (or a committed corpus is read), one forward pass records
                 layer-l states, deep states and top-K soft labels             → work/shards|features/*.safetensors
    3. vocab     optional draft vocabulary (--draft-vocab K): the K most frequent answer tokens; training, the
                 draft head (--draft-head) and evaluation use it
    4. train     epochs of AdamW; a deep-context adapter is trained at every draft depth 0..train_depths-1 with
                 the keys it sees there; after each epoch the adapter, optimizer state and metrics are checkpointed
                                                                               → work/checkpoints/<run>/epoch-NNN/
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
from kangaroo_plugins.kangaroo.networks import adapter_class, load_adapter
from kangaroo_policies.threshold import ThresholdPolicy
from kangaroo_tools.features import build_shards, corpus_feature_shards, load_shards, split_prompts
from kangaroo_tools.prompts import read_prompts
from kangaroo_tools.replay import Answer, simulate_policy


#: dtypes of the feature pass's and the training steps' matrix products (bfloat16: autocast)
MATMUL_DTYPES = ("float32", "bfloat16")


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
    adapter_type: str = attrs.field(default="attention", validator=attrs.validators.in_(("attention", "deep-context")))
    draft_head: bool = False  # a trainable head over the draft vocabulary (needs draft_vocab)
    loss: str = attrs.field(default="soft-ce", validator=attrs.validators.in_(("soft-ce", "accept")))
    accept_weight: float = 1.0
    train_depths: int = attrs.field(default=4, validator=_positive_int)  # deep-context: depths 0..train_depths-1
    depth_decay: float = attrs.field(default=0.7, validator=_unit_interval)
    fusion_lr_scale: float = attrs.field(default=0.1, validator=_unit_interval)  # deep-context fusions: lr × this
    feature_weight: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))  # EAGLE's regression to z_q
    prompt_queries: bool = False  # also train on the prompt's positions (the target's labels there; never drafted)
    # the training features' matrix products (held-out features always run in the model's dtype)
    feature_matmuls: str = attrs.field(default="float32", validator=attrs.validators.in_(MATMUL_DTYPES))
    # the training steps' matrix products (autocast; parameters, optimizer and evaluation stay float32)
    train_matmuls: str = attrs.field(default="float32", validator=attrs.validators.in_(MATMUL_DTYPES))
    # a trained adapter directory to start from (same network; "": a fresh, zero-fused adapter)
    init_from: str = ""

    def layers(self) -> list[int]:
        return sorted({self.exit_layer, *self.record_layers})


#: parameters of the deep-context fusions (trained at ``lr * fusion_lr_scale``)
FUSION_PREFIXES = ("kv_fuse.", "query_fuse.", "depth_embedding.")


def warm_start(adapter: KangarooAdapter, directory: str | Path, model, *, base_fingerprint: str,
               exit_layer: int) -> dict:
    """Copy a trained adapter's weights into ``adapter`` (the same network: type, FFN, head kind). A draft head's
    rows carry over token by token, so a larger draft vocabulary keeps every trained row and its new tokens keep
    the rows they were given (the shared head's). Returns what was carried over (for the report)."""
    source = load_adapter(directory, model, base_fingerprint=base_fingerprint, exit_layer=exit_layer)
    shape = lambda a: {k: v for k, v in a.architecture().items() if k != "draft_vocab_size"}
    if type(source) is not type(adapter) or shape(source) != shape(adapter):
        raise KangarooError(f"--init-from {directory}: a {shape(source)} adapter, not the {shape(adapter)} being "
                            "trained")
    state = {k: v for k, v in source.state_dict().items() if k != "draft_rows"}
    missing, unexpected = adapter.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"draft_rows"}, (missing, unexpected)
    carried = 0
    if adapter.draft_head:
        rows_of = {int(t): i for i, t in enumerate(source.draft_vocab.tolist())}
        pairs = [(i, rows_of[t]) for i, t in enumerate(adapter.draft_vocab.tolist()) if t in rows_of]
        carried = len(pairs)
        if pairs:
            new, old = (torch.tensor(x) for x in zip(*pairs))
            with torch.no_grad():
                adapter.draft_rows[new.to(adapter.draft_rows.device)] = source.draft_rows.detach()[old].to(adapter.draft_rows)
    return {"directory": str(Path(directory).resolve()), "draft_rows_carried": carried,
            "draft_rows": 0 if adapter.draft_rows is None else len(adapter.draft_rows)}


# -- loss and metrics ------------------------------------------------------------------------------------------------
def soft_cross_entropy(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of  -Σ_k p_target(k) · log q_draft(k)  with the target's top-K renormalised.

    draft_logits [N, V]; topk_ids [N, K]; topk_logprobs [N, K] (target log-probabilities) → scalar.
    """
    return distillation_loss(draft_logits, topk_ids, topk_logprobs, None, "soft-ce")


def distillation_loss(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                      vocab_index: torch.Tensor | None, loss: str = "soft-ce", accept_weight: float = 1.0) -> torch.Tensor:
    """The training objective on N label rows.

    draft_logits [N, K_d]: over the draft vocabulary (``vocab_index`` [V]: token id → its column, -1 outside) or over
    the whole vocabulary (``vocab_index`` None). The target's top-K (ids [N, K], log-probabilities [N, K]) is
    restricted to the columns and renormalised: p. The draft distribution is q = softmax(draft_logits).

    * ``soft-ce`` (paper Eq. 3): -Σ p log q;
    * ``accept``: soft-ce + ``accept_weight`` · (1 − Σ min(p, q)) — the second term is one minus the probability that
      speculative sampling accepts a draft from q (Leviathan et al.), an acceptance-oriented objective whose
      gradient concentrates on the tokens where q falls short of p.

    Rows whose top-K holds no draft-vocabulary token teach nothing and are skipped.
    """
    columns = topk_ids if vocab_index is None else vocab_index[topk_ids]  # [N, K]
    present = columns >= 0
    useful = present.any(-1)
    if not bool(useful.any()):
        return draft_logits.sum() * 0.0
    columns, present = columns[useful].clamp(min=0), present[useful]
    p = torch.softmax(_wide(topk_logprobs[useful]).masked_fill(~present, float("-inf")), dim=-1)  # [N', K]
    log_q = torch.log_softmax(_wide(draft_logits[useful]), dim=-1).gather(-1, columns)  # [N', K]
    log_q = log_q.masked_fill(~present, 0.0)
    value = -(p * log_q).sum(-1).mean()
    if loss == "accept":
        value = value + accept_weight * (1 - torch.minimum(p, log_q.exp().masked_fill(~present, 0.0)).sum(-1)).mean()
    elif loss != "soft-ce":
        raise KangarooError(f"unknown loss {loss!r} (soft-ce, accept)")
    return value


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32 (half precision upcast for softmaxes and losses; a float64 model's stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# -- batching -------------------------------------------------------------------------------------------------------
def _batches(records: list[dict], batch_size: int, rng: random.Random | None, window: int = 32):
    """Batches in record order (evaluation), or shuffled "sortish" (training): shuffle, sort by length inside
    windows of ``window`` batches, shuffle the batches — random batches with little padding."""
    order = list(range(len(records)))
    if rng is None:
        for i in range(0, len(order), batch_size):
            yield [records[j] for j in order[i:i + batch_size]]
        return
    rng.shuffle(order)
    span = batch_size * window
    length = lambda j: records[j]["hidden"].shape[0]
    order = [j for i in range(0, len(order), span) for j in sorted(order[i:i + span], key=length)]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    for batch in batches:
        yield [records[j] for j in batch]


@attrs.frozen
class Batch:
    """Right-padded records: states [B, T, d], labels [B, T, K]; row q of a sequence predicts its token q + 1."""

    hidden: torch.Tensor
    deep: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    input_ids: torch.Tensor  # [B, T]
    prompt_lengths: list[int]
    lengths: list[int]

    def rows(self, depth: int = 0, prompt: bool = False) -> torch.Tensor:
        """[B, T] bool: the queries a round drafts from at ``depth``: q in [p + depth, n − 2] (the round's first
        token is at p or later; the last token predicts nothing). ``prompt``: every q in [depth + 1, n − 2] (the
        prompt's positions too, as if drafting inside the prompt: extra training rows, never evaluated)."""
        width, device = self.hidden.shape[1], self.hidden.device
        q = torch.arange(width, device=device)[None, :]
        p = torch.tensor(self.prompt_lengths, device=device)[:, None]
        n = torch.tensor(self.lengths, device=device)[:, None]
        first = depth + 1 if prompt else p + depth
        return (q >= first) & (q <= n - 2)


def _collate(batch: list[dict], dtype=torch.float32, deep: bool = False, device=None) -> Batch:
    """Pad the (CPU) records into one batch: states in ``dtype``, soft labels in at least float32, all of it on
    ``device`` (None: the CPU), assembled on the CPU and moved in one copy per tensor."""
    width = max(r["hidden"].shape[0] for r in batch)
    d = batch[0]["hidden"].shape[1]
    k = batch[0]["topk_ids"].shape[1]
    hidden = torch.zeros(len(batch), width, d, dtype=dtype)
    deep_states = torch.zeros(len(batch), width, d, dtype=dtype) if deep else None
    ids = torch.zeros(len(batch), width, k, dtype=torch.long)
    logps = torch.zeros(len(batch), width, k, dtype=torch.promote_types(dtype, torch.float32))
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        n = r["hidden"].shape[0]
        hidden[row, :n] = r["hidden"].to(dtype)
        if deep:
            if "deep" not in r:
                raise KangarooError("the feature shards hold no deep states; delete them to recompute")
            deep_states[row, :n] = r["deep"].to(dtype)
        ids[row, :n], logps[row, :n], tokens[row, :n] = r["topk_ids"], r["topk_logprobs"], r["input_ids"]
    if device is not None and torch.device(device).type != "cpu":
        hidden, ids, logps, tokens = (t.to(device, non_blocking=True) for t in (hidden, ids, logps, tokens))
        deep_states = None if deep_states is None else deep_states.to(device, non_blocking=True)
    return Batch(hidden, deep_states, ids, logps, tokens, [r["prompt_length"] for r in batch],
                 [r["hidden"].shape[0] for r in batch])


def depth_outputs(adapter: KangarooAdapter, batch: Batch, depths: Sequence[int], prompt: bool = False) -> list[torch.Tensor]:
    """The adapter's outputs [B, T, d] at each draft depth (the paper's adapter: one output, every depth alike).
    ``prompt``: the prompt's queries too (else they are skipped: they never draft)."""
    if adapter.reads_deep_states:  # queries from the shortest prompt's last position on (earlier ones never draft)
        first = 0 if prompt else min(batch.prompt_lengths) - 1
        return adapter.forward_depths(batch.hidden, batch.deep, list(depths), first_query=first)
    out = adapter(batch.hidden, 0)
    return [out for _ in depths]


def depth_weights(depths: int, decay: float) -> list[float]:
    """Loss weight of draft depth j: decay**j (how often a round reaches depth j falls about geometrically)."""
    return [decay ** j for j in range(depths)]


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


def vocab_index_of(adapter: KangarooAdapter) -> torch.Tensor | None:
    """token id → column of the training logits (-1 outside the draft vocabulary); None without one."""
    if adapter.draft_vocab is None:
        return None
    device = next(adapter.parameters()).device  # where the batches' label ids are
    index = torch.full((adapter.config.vocab_size,), -1, dtype=torch.long, device=device)
    index[adapter.draft_vocab.to(device)] = torch.arange(len(adapter.draft_vocab), device=device)
    return index


def teacher_forced_answer(record: dict, predicted: torch.Tensor, probs: torch.Tensor, confidence: torch.Tensor,
                          max_new_tokens: int, eos_ids: frozenset[int], depth_predictions: list | None = None) -> Answer:
    """The replay's :class:`~kangaroo_tools.replay.Answer` of one held-out answer from the adapter's teacher-forced
    predictions for its response tokens (row i predicts response token i; the prefill emits token 0, so the draft
    for token k + 1 is row k + 1). No off-path drafts: accepted / emitted counts are exact.

    ``depth_predictions``: for a deep-context adapter, one (predicted, probs, confidence) triple per draft depth j,
    rows as above (rows k + 1 <= j are never drafted at depth j)."""
    answer = record["input_ids"][record["prompt_length"]:].tolist()

    def steps(pred, pr, conf, depth=0):
        return [DraftStep(index=1, token=int(pred[i]), probs=pr[i], confidence=float(conf[i])) if i > depth else None
                for i in range(1, len(answer))]

    prompt = record["input_ids"][: record["prompt_length"]].tolist()
    if depth_predictions is None:
        return Answer("heldout", prompt, answer, steps(predicted, probs, confidence), {}, max_new_tokens, frozenset(eos_ids))
    by_depth = [steps(*triple, depth=j) for j, triple in enumerate(depth_predictions)]
    return Answer("heldout", prompt, answer, by_depth[0], {}, max_new_tokens, frozenset(eos_ids), depth_steps=by_depth)


@torch.no_grad()
def evaluate(adapter: KangarooAdapter, head, records: list[dict], config: TrainConfig, eos_ids=frozenset(),
             answers: list | None = None) -> dict:
    """Held-out loss, teacher-forced top-1 agreement with the target (per draft depth for a deep-context adapter),
    and greedy CR / CTAR(1..gamma) of the threshold policy at (eta, gamma), replayed exactly with the drafting
    pattern of the adapter (:func:`kangaroo_tools.replay.simulate_policy`). ``answers`` collects the replayed
    :class:`~kangaroo_tools.replay.Answer` of each record (for policy sweeps and checks against the engine)."""
    adapter.eval()
    deep = adapter.reads_deep_states
    depths = list(range(config.gamma)) if deep else [0]
    vocab_index = vocab_index_of(adapter)
    losses, agree, total, all_rounds = [], [0] * len(depths), [0] * len(depths), []
    policy = ThresholdPolicy(eta=config.eta)
    for batch_records in _batches(records, config.batch_size, None):
        batch = _collate(batch_records, head.weight.dtype, deep=deep, device=head.weight.device)
        per_depth = []  # per depth: flat over the rows q in [p − 1, n − 2] of each record, in order
        labelled = batch.rows(-1)  # row i of a record ↔ its response token i
        for j, out in zip(depths, depth_outputs(adapter, batch, depths)):
            logits = adapter.train_logits(out[labelled], head)  # [N, K_d]
            rows = batch.rows(j)[labelled]  # the rows a round drafts from at depth j
            if j == 0:
                losses.append(float(distillation_loss(logits[rows], batch.topk_ids[labelled][rows],
                                                      batch.topk_logprobs[labelled][rows], vocab_index)) * int(rows.sum()))
            probs = torch.softmax(_wide(logits), dim=-1)  # what the drafter proposes from (the draft vocabulary)
            confidence, column = probs.max(-1)
            predicted = column if adapter.draft_vocab is None else adapter.draft_vocab.to(column.device)[column]
            agree[j] += int((predicted == batch.topk_ids[labelled][:, 0])[rows].sum())
            total[j] += int(rows.sum())
            # the replay reads them row by row: from the CPU (a no-op there), not one device sync per draft
            per_depth.append((predicted.cpu(), probs.cpu(), confidence.cpu()))
        offset = 0
        for r in batch_records:
            m = r["hidden"].shape[0] - r["prompt_length"]
            triples = [(pr[offset:offset + m], pb[offset:offset + m], cf[offset:offset + m]) for pr, pb, cf in per_depth]
            offset += m
            answer = teacher_forced_answer(r, *triples[0], config.max_new_tokens, eos_ids,
                                           depth_predictions=triples if deep else None)
            all_rounds += simulate_policy(answer, policy, config.gamma)
            if answers is not None:
                answers.append(answer)
    adapter.train()
    summary = metrics.round_summary(all_rounds, config.gamma)
    result = {"loss": sum(losses) / max(total[0], 1), "top1_agreement": agree[0] / max(total[0], 1), "tokens": total[0],
              "rounds": summary["rounds"], "cr": summary["cr"] or 0.0, "ctar": summary["ctar"] or [0.0] * config.gamma}
    if deep:
        result["top1_by_depth"] = [a / max(t, 1) for a, t in zip(agree, total)]
    return result


def training_loss(adapter: KangarooAdapter, head, batch: Batch, config: TrainConfig,
                  vocab_index: torch.Tensor | None) -> torch.Tensor:
    """The weighted loss over the draft depths the adapter is trained at (training-time test: a deep-context
    adapter sees, at depth j, exactly the pattern it meets when drafting the round's (j+1)-th token).

    ``feature_weight`` > 0 adds EAGLE's regression (smooth L1) of the adapter's output at query q to the target's
    deep state z_q there — the state the shared head turns into the target's own distribution; a dense signal
    beside the soft labels (needs deep states in the features)."""
    depths = list(range(config.train_depths)) if adapter.reads_deep_states else [0]
    weights = depth_weights(len(depths), config.depth_decay)
    total = 0.0
    for j, w, out in zip(depths, weights, depth_outputs(adapter, batch, depths, config.prompt_queries)):
        rows = batch.rows(j, config.prompt_queries)
        logits = adapter.train_logits(out[rows], head)
        loss = distillation_loss(logits, batch.topk_ids[rows], batch.topk_logprobs[rows], vocab_index,
                                 config.loss, config.accept_weight)
        if config.feature_weight:
            if batch.deep is None:
                raise KangarooError("the feature shards hold no deep states; delete them to recompute")
            regression = torch.nn.functional.smooth_l1_loss(_wide(out[rows]), _wide(batch.deep[rows]))
            loss = loss + config.feature_weight * regression
        total = total + w * loss
    return total / sum(weights)


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
                  generate: bool = True, corpus=None, progress: bool = True, feature_pool=None) -> dict:
    """Run (or resume) the whole pipeline for ``backend``'s model; returns the training report.

    ``generate=False`` trains on the training shards recorded so far (the held-out shards must exist). With a
    ``corpus`` (:class:`kangaroo_tools.corpus.Corpus`) nothing is generated: its held-out split is the evaluation
    set, its first ``num_prompts`` training answers the training set, and features are recomputed from it — by the
    Ray workers of ``feature_pool`` (a :class:`kangaroo_tools.ray_pool.LazyPool`, closed once the features are
    written) when one is given.
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
        if config.feature_matmuls != "float32":
            raise KangarooError("--feature-matmuls applies to features recomputed from a corpus (--corpus)")
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
    cached = set(work.rglob("*.safetensors"))  # shards a previous run left: the report tells them from computed ones
    shard_kwargs = dict(layers=config.layers(), batch_size=config.generation_batch_size,
                        max_new_tokens=config.max_new_tokens, top_k=config.top_k, eos_ids=set(backend.eos_token_ids))
    if corpus is not None:
        feature_kwargs = dict(layers=config.layers(), top_k=config.top_k, progress=progress, pool=feature_pool)
        try:
            heldout_paths = corpus_feature_shards(corpus, model, work / "features", "heldout", **feature_kwargs)
            fast = config.feature_matmuls != "float32"  # perturbed features: a directory of their own
            train_paths = corpus_feature_shards(corpus, model, work / ("features-" + config.feature_matmuls if fast else "features"),
                                                "train", max_prompts=config.num_prompts,
                                                matmul_dtype=getattr(torch, config.feature_matmuls) if fast else None,
                                                **feature_kwargs)
        finally:
            if feature_pool is not None:
                feature_pool.close()  # the workers' CPUs go back before training starts
    else:
        heldout_paths = build_shards(model, tokenizer, heldout_prompts, work / "shards", "heldout", **shard_kwargs)
        train_paths = build_shards(model, tokenizer, train_prompts, work / "shards", "train", generate=generate,
                                   **shard_kwargs)
    if not train_paths:
        raise KangarooError(f"no training shards in {work / 'shards'} yet")
    timings["data"] = time.perf_counter() - t0
    reused = sum(p in cached for p in [*heldout_paths, *train_paths])
    shard_counts = {"computed": len(heldout_paths) + len(train_paths) - reused, "reused": reused}
    train_records = list(load_shards(train_paths, config.exit_layer))
    heldout_records = list(load_shards(heldout_paths, config.exit_layer))
    count = lambda rs: sum(r["hidden"].shape[0] for r in rs)
    response = lambda rs: sum(r["hidden"].shape[0] - r["prompt_length"] for r in rs)

    # 3. train
    t0 = time.perf_counter()
    head = backend.shared_head()
    device = head.weight.device  # the model's: the adapter (placed like the model), batches and losses live there
    for p in model.parameters():
        p.requires_grad_(False)
    if config.draft_head and not config.draft_vocab:
        raise KangarooError("a draft-vocabulary head (--draft-head) needs a draft vocabulary (--draft-vocab K)")
    network = adapter_class(config.adapter_type)
    adapter = network.from_base_layer(model, config.exit_layer, ffn=config.ffn, separate_head=config.separate_head,
                                      draft_head=config.draft_head)
    # the draft vocabulary (optional) is chosen first: training, confidences and evaluation all use it
    vocab_report = None
    if config.draft_vocab:
        vocab = draft_vocab_from_records(train_records, config.draft_vocab, sorted(backend.eos_token_ids))
        adapter.set_draft_vocab(vocab, head)
        vocab_report = {"size": len(vocab), "heldout_coverage": vocab_coverage(heldout_records, vocab)}
        log(f"draft vocabulary: {len(vocab)} tokens cover {vocab_report['heldout_coverage']:.3f} of held-out answer tokens")
    warm = None
    if config.init_from:
        warm = warm_start(adapter, config.init_from, model, base_fingerprint=backend.fingerprint,
                          exit_layer=config.exit_layer)
        log(f"starting from {config.init_from} ({warm['draft_rows_carried']} of {warm['draft_rows']} draft rows trained)")
    vocab_index = vocab_index_of(adapter)
    adapter.train()
    params = [p for p in adapter.parameters() if p.requires_grad]
    # zero-initialised fusions get a smaller step: Adam's first updates of a zero matrix are rank-one and
    # sign-coherent, so at the adapter's learning rate W·z would swamp the layer-l state and training diverges
    fusion = [p for n, p in adapter.named_parameters() if p.requires_grad and n.startswith(FUSION_PREFIXES)]
    groups = [{"params": [p for p in params if all(p is not f for f in fusion)], "lr": config.lr}]
    if fusion:
        groups.append({"params": fusion, "lr": config.lr * config.fusion_lr_scale})
    # fused: one kernel per step for all parameters (about 5 % of a training step's wall time on this CPU)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay, fused=True)
    steps_per_epoch = math.ceil(len(train_records) / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    warmup = max(1, int(total_steps * config.warmup_fraction))
    schedule = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # one checkpoint series per (training configuration, data): a run with other settings never resumes this one
    trained = attrs.asdict(config)
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
    wants_deep = adapter.reads_deep_states or bool(config.feature_weight)  # the feature loss regresses to z_q
    bf16_steps = config.train_matmuls == "bfloat16"
    for epoch in range(len(history), config.epochs + 1):
        losses = []
        bar = tqdm(_batches(train_records, config.batch_size, rng), total=steps_per_epoch, desc=f"epoch {epoch}/{config.epochs}", unit="batch")
        for batch in bar:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_steps):
                loss = training_loss(adapter, head, _collate(batch, head.weight.dtype, deep=wants_deep, device=device),
                                     config, vocab_index)
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

    final = history[-1]

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
        "device": str(device),
        "data": {"train_prompts": sum(1 for _ in train_records), "heldout_prompts": len(heldout_records),
                 "train_tokens": count(train_records), "train_response_tokens": response(train_records),
                 "heldout_tokens": count(heldout_records), "heldout_response_tokens": response(heldout_records),
                 "shards": shard_counts},
        "wall_seconds": timings,
        "history": history,
        "final": final,
        "draft_vocab": vocab_report,
        "init_from": warm,
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
