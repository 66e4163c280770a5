"""``--device`` on the commands that load a model without the engine flags (train-adapter, train-policy, corpus build,
export-onnx), and the training / corpus code following the model's device and dtype (on this CPU machine: a missing
GPU refused in one line before any load, ``--device cpu`` accepted, a float64 model trained in float64)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_model, write_prompts
from kangaroo_apps.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the commands of this file, each with the arguments it needs besides --device
COMMANDS = {
    "train-adapter": ["train-adapter", "--out", "{tmp}/adapter", "--prompts", "{prompts}"],
    "train-policy": ["train-policy", "--out", "{tmp}/predictor", "--prompts", "{prompts}"],
    "corpus build": ["corpus", "build", "--out", "{tmp}/corpus", "--prompts", "{prompts}"],
    "export-onnx": ["export-onnx", "--out", "{tmp}/bundle"],
}


@pytest.fixture()
def prompts(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl", 8)


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Any model load fails the test: a refused device must cost no load time."""
    from kangaroo_backends import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "_load", refuse)


def _args(command: str, tmp_path, prompts, model) -> list[str]:
    return [a.format(tmp=tmp_path, prompts=prompts) for a in COMMANDS[command]] + ["--model", str(model)]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kangaroo: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    "cuda:99",  # refused with CUDA too: no machine has a hundred devices
])
def test_cuda_is_refused_in_one_line_before_anything_loads(command, device, tmp_path, prompts, tiny_model_dir,
                                                            no_model_loads, capsys):
    assert main(_args(command, tmp_path, prompts, tiny_model_dir) + ["--device", device]) in (1, 2)
    err = _one_line_error(capsys)
    assert "CUDA" in err and f"--device {device}" in err
    if command == "export-onnx":  # the export traces on the CPU: it says where the bundle runs on the GPU
        assert "--backend onnx --device cuda" in err
    assert not any(tmp_path.glob("adapter*")) and not any(tmp_path.glob("corpus*"))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_device_that_is_no_device_is_refused_in_one_line(command, tmp_path, prompts, tiny_model_dir, no_model_loads,
                                                           capsys):
    assert main(_args(command, tmp_path, prompts, tiny_model_dir) + ["--device", "tpu"]) in (1, 2)
    assert "tpu" in _one_line_error(capsys)


def test_train_policy_refuses_an_unknown_dtype_in_one_line(tmp_path, prompts, tiny_model_dir, no_model_loads, capsys):
    assert main(_args("train-policy", tmp_path, prompts, tiny_model_dir) + ["--dtype", "float8"]) == 1
    assert "dtype must be one of" in _one_line_error(capsys)


def test_the_commands_run_on_device_cpu(tmp_path, prompts, tiny_model_dir, capsys):
    """``--device cpu`` end to end on a tiny model: a corpus (each shard records its device), an adapter trained from
    it (the report records the device), a predictor (with --dtype)."""
    corpus = tmp_path / "corpus"
    assert main(["corpus", "build", "--out", str(corpus), "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--heldout-prompts", "2", "--shard-size", "2", "--max-shards", "1",
                 "--no-progress", "--device", "cpu"]) == 0, capsys.readouterr().err
    shards = json.loads((corpus / "corpus.json").read_text())["shards"]
    assert len(shards) == 2 and {entry["device"] for entry in shards.values()} == {"cpu"}
    out = tmp_path / "adapter"
    assert main(["train-adapter", "--out", str(out), "--model", str(tiny_model_dir), "--corpus", str(corpus),
                 "--work-dir", str(tmp_path / "work"), "--num-prompts", "2", "--epochs", "1", "--batch-size", "2",
                 "--top-k", "4", "--device", "cpu"]) == 0, capsys.readouterr().err
    assert json.loads((out / "training_report.json").read_text())["device"] == "cpu"
    predictor = tmp_path / "predictor"
    assert main(["train-policy", "--out", str(predictor), "--model", str(tiny_model_dir), "--adapter", "untrained",
                 "--prompts", str(prompts), "--num-prompts", "2", "--gamma", "2", "--max-new-tokens", "6", "--steps",
                 "5", "--device", "cpu", "--dtype", "float32"]) == 0, capsys.readouterr().err
    assert (predictor / "predictor.json").exists()


