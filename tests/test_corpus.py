"""The committed self-distilled corpus: compact round trip, resume after an interruption, refusal of a mismatch."""

from __future__ import annotations

import json

import pytest
import torch

from kangaroo_apps.cli import main
from kangaroo_apps.cli_options import EngineOptions
from kangaroo_tools import corpus as corpus_module
from kangaroo_tools.corpus import Corpus, CorpusError, CorpusSettings, Record, build, plan, read_shard, write_shard

from conftest import write_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SETTINGS = CorpusSettings(max_new_tokens=6, heldout_prompts=3, shard_size=4)


@pytest.fixture()
def prompts(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl", 13)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EngineOptions(model=str(tiny_model_dir)).engine(vanilla=True)


def test_shards_round_trip_token_ids_compactly(tmp_path):
    records = [Record("a", [1, 2, 3], [60000, 5]), Record("b", [7], []), Record("c", [], [9])]
    write_shard(tmp_path / "s.safetensors", records, vocab_size=65536)
    assert read_shard(tmp_path / "s.safetensors") == records
    from safetensors.torch import load_file

    assert load_file(tmp_path / "s.safetensors")["answer_ids"].dtype == torch.uint16  # 2 bytes a token
    probe = tmp_path / "probe"
    probe.write_text("")  # a shard gets the permissions of any file written here (safetensors alone makes 0600)
    assert (tmp_path / "s.safetensors").stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    write_shard(tmp_path / "big.safetensors", records, vocab_size=262144)
    assert read_shard(tmp_path / "big.safetensors") == records
    (tmp_path / "bad.safetensors").write_bytes(b"not a shard")
    with pytest.raises(CorpusError, match="damaged or not a corpus shard"):
        read_shard(tmp_path / "bad.safetensors")


def test_plan_is_seeded_and_keeps_the_heldout_split_apart():
    ids = [f"p{i}" for i in range(13)]
    layout = plan(ids, SETTINGS)
    assert layout == plan(ids, SETTINGS)
    held = [i for shard in layout["heldout"] for i in shard]
    train = [i for shard in layout["train"] for i in shard]
    assert len(held) == 3 and len(train) == 10 and not set(held) & set(train)
    assert [len(s) for s in layout["train"]] == [4, 4, 2]


def test_build_answers_like_the_target_resumes_and_extends(tmp_path, prompts, engine, monkeypatch):
    directory = tmp_path / "corpus"
    real = corpus_module.batched_greedy_answers
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # a sitting ends in the middle of the second training shard
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_module, "batched_greedy_answers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(Corpus(directory), engine, prompts, SETTINGS, progress=False, log=lambda m: None)
    manifest = json.loads((directory / "corpus.json").read_text())
    assert sorted(manifest["shards"]) == ["heldout-00000.safetensors", "train-00000.safetensors"]
    assert not list(directory.glob(".*.tmp"))
    stamp = (directory / "train-00000.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(corpus_module, "batched_greedy_answers", real)
    summary = build(Corpus(directory), engine, prompts, SETTINGS, max_train_shards=1, progress=False, log=lambda m: None)
    assert summary["train"]["shards"] == 2 and (directory / "train-00000.safetensors").stat().st_mtime_ns == stamp
    summary = build(Corpus(directory), engine, prompts, SETTINGS, progress=False, log=lambda m: None)
    assert (summary["heldout"]["prompts"], summary["train"]["prompts"]) == (3, 10)
    # every answer is the target's own greedy answer to the chat-templated prompt (batched or not)
    for split in ("heldout", "train"):
        for record in Corpus(directory).records(split):
            assert engine.generate_ids(record.prompt, max_new_tokens=6).token_ids == record.answer
    entry = manifest["shards"]["heldout-00000.safetensors"]
    assert entry["generator"] == "engine" and entry["answer_tokens_per_second"] > 0


def test_a_mismatched_corpus_is_refused_in_one_line(tmp_path, prompts, engine, other_tiny_model_dir, capsys):
    directory = tmp_path / "corpus"
    build(Corpus(directory), engine, prompts, SETTINGS, max_train_shards=0, progress=False, log=lambda m: None)
    with pytest.raises(CorpusError, match="different settings"):
        build(Corpus(directory), engine, prompts, CorpusSettings(max_new_tokens=7, heldout_prompts=3, shard_size=4),
              progress=False, log=lambda m: None)
    with pytest.raises(CorpusError, match="not of the loaded model"):
        Corpus(directory).check(fingerprint="0000")
    assert main(["corpus", "build", "--out", str(directory), "--model", str(other_tiny_model_dir), "--prompts",
                 str(prompts), "--max-new-tokens", "6", "--heldout-prompts", "3", "--shard-size", "4",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "different base model fingerprint" in err
    assert main(["corpus", "info", str(directory)]) == 0
    assert "heldout     1 shards      3 prompts" in capsys.readouterr().out
    assert main(["corpus", "info", str(tmp_path / "nothing")]) == 1
    assert "is not a kangaroo corpus" in capsys.readouterr().err
    bench = tmp_path / "specbench_dev.jsonl"
    bench.write_text(prompts.read_text())
    assert main(["corpus", "build", "--out", str(tmp_path / "c2"), "--prompts", str(bench)]) == 1
    assert "Spec-Bench is for evaluation only" in capsys.readouterr().err


def test_the_committed_corpus_is_readable_and_made_by_the_default_model():
    from pathlib import Path

    directory = Path(__file__).resolve().parents[1] / "corpora" / "smollm2-135m-instruct"
    corpus = Corpus(directory)
    summary = corpus.summary()
    assert summary["base_model_fingerprint"] == "fc26df6a8a2a6a8c"  # SmolLM2-135M-Instruct (the shipped adapter's)
    assert summary["heldout"]["prompts"] == 64 and summary["train"]["prompts"] >= 64
    first = next(corpus.records("heldout"))
    assert first.prompt and first.answer and len(first.answer) <= 128


def test_train_adapter_from_a_corpus_recomputes_features_and_evaluates_on_its_heldout_split(tmp_path, prompts, engine,
                                                                                             tiny_model_dir, capsys):
    directory = tmp_path / "corpus"
    build(Corpus(directory), engine, prompts, SETTINGS, progress=False, log=lambda m: None)
    out, work = tmp_path / "adapter", tmp_path / "work"
    args = ["train-adapter", "--out", str(out), "--model", str(tiny_model_dir), "--corpus", str(directory),
            "--work-dir", str(work), "--num-prompts", "6", "--epochs", "1", "--batch-size", "2"]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((out / "training_report.json").read_text())
    assert report["data"]["heldout_prompts"] == 3 and report["data"]["train_prompts"] == 6
    assert report["data"]["heldout_response_tokens"] == sum(len(r.answer) for r in Corpus(directory).records("heldout"))
    assert list((work / "features").glob("heldout-00000-*.safetensors")) and not list(directory.glob("*features*"))
    assert main(args[:-4] + ["--out", str(tmp_path / "o2"), "--model", str(tiny_model_dir)]) == 0  # features reused
    assert main(["train-adapter", "--out", str(tmp_path / "o3"), "--corpus", str(tmp_path / "none")]) == 1
    assert "is not a kangaroo corpus" in capsys.readouterr().err


def test_train_a_deep_context_adapter_with_a_draft_head_from_the_cli(tmp_path, prompts, engine, tiny_model_dir, capsys):
    from kangaroo_plugins.kangaroo.adapter import KangarooAdapter

    directory = tmp_path / "corpus"
    build(Corpus(directory), engine, prompts, SETTINGS, progress=False, log=lambda m: None)
    base = ["train-adapter", "--model", str(tiny_model_dir), "--corpus", str(directory), "--work-dir",
            str(tmp_path / "work"), "--num-prompts", "6", "--epochs", "1", "--batch-size", "2"]
    assert main([*base, "--out", str(tmp_path / "bad"), "--draft-head"]) == 2  # a head over which vocabulary?
    assert "--draft-head needs --draft-vocab" in capsys.readouterr().err
    out = tmp_path / "dc"
    assert main([*base, "--out", str(out), "--adapter-type", "deep-context", "--ffn", "--draft-head", "--draft-vocab",
                 "20", "--loss", "accept", "--train-depths", "3"]) == 0, capsys.readouterr().err
    report = json.loads((out / "training_report.json").read_text())
    assert report["config"]["adapter_type"] == "deep-context" and report["config"]["loss"] == "accept"
    assert len(report["final"]["top1_by_depth"]) == report["config"]["gamma"]
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["architecture"]["type"] == "deep-context" and meta["architecture"]["draft_head"] is True
    assert main(["generate", "hello", "--model", str(tiny_model_dir), "--adapter", str(out), "--max-new-tokens", "8",
                 "--json", "--compare"]) == 0
    assert json.loads(capsys.readouterr().out)["identical_to_vanilla"] is True


def test_training_options_from_the_cli_and_bfloat16_features_stay_apart(tmp_path, prompts, engine, tiny_model_dir, capsys):
    """--feature-matmuls bfloat16 computes the training features in their own directory (a perturbed but close copy
    of the exact ones) and leaves the held-out features exact; the other training options reach the report, and
    the adapter trained with all of them stays lossless."""
    from safetensors.torch import load_file

    directory = tmp_path / "corpus"
    build(Corpus(directory), engine, prompts, SETTINGS, progress=False, log=lambda m: None)
    work = tmp_path / "work"
    base = ["train-adapter", "--model", str(tiny_model_dir), "--corpus", str(directory), "--work-dir", str(work),
            "--num-prompts", "6", "--epochs", "1", "--batch-size", "2", "--adapter-type", "deep-context"]
    assert main([*base, "--out", str(tmp_path / "exact")]) == 0, capsys.readouterr().err
    heldout = {p.name: load_file(p) for p in (work / "features").glob("heldout-*.safetensors")}
    exact = {p.name: load_file(p) for p in (work / "features").glob("train-*.safetensors")}
    out = tmp_path / "fast"
    assert main([*base, "--out", str(out), "--feature-matmuls", "bfloat16", "--train-matmuls", "bfloat16",
                 "--feature-loss", "0.5", "--prompt-queries", "--fusion-lr-scale", "1.0"]) == 0, capsys.readouterr().err
    config = json.loads((out / "training_report.json").read_text())["config"]
    assert (config["feature_matmuls"], config["train_matmuls"], config["feature_weight"], config["prompt_queries"],
            config["fusion_lr_scale"]) == ("bfloat16", "bfloat16", 0.5, True, 1.0)
    for name, tensors in heldout.items():  # untouched: evaluation judges against the exact target
        assert all(torch.equal(v, load_file(work / "features" / name)[k]) for k, v in tensors.items())
    fast = {p.name: load_file(p) for p in (work / "features-bfloat16").glob("train-*.safetensors")}
    assert fast.keys() == exact.keys() and fast
    for name, tensors in fast.items():
        assert torch.equal(tensors["input_ids"], exact[name]["input_ids"])
        a, b = tensors["deep"].float(), exact[name]["deep"].float()
        assert not torch.equal(a, b) and (a - b).norm() < 0.05 * b.norm()  # bfloat16 products: close, not equal
    assert main(["generate", "hello", "--model", str(tiny_model_dir), "--adapter", str(out), "--max-new-tokens", "8",
                 "--json", "--compare"]) == 0
    assert json.loads(capsys.readouterr().out)["identical_to_vanilla"] is True
    assert main(["train-adapter", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out",
                 str(tmp_path / "no"), "--work-dir", str(tmp_path / "w2"), "--feature-matmuls", "bfloat16"]) == 2
    assert "applies to features recomputed from a corpus" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_preallocated_cache_answers_exactly_as_transformers_default_cache(family):
    """The generator's in-place cache changes where keys/values live, not what attention computes: batched answers
    (left padding, prompts of several lengths, EOS inside some answers, Gemma's sliding layers keeping their own
    cache layer) equal those of transformers' own growing cache, token for token."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from kangaroo_apps.testing import tiny_model

    model = tiny_model(family, seed=3, eos_token_id=5)
    prompts = [[1, 2, 3], [4, 9, 12, 7, 30, 2, 2, 8, 41, 3], [17], [6, 6, 6, 6, 6, 6, 6, 60]]
    eos = frozenset({5})
    growing = corpus_module.DynamicCache

    answers = corpus_module.batched_greedy_answers(model, prompts, 12, eos, batch_size=3)
    kinds = {type(layer) for layer in corpus_module.preallocated_cache(model.config, 20).layers}
    assert corpus_module._PreallocatedLayer in kinds
    assert (DynamicSlidingWindowLayer in kinds) == (family == "gemma3") and DynamicLayer not in kinds

    def default_cache(config, capacity):
        return growing(config=config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpus_module, "preallocated_cache", default_cache)
        reference = corpus_module.batched_greedy_answers(model, prompts, 12, eos, batch_size=3)
    assert answers == reference
    assert all(len(a) == 12 or a[-1] == 5 for a in answers)  # cut after the first EOS, else the whole budget
    layer = corpus_module._PreallocatedLayer(4)
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    with pytest.raises(CorpusError, match="ran past its preallocated cache"):
        layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
