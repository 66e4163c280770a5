"""Adapter training pipeline on a tiny random Llama (fast): data, resume, loss, metrics, files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import save_tiny_model
from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.errors import AdapterMismatchError, KangarooError
from kangaroo_tools import features as distill
from kangaroo_tools import prompts as prompt_files
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_plugins.kangaroo.networks import load_adapter
from kangaroo_tools.adapter_training import TrainConfig, soft_cross_entropy, teacher_forced_answer, train_adapter
from kangaroo_tools.replay import Answer, simulate_policy
from kangaroo_policies.threshold import ThresholdPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "the sky is blue why the sea is green tell me a story about the cat and the dog over the night".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("train-model"), layers=3, hidden=32, max_positions=256, dtype=torch.float64)


@pytest.fixture(scope="module")
def backend(model_dir):
    return TorchBackend.create(DecodeConfig(exit_layer=1), model=str(model_dir), dtype="float64")


def write_prompts(path, n=20, malformed=True):
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(5)), "category": "chat"}) + "\n")
        if malformed:
            f.write("{not json\n")
            f.write(json.dumps({"id": "x", "prompt": ""}) + "\n")
            f.write(json.dumps({"conversations": [{"from": "human", "value": "tell me about the sea"}]}) + "\n")
    return path


CONFIG = TrainConfig(exit_layer=1, num_prompts=16, heldout_prompts=4, max_new_tokens=12, generation_batch_size=4,
                     top_k=8, epochs=3, batch_size=4, lr=3e-3, record_layers=(2,))


def test_read_prompts_reports_malformed_lines_with_numbers(tmp_path):
    warnings = []
    prompts = prompt_files.read_prompts(write_prompts(tmp_path / "p.jsonl"), warn=warnings.append)
    assert len(prompts) == 21  # 20 prompts + the ShareGPT conversation
    assert [w.split(":")[1] for w in warnings] == ["21", "22"]
    with pytest.raises(KangarooError, match="not found"):
        prompt_files.read_prompts(tmp_path / "missing.jsonl")


def test_split_is_prefix_stable():
    prompts = [prompt_files.Prompt(str(i), (("user", "x"),)) for i in range(50)]
    small_train, held = distill.split_prompts(prompts, 10, 5, seed=3)
    big_train, held2 = distill.split_prompts(prompts, 30, 5, seed=3)
    assert held == held2 and big_train[:10] == small_train and not set(held) & set(big_train)


def test_soft_cross_entropy_matches_a_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    ids = torch.tensor([[1, 0]])
    target_logp = torch.log(torch.tensor([[0.6, 0.2]]))  # renormalised to 0.75 / 0.25
    log_q = logits - math.log(sum(math.exp(v) for v in (1.0, 2.0, 0.0, -1.0)))
    expected = -(0.75 * float(log_q[0, 1]) + 0.25 * float(log_q[0, 0]))
    assert float(soft_cross_entropy(logits, ids, target_logp)) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "correct, confidence, eta, gamma, expected",
    [
        ([True] * 7, [0.9] * 7, 0.6, 6, [6]),  # gamma caps the round; the target emits token 6
        ([True, True, False, True], [0.9, 0.5, 0.9, 0.9], 0.6, 6, [2, 1]),  # stop after a low-confidence draft
        ([False, True, True], [0.9] * 3, 0.6, 6, [0, 2]),
        ([True, False, True, True, True], [0.9] * 5, 0.0, 2, [1, 2]),
        ([True] * 8, [0.9] * 8, 0.0, 3, [3, 3]),
        ([True] * 3, [0.9] * 3, 0.0, 6, [3]),
        ([], [], 0.6, 6, []),
    ],
)
def test_simulated_rounds(correct, confidence, eta, gamma, expected):
    assert replayed(correct, confidence, eta, gamma) == expected


def test_simulated_rounds_leave_the_budgets_last_token_to_the_target():
    assert replayed([True] * 3, [0.9] * 3, 0.0, 6, budget_limited=True) == [2]


def replayed(correct, confidence, eta, gamma, budget_limited=False):
    """Accepted drafts per round of the shared replay on an answer whose drafts are right where ``correct`` says."""
    from kangaroo_apps.testing import make_draft_step

    answer = [10 + j for j in range(len(correct) + 1)]
    steps = []
    for k, (ok, c) in enumerate(zip(correct, confidence)):
        token = answer[k + 1] if ok else 2
        probs = [(1 - c) / 39] * 40
        probs[token] = c
        steps.append(make_draft_step(probs))
    budget = len(answer) if budget_limited else len(answer) + 10
    rounds = simulate_policy(Answer("t", [1], answer, steps, {}, budget), ThresholdPolicy(eta=eta), gamma)
    return [r.accepted for r in rounds]


def test_pipeline_resumes_after_interruption_at_each_stage(tmp_path, backend, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", malformed=False)
    work, out = tmp_path / "work", tmp_path / "out"

    # interrupt the data stage in the middle of the second training shard
    real = distill.generate_answers
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # held-out shard, train shard 0, then stop in train shard 1
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(distill, "generate_answers", flaky)
    with pytest.raises(KeyboardInterrupt):
        train_adapter(backend, prompts, work, out, CONFIG, log=lambda m: None)
    first = distill.shard_path(work / "shards", "train", 0)
    assert first.exists() and not distill.shard_path(work / "shards", "train", 1).exists()
    assert not list((work / "shards").glob("*.tmp"))
    stamp = first.stat().st_mtime_ns
    monkeypatch.setattr(distill, "generate_answers", real)

    # interrupt training right after the epoch-2 checkpoint, then resume to epoch 3
    from kangaroo_tools import adapter_training as train_module

    real_save = train_module._save_checkpoint

    def save_then_stop(directory, *args):
        real_save(directory, *args)
        if directory.name == "epoch-002":
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train_adapter(backend, prompts, work, out, CONFIG, log=lambda m: None)
    assert first.stat().st_mtime_ns == stamp  # the finished shard was kept, not redone
    monkeypatch.setattr(train_module, "_save_checkpoint", real_save)
    logs = []
    resumed = train_adapter(backend, prompts, work, out, CONFIG, log=logs.append)
    assert "resuming after epoch-002" in logs
    assert [h["epoch"] for h in resumed["history"]] == [0, 1, 2, 3]

    # an uninterrupted run in a fresh directory gives the same history (resume changes nothing)
    fresh = train_adapter(backend, prompts, tmp_path / "work2", tmp_path / "out2", CONFIG, log=lambda m: None)
    for a, b in zip(fresh["history"], resumed["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9) and a["top1_agreement"] == b["top1_agreement"]

    # outputs
    assert resumed["history"][-1]["train_loss"] < resumed["history"][1]["train_loss"]  # loss decreases
    assert resumed["history"][-1]["loss"] < resumed["history"][0]["loss"]
    report = json.loads((out / "training_report.json").read_text())
    assert report["data"]["train_prompts"] == 16 and report["data"]["train_response_tokens"] > 0
    assert set(report["wall_seconds"]) == {"prompts", "data", "train"}
    # the resumed run computed no shard (its data stage only timed the reading); the fresh one computed them all
    shards = resumed["data"]["shards"]["reused"]
    assert shards > 0 and resumed["data"]["shards"]["computed"] == 0
    assert fresh["data"]["shards"] == {"computed": shards, "reused": 0}
    assert (out / "training_curves.png").stat().st_size > 1000
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["exit_layer"] == 1 and meta["base_model_fingerprint"] == backend.fingerprint
    KangarooAdapter.load(out, backend.model, base_fingerprint=backend.fingerprint, exit_layer=1)
    with pytest.raises(AdapterMismatchError):
        KangarooAdapter.load(out, backend.model, base_fingerprint=backend.fingerprint, exit_layer=2)


def _asdict(config):
    import attrs

    return attrs.asdict(config)


@pytest.mark.parametrize("draft_vocab, adapter_type, draft_head, extra", [
    (0, "attention", False, {}), (12, "attention", False, {}), (12, "attention", True, {}),
    (0, "deep-context", False, {}), (12, "deep-context", True, {}),
    (12, "deep-context", True, {"feature_weight": 0.5, "prompt_queries": True, "fusion_lr_scale": 1.0})])
def test_simulated_cr_equals_the_real_engine(tmp_path, backend, draft_vocab, adapter_type, draft_head, extra):
    """Teacher-forced metrics determine greedy acceptance: the simulation must match the engine round for round
    (with a draft vocabulary and head too: the drafter and the evaluation restrict the same way; and for the
    deep-context adapter, whose drafts depend on the draft depth: the replay follows its drafting pattern)."""
    from kangaroo_tools.adapter_training import evaluate

    prompts = write_prompts(tmp_path / "p.jsonl", malformed=False)
    config = CONFIG.__class__(**{**_asdict(CONFIG), "epochs": 1, "eta": 0.3, "gamma": 3, "draft_vocab": draft_vocab,
                                 "adapter_type": adapter_type, "draft_head": draft_head, **extra})
    train_adapter(backend, prompts, tmp_path / "w", tmp_path / "o", config, log=lambda m: None)
    adapter = load_adapter(tmp_path / "o", backend.model, base_fingerprint=backend.fingerprint, exit_layer=1)
    assert adapter.kind == adapter_type and adapter.draft_head == draft_head
    records = list(distill.load_shards(sorted((tmp_path / "w" / "shards").glob("heldout-*.safetensors")), 1))
    drafter = KangarooDrafter(str(tmp_path / "o"))
    engine = Engine(backend, drafter, ThresholdPolicy(eta=0.3), GreedyVerifier(), DecodeConfig(exit_layer=1, eta=0.3, gamma=3))
    assert drafter.wants_deep_states == (adapter_type == "deep-context")
    answers = []
    evaluate(adapter.double(), backend.lm_head, records, config, backend.eos_token_ids, answers=answers)
    accepted = 0
    for record, answer in zip(records, answers):
        p = record["prompt_length"]
        response = record["input_ids"][p:].tolist()
        result = engine.generate_ids(record["input_ids"][:p].tolist(), max_new_tokens=len(response))
        assert result.token_ids == response
        simulated = simulate_policy(answer, ThresholdPolicy(eta=0.3), 3)
        assert [(r.accepted, r.emitted) for r in result.rounds] == [(r.accepted, r.emitted) for r in simulated]
        accepted += sum(r.accepted for r in result.rounds)
    assert accepted > 0  # the comparison saw accepted drafts, not only rejections


def test_draft_vocabulary_restricts_drafting_and_stays_lossless(tmp_path, backend):
    from kangaroo_tools.adapter_training import draft_vocab_from_records
    from kangaroo_apps.testing import hf_greedy

    prompts = write_prompts(tmp_path / "p.jsonl", malformed=False)
    work = tmp_path / "w"
    full = train_adapter(backend, prompts, work, tmp_path / "full", CONFIG, log=lambda m: None)
    logs = []
    config = CONFIG.__class__(**{**_asdict(CONFIG), "draft_vocab": 10})
    report = train_adapter(backend, prompts, work, tmp_path / "small", config, log=logs.append)
    # the vocabulary is chosen before training and trained with: a run of its own, not a resumed full-vocabulary one
    assert not any(m.startswith("resuming") for m in logs) and any(m.startswith("draft vocabulary") for m in logs)
    assert report["history"] != full["history"]
    records = list(distill.load_shards(sorted((work / "shards").glob("train-*.safetensors")), 1))
    vocab = draft_vocab_from_records(records, 10, sorted(backend.eos_token_ids))
    assert report["draft_vocab"]["size"] == len(vocab) and 0 < report["draft_vocab"]["heldout_coverage"] <= 1
    meta = json.loads((tmp_path / "small" / "adapter.json").read_text())
    assert meta["architecture"]["draft_vocab_size"] == len(vocab)
    adapter = KangarooAdapter.load(tmp_path / "small", backend.model, base_fingerprint=backend.fingerprint, exit_layer=1)
    assert adapter.draft_vocab.tolist() == vocab
    with torch.no_grad():
        logits = adapter.logits(torch.randn(3, backend.model.config.hidden_size, dtype=torch.float64), backend.lm_head)
    finite = torch.isfinite(logits)
    assert finite.sum(-1).tolist() == [len(vocab)] * 3 and finite[:, vocab].all()
    # the most frequent answer token is in, counted by hand
    counts = {}
    for r in records:
        for t in r["input_ids"][r["prompt_length"]:].tolist():
            counts[t] = counts.get(t, 0) + 1
    assert max(counts, key=lambda t: (counts[t], -t)) in vocab
    # drafting only proposes listed tokens, and the output is the target's own
    seen = []

    class Recording(ThresholdPolicy):
        def keep_drafting(self, step):
            seen.append(step.token)
            return super().keep_drafting(step)

    engine = Engine(backend, KangarooDrafter(str(tmp_path / "small")), Recording(eta=0.0), GreedyVerifier(),
                    DecodeConfig(exit_layer=1, eta=0.0, gamma=4))
    for record in records[:4]:
        p = record["prompt_length"]
        prompt = record["input_ids"][:p].tolist()
        assert engine.generate_ids(prompt, max_new_tokens=16).token_ids == hf_greedy(backend.model, prompt, 16)
    assert seen and set(seen) <= set(vocab)


def test_adapter_with_a_broken_draft_vocabulary_is_refused(tmp_path, backend):
    from safetensors.torch import load_file, save_file

    adapter = KangarooAdapter.from_base_layer(backend.model, 1)
    adapter.set_draft_vocab([3, 1, 2])
    adapter.save(tmp_path / "a", base_fingerprint=backend.fingerprint, exit_layer=1)
    loaded = KangarooAdapter.load(tmp_path / "a", backend.model, base_fingerprint=backend.fingerprint, exit_layer=1)
    assert loaded.draft_vocab.tolist() == [1, 2, 3]
    state = load_file(tmp_path / "a" / "adapter.safetensors")
    del state["draft_vocab"]
    save_file(state, tmp_path / "a" / "adapter.safetensors")
    with pytest.raises(AdapterMismatchError, match="draft vocabulary"):
        KangarooAdapter.load(tmp_path / "a", backend.model, base_fingerprint=backend.fingerprint, exit_layer=1)
    with pytest.raises(ValueError):
        adapter.set_draft_vocab([10**9])


def _feature_batch(seed=0):
    """A collated batch of random states and labels: two sequences, prompts of 4 and 6, lengths 11 and 9."""
    from kangaroo_tools.adapter_training import _collate

    gen = torch.Generator().manual_seed(seed)
    records = []
    for prompt, n in ((4, 11), (6, 9)):
        records.append({"hidden": torch.randn(n, 32, generator=gen, dtype=torch.float64),
                        "deep": torch.randn(n, 32, generator=gen, dtype=torch.float64),
                        "topk_ids": torch.randint(0, 64, (n, 8), generator=gen),
                        "topk_logprobs": torch.log_softmax(torch.randn(n, 8, generator=gen), -1),
                        "input_ids": torch.randint(0, 64, (n,), generator=gen), "prompt_length": prompt})
    return _collate(records, torch.float64, deep=True)


def test_prompt_queries_add_the_prompts_rows_and_nothing_else():
    batch = _feature_batch()
    for depth in range(3):
        answers, everything = batch.rows(depth), batch.rows(depth, prompt=True)
        for row, (p, n) in enumerate(((4, 11), (6, 9))):
            assert answers[row].nonzero().flatten().tolist() == list(range(p + depth, n - 1))
            assert everything[row].nonzero().flatten().tolist() == list(range(depth + 1, n - 1))


def test_feature_loss_adds_the_weighted_regression_to_the_deep_states(backend):
    """training_loss with --feature-loss w = the distillation loss + w · smooth-L1(adapter output, z_q) per depth,
    over exactly the rows trained at that depth (prompt rows too with --prompt-queries)."""
    from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
    from kangaroo_tools.adapter_training import depth_outputs, depth_weights, training_loss

    adapter = DeepContextAdapter.from_base_layer(backend.base_model(), 1).double()
    batch = _feature_batch()
    head = backend.lm_head
    for prompt in (False, True):
        plain = TrainConfig(exit_layer=1, train_depths=3, prompt_queries=prompt)
        weighted = TrainConfig(exit_layer=1, train_depths=3, prompt_queries=prompt, feature_weight=0.5)
        outs = depth_outputs(adapter, batch, range(3), prompt)
        weights = depth_weights(3, plain.depth_decay)
        regression = sum(w * torch.nn.functional.smooth_l1_loss(out[batch.rows(j, prompt)], batch.deep[batch.rows(j, prompt)])
                         for j, (w, out) in enumerate(zip(weights, outs))) / sum(weights)
        assert float(regression) > 0
        difference = training_loss(adapter, head, batch, weighted, None) - training_loss(adapter, head, batch, plain, None)
        assert float(difference) == pytest.approx(0.5 * float(regression), rel=1e-5)  # the loss sums in float32


def test_cli_matmul_choices_are_the_training_configs():
    """``--feature-matmuls`` / ``--train-matmuls`` list their choices in the core CLI (which imports the training
    tools only when the command runs); they must stay the ones TrainConfig accepts."""
    from kangaroo_apps.cli import train_adapter_command
    from kangaroo_tools.adapter_training import MATMUL_DTYPES

    options = {p.name: p for p in train_adapter_command.params}
    for name in ("feature_matmuls", "train_matmuls"):
        assert tuple(options[name].type.choices) == MATMUL_DTYPES


def test_a_warm_start_keeps_every_trained_weight_and_grows_the_draft_head_token_by_token(tmp_path, backend):
    from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
    from kangaroo_tools.adapter_training import warm_start

    model, head = backend.model, backend.lm_head
    small = DeepContextAdapter.from_base_layer(model, 1, ffn=True, draft_head=True)
    small.set_draft_vocab([5, 9, 2], head)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in small.parameters():  # a "trained" adapter: every weight away from its initial value
            p.add_(torch.randn_like(p))
    small.save(tmp_path / "small", base_fingerprint=backend.fingerprint, exit_layer=1)

    grown = DeepContextAdapter.from_base_layer(model, 1, ffn=True, draft_head=True)
    grown.set_draft_vocab([2, 5, 7, 9, 11], head)
    report = warm_start(grown, tmp_path / "small", model, base_fingerprint=backend.fingerprint, exit_layer=1)
    assert report["draft_rows_carried"] == 3 and report["draft_rows"] == 5
    trained = dict(small.named_parameters())
    for name, p in grown.named_parameters():
        if name != "draft_rows":
            assert torch.equal(p, trained[name]), name
    rows = dict(zip(grown.draft_vocab.tolist(), grown.draft_rows.detach()))
    old = dict(zip(small.draft_vocab.tolist(), small.draft_rows.detach()))
    for token in (2, 5, 9):
        assert torch.equal(rows[token], old[token])
    for token in (7, 11):  # new draft tokens start from the shared head's rows
        assert torch.equal(rows[token], head.weight.detach()[token])
    # over the old tokens, the grown adapter drafts exactly what the trained one drafts
    hidden, deep = torch.randn(2, 1, 6, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        a, b = (adapter.logits(adapter.forward_depths(hidden, deep, [0])[0], head) for adapter in (small, grown))
    # (the same rows within float64 rounding: a 3- and a 5-row head product may sum in different orders)
    torch.testing.assert_close(a[..., [2, 5, 9]], b[..., [2, 5, 9]], rtol=1e-12, atol=1e-12)

    paper = KangarooAdapter.from_base_layer(model, 1)
    paper.save(tmp_path / "paper", base_fingerprint=backend.fingerprint, exit_layer=1)
    with pytest.raises(KangarooError, match="--init-from"):
        warm_start(grown, tmp_path / "paper", model, base_fingerprint=backend.fingerprint, exit_layer=1)


def test_training_from_a_trained_adapter_starts_where_it_ended(tmp_path, backend):
    prompts = write_prompts(tmp_path / "p.jsonl", malformed=False)
    work = tmp_path / "w"
    first = attrs_evolve(CONFIG, adapter_type="deep-context", draft_vocab=10, draft_head=True, epochs=1)
    trained = train_adapter(backend, prompts, work, tmp_path / "first", first, log=lambda m: None)
    logs = []
    again = train_adapter(backend, prompts, work, tmp_path / "again",
                          attrs_evolve(first, init_from=str(tmp_path / "first")), log=logs.append)
    # before its first step the warm-started adapter is the trained one: the same held-out evaluation
    assert again["history"][0] == {**trained["final"], "epoch": 0, "train_loss": None}
    assert again["init_from"]["draft_rows_carried"] == again["init_from"]["draft_rows"] == trained["draft_vocab"]["size"]
    assert any(m.startswith("starting from") for m in logs)
    assert again["history"][1] != trained["history"][1]  # and trains on from there


def attrs_evolve(config, **changes):
    import attrs

    return attrs.evolve(config, **changes)