def test_export_onnx_accepts_device_cpu(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bundle"
    assert main(["export-onnx", "--out", str(out), "--model", str(tiny_model_dir), "--adapter", "none",
                 "--device", "cpu"]) == 0, capsys.readouterr().err
    assert (out / "deep.onnx").exists()


# -- the code follows the model's dtype (float64 here; the device the same way) ----------------------------------------
@pytest.fixture(scope="module")
def float64_backend(tmp_path_factory):
    from kangaroo_backends.torch_backend import TorchBackend
    from kangaroo_core.config import DecodeConfig

    directory = save_tiny_model(tmp_path_factory.mktemp("float64-model"), layers=3, hidden=32, dtype=torch.float64)
    return TorchBackend.create(DecodeConfig(exit_layer=1), model=str(directory), dtype="float64")


def _floats(tensors) -> set:
    return {t.dtype for t in tensors if t is not None and t.is_floating_point()}


@pytest.mark.parametrize("adapter_type, extra", [
    ("attention", {}), ("deep-context", {"draft_vocab": 12, "draft_head": True, "feature_weight": 0.5})])
def test_a_training_step_of_a_float64_model_stays_float64(float64_backend, adapter_type, extra):
    from kangaroo_plugins.kangaroo.networks import adapter_class
    from kangaroo_tools.adapter_training import (TrainConfig, _collate, draft_vocab_from_records, evaluate,
                                                 training_loss, vocab_index_of)
    from kangaroo_tools.features import extract_features, load_shards

    model, head = float64_backend.base_model(), float64_backend.shared_head()
    config = TrainConfig(exit_layer=1, adapter_type=adapter_type, train_depths=2, gamma=3, top_k=4, **extra)
    sequences = [[1, 5, 6, 7, 8, 9, 10, 2], [1, 11, 12, 13, 14, 2]]
    shard = extract_features(model, sequences, [3, 2], [1], top_k=4)
    assert all(t.device.type == "cpu" for t in shard.values())  # shards are files
    assert shard["hidden_l1"].dtype == torch.float16 and shard["topk_ids"].dtype == torch.int32  # the file format
    records = _records(shard, load_shards)
    adapter = adapter_class(adapter_type).from_base_layer(model, 1, draft_head=config.draft_head)
    if config.draft_vocab:
        adapter.set_draft_vocab(draft_vocab_from_records(records, config.draft_vocab, [2]), head)
    batch = _collate(records, head.weight.dtype, deep=True, device=head.weight.device)
    assert _floats([batch.hidden, batch.deep, batch.topk_logprobs]) == {torch.float64}
    params = [p for p in adapter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    loss = training_loss(adapter, head, batch, config, vocab_index_of(adapter))
    assert loss.dtype == torch.float64
    loss.backward()
    optimizer.step()
    assert _floats(adapter.parameters()) == {torch.float64} and _floats(p.grad for p in params) == {torch.float64}
    moments = [state[name] for state in optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")]
    assert _floats(moments) == {torch.float64}  # (its step counter is torch's float32 scalar)
    answers = []
    result = evaluate(adapter, head, records, config, frozenset({2}), answers=answers)
    assert result["tokens"] > 0 and answers
    steps = [s for a in answers for s in a.steps if s is not None]
    assert steps and {s.probs.dtype for s in steps} == {torch.float64}


def _records(shard, load_shards):
    """The per-sequence records of one in-memory shard (through a file, as training reads them)."""
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "s.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, path)
        return list(load_shards([path], 1))


def test_corpus_generation_of_a_float64_model_keeps_its_cache_in_float64(float64_backend, monkeypatch):
    """The corpus generator's preallocated cache takes the keys' dtype and device; the answers are the target's."""
    from kangaroo_core.assembly import EngineSpec
    from kangaroo_core.engine import assemble
    from kangaroo_tools import corpus as corpus_module

    caches = []
    real = corpus_module.preallocated_cache

    def recorded(config, capacity):
        caches.append(real(config, capacity))
        return caches[-1]

    monkeypatch.setattr(corpus_module, "preallocated_cache", recorded)
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    answers = corpus_module.batched_greedy_answers(float64_backend.base_model(), prompts, 5, frozenset({2}), 2)
    keys = [layer._keys for cache in caches for layer in cache.layers if hasattr(layer, "_keys")]
    assert keys and {k.dtype for k in keys} == {torch.float64} and {k.device.type for k in keys} == {"cpu"}
    engine = assemble(EngineSpec(exit_layer=1).target_alone(), backend=float64_backend)
    assert answers == corpus_module.engine_greedy_answers(engine, prompts, 5)
