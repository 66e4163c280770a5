"""The GPU checks (``pytest -m gpu``, skipped without CUDA) and ``kangaroo gpu-check`` on the CPU.

On CUDA, on a tiny random model of every family: every built-in drafter × stopping policy × verifier × round shape
(chain rounds and every tree shaper) on every backend available there (torch; onnx where onnxruntime has the CUDA
provider) is token-identical, under greedy decoding, to the same backend's target alone — torch in float32 and
bfloat16, with the backend's CUDA graphs on and off. The CPU tests run the same matrix once on the CPU (so the GPU
tests' own code is exercised on every machine) and ``kangaroo gpu-check --device cpu`` on the cheapest setting.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random

import pytest
import torch

from kangaroo_apps.cli import main
from kangaroo_apps.testing import TINY_FAMILIES, tiny_model
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.errors import KangarooError
from kangaroo_core.plugins import get_registry

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False (a CPU-only "
                                                 "torch build, or no NVIDIA GPU on this machine)")


def ort_cuda() -> bool:
    """onnxruntime (and onnx) installed, with the CUDA execution provider."""
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return False
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


CONFIG = DecodeConfig(exit_layer=2, eta=0.0, gamma=4)
NEW_TOKENS = 16
TREE_OPTIONS = {"dynamic": {"budget": 6, "topk": 2, "depth": 3, "min_prob": 0.0}, "chain": {"depth": 3},
                "fan": {"topk": 2, "depth": 3}}


def builtin(kind: str) -> list[str]:
    """This distribution's own plugins of one kind (the docs' example packages may be installed next to it)."""
    return sorted(name for plugin in get_registry().report() if plugin["distribution"] == "kangaroo-decoding"
                  for name in plugin["registers"].get(kind, []))


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """A tiny model directory per family (safetensors + tokenizer), made once."""
    from transformers import GenerationConfig

    from conftest import make_tokenizer

    made = {}

    def get(family: str):
        if family not in made:
            directory = tmp_path_factory.mktemp(f"tiny-{family}")
            tok = make_tokenizer()
            tok.chat_template = None
            model = tiny_model(family, 0, vocab=len(tok), dtype=torch.float32, eos_token_id=tok.eos_token_id)
            model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            model.save_pretrained(directory, safe_serialization=True)
            tok.save_pretrained(directory)
            made[family] = directory
        return str(made[family])

    return get


def policy_options(policy: str) -> dict | None:
    if policy == "learned":  # no predictor ships with an untrained adapter: a random one (any rule stays lossless)
        from kangaroo_policies.predictor import AcceptancePredictor

        return {"predictor": AcceptancePredictor.random(0)}
    return None


def check_every_combination(target: Engine, prompts: int = 2) -> tuple[list, int]:
    """Run every built-in drafter × policy × verifier × round shape on ``target``'s backend; returns the combinations
    whose output differs from ``target`` (the same backend, no drafter) and the number of drafts accepted."""
    rng = random.Random(0)
    vocab = target.backend.vocab_size
    cases = [[rng.randrange(3, vocab) for _ in range(9)] for _ in range(prompts)]
    wants = [target.generate_ids(prompt, NEW_TOKENS).token_ids for prompt in cases]
    mismatches, accepted = [], 0
    for drafter, policy, verifier, tree in itertools.product(builtin("drafter"), builtin("policy"), builtin("verifier"),
                                                             [None, *builtin("tree")]):
        combination = (drafter, policy, verifier, tree or "chain rounds")
        try:
            engine = Engine.build(backend=target.backend, config=CONFIG, drafter=drafter, policy=policy,
                                  verifier=verifier, policy_options=policy_options(policy), tree=tree,
                                  tree_options=TREE_OPTIONS.get(tree))
        except KangarooError as exc:  # every combination is meant to exist: a refusal is a failure too
            mismatches.append((*combination, f"refused: {exc}"))
            continue
        for prompt, want in zip(cases, wants):
            result = engine.generate_ids(prompt, NEW_TOKENS)
            accepted += sum(r.accepted for r in result.rounds)
            if result.token_ids != want:
                mismatches.append((*combination, f"prompt {prompt}: {result.token_ids} != {want}"))
    return mismatches, accepted


def torch_target(directory: str, device: str, dtype: str, graphs: str) -> Engine:
    target = Engine.build(directory, device=device, dtype=dtype, backend="torch", backend_options={"graphs": graphs},
                          drafter=None, config=CONFIG, exit_layer=2)
    assert target.backend.device.type == torch.device(device).type
    assert target.backend.dtype == getattr(torch, dtype)
    return target


# -- CUDA -------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_combination_equals_the_torch_target_alone_on_cuda(family, dtype, graphs, family_dir):
    target = torch_target(family_dir(family), "cuda", dtype, graphs)
    mismatches, accepted = check_every_combination(target)
    assert not mismatches, f"{len(mismatches)} combination(s) differ from the target alone:\n" + \
        "\n".join(map(str, mismatches[:20]))
    assert accepted > 0  # drafts were accepted, so the verification was exercised


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not ort_cuda(), reason="onnxruntime's CUDAExecutionProvider is not available (install "
                                           "onnxruntime-gpu, kangaroo's [onnx-gpu] extra, on a machine with CUDA)")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_combination_equals_the_onnx_target_alone_on_cuda(family, family_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path / "cache"))  # the export goes here
    target = Engine.build(family_dir(family), device="cuda", backend="onnx", drafter=None, config=CONFIG, exit_layer=2)
    mismatches, accepted = check_every_combination(target)
    assert not mismatches, f"{len(mismatches)} combination(s) differ from the target alone:\n" + \
        "\n".join(map(str, mismatches[:20]))
    assert accepted > 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_check_on_cuda_writes_the_table(tiny_model_dir, tmp_path):
    """``kangaroo gpu-check`` itself on the GPU, on the tiny model (both dtypes, every method)."""
    out = tmp_path / "out"
    code = main(["gpu-check", "--model", str(tiny_model_dir), "--questions", str(write_questions(tmp_path)),
                 "--limit-per-subtask", "1", "--max-new-tokens", "8", "--out", str(out), "--no-progress"])
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["device"].startswith("cuda") and set(result["dtypes"]) == {"float32", "bfloat16"}
    assert all(row["error"] is None for entry in result["dtypes"].values() for row in entry["rows"]), result["problems"]
    assert code == 0, result["problems"]


# -- CPU --------------------------------------------------------------------------------------------------------------
def test_the_gpu_matrix_runs_on_the_cpu(family_dir, one_torch_thread):
    """The CUDA tests' matrix, once on the CPU (llama, float32, graphs on: the static code run eagerly), one prompt."""
    assert builtin("backend") == ["onnx", "torch"] and builtin("verifier") == ["greedy", "speculative"]
    mismatches, accepted = check_every_combination(torch_target(family_dir("llama"), "cpu", "float32", "on"), prompts=1)
    assert not mismatches, "\n".join(map(str, mismatches[:20]))
    assert accepted > 0


QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["tell me a story about the sea", "why is the sky blue"],
     "subtask": "mt_bench"},
    {"question_id": 7, "category": "qa", "turns": ["what is the cat"], "subtask": "qa"},
    {"question_id": 8, "category": "qa", "turns": ["what is the dog"], "subtask": "qa"},
]


def write_questions(directory):
    path = directory / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_gpu_check_runs_on_the_cpu(tiny_model_dir, tmp_path, capsys, one_torch_thread):
    out = tmp_path / "out"
    code = main(["gpu-check", "--device", "cpu", "--model", str(tiny_model_dir), "--questions",
                 str(write_questions(tmp_path)), "--limit-per-subtask", "1", "--max-new-tokens", "8",
                 "--dtypes", "float32", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    table = captured.out
    assert "| device | dtype | method | tok/s | × transformers eager | × our target alone | CR |" in table
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["device"] == "cpu" and result["device_name"].startswith("CPU ")
    assert list(result["dtypes"]) == ["float32"] and result["problems"] == []
    assert result["run"]["questions_per_subtask"] == {"mt_bench": 1, "qa": 1} and result["run"]["turns"] == 3
    rows = {row["method"]: row for row in result["dtypes"]["float32"]["rows"]}
    assert list(rows) == ["hf_vanilla", "hf_static", "vanilla", "kangaroo", "kangaroo_tree"]
    for name, row in rows.items():
        assert row["error"] is None and row["runs"] == 3 and row["tokens_per_second"] > 0, name
        assert f"| float32 | {name} | {row['tokens_per_second']:.1f} |" in table
    assert rows["hf_vanilla"]["x_transformers_eager"] == pytest.approx(1.0)
    assert rows["vanilla"]["x_target_alone"] == pytest.approx(1.0)
    for name in ("kangaroo", "kangaroo_tree"):  # lossless: every turn equals the target alone, and transformers
        assert rows[name]["identical_to_target_alone_turns"] == 3 and rows[name]["cr"] >= 1.0, name
        assert f"| {name} | " in table and "| 3/3 | 3/3 |" in table
    for name in ("hf_static", "vanilla", "kangaroo", "kangaroo_tree"):
        assert rows[name]["identical_to_transformers_turns"] == 3, name
    assert rows["hf_static"]["cr"] == pytest.approx(1.0)
    assert rows["vanilla"]["identical_to_target_alone_turns"] is None  # no drafter: nothing to compare
    md = (out / "gpu_check.md").read_text()
    assert "| float32 | kangaroo |" in md and "--max-new-tokens 8" in md and "**CR**" in md


def test_gpu_check_refuses_in_one_line(tmp_path, capsys):
    if not CUDA:  # the default device is cuda: refused before anything loads
        assert main(["gpu-check", "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("kangaroo: error: --device cuda asks for CUDA") and err.count("\n") == 1
    assert main(["gpu-check", "--device", "cpu", "--dtypes", "float8"]) == 2
    assert "--dtypes: dtype must be one of" in capsys.readouterr().err
    assert main(["gpu-check", "--device", "cpu", "--dtypes", " , "]) == 2
    assert "--dtypes is empty" in capsys.readouterr().err
    assert main(["gpu-check", "--device", "tpu"]) == 1
    assert "device must be cpu, cuda or cuda:N" in capsys.readouterr().err


def test_clocks_are_read_after_the_device_synchronises(tiny_model_dir, monkeypatch, one_torch_thread):
    """CUDA runs asynchronously: profile's and bench's clocks are read after the device's queued work (counted here
    on the CPU, with a stand-in CUDA device and synchronize)."""
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_core.bench_context import BenchContext
    from kangaroo_policies.cost_model import measure_costs
    from kangaroo_plugins import bench_methods

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    opts = EngineOptions(model=str(tiny_model_dir), max_new_tokens=4)
    backend = opts.backend()

    class OnCuda:  # the backend as a CUDA one would look to measure_costs
        device = torch.device("cuda")

        def __getattr__(self, name):
            return getattr(backend, name)

    measure_costs(OnCuda(), None, context=8, positions=(1, 2), repeats=2)
    assert calls == [torch.device("cuda")] * 8  # before and after each of 2 sizes x 2 repeats
    measure_costs(backend, None, context=8, positions=(1, 2), repeats=2)
    assert len(calls) == 8  # a CPU backend: nothing to wait for

    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_methods, "synchronize", synced.append)
    context = BenchContext(backend, opts.spec())
    messages = [{"role": "user", "content": "hello"}]
    for method, count in ((bench_methods.HFGenerate(), 2), (bench_methods.VanillaMethod(), 1)):
        method.prepare(context)
        synced.clear()
        method.run(messages, 4)
        assert synced == [torch.device("cpu")] * count, method.name  # the model's device


def test_hf_static_grows_its_cache_outside_the_clock(tiny_model_dir, one_torch_thread):
    """transformers' static cache is grown (to a power of two, capped at the model's context) before a timed turn
    that needs more room, never in it; the output is transformers' eager greedy output."""
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_core.bench_context import BenchContext
    from kangaroo_plugins.bench_methods import HFGenerate, HFStatic

    opts = EngineOptions(model=str(tiny_model_dir), max_new_tokens=8)
    context = BenchContext(opts.backend(), opts.spec())
    static, eager = HFStatic(), HFGenerate()
    static.prepare(context)
    eager.prepare(context)
    assert static.cache_slots() == 0 and static.max_positions == 128
    for text in ("hello", "tell me a story about the sea and the sky " * 3):
        messages = [{"role": "user", "content": text}]
        result = static.run(messages, 8)
        assert static.cache_slots() == 128  # min(256, the tiny model's 128 positions)
        assert result.token_ids == eager.run(messages, 8).token_ids
        assert result.target_passes == result.generated_tokens  # CR 1: one full pass per token


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_many_streams_on_cuda_decode_what_each_decodes_alone(dtype, graphs, family_dir):
    """Batches on the GPU (every stream its own KV slot): each stream equals that prompt decoded alone."""
    target = torch_target(family_dir("llama"), "cuda", dtype, graphs)
    kangaroo = Engine.build(backend=target.backend, config=CONFIG)
    prompts = [[random.Random(s).randrange(1, 60) for _ in range(5 + s % 7)] for s in range(12)]
    for engine in (target, kangaroo):
        alone = [engine.generate_ids(p, NEW_TOKENS).token_ids for p in prompts]
        assert [r.token_ids for r in engine.batch(8).generate(prompts, max_new_tokens=NEW_TOKENS)] == alone
