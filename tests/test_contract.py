"""The position-explicit contract (deep rows and states, keep, verdict paths, drafter positions and deep states), and
the defects and one-line errors found when reading the code as a newcomer (each test failed before its fix)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kangaroo_apps.cli import main
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.config import ConfigError
from kangaroo_core.errors import AdapterMismatchError
from kangaroo_core.interfaces import SelfDrafter
from kangaroo_core.results import Verdict
from kangaroo_apps.testing import ScriptedDrafter, hf_greedy, tiny_backend, tiny_llama
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.fixed import FixedPolicy
from kangaroo_policies.threshold import ThresholdPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]


# -- backend: explicit positions, deep rows + states, keep ---------------------------------------------------------
def test_deep_returns_the_rows_asked_for_and_every_final_state():
    model = tiny_llama(3, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    ids = [3, 9, 4, 1, 7]
    backend.reset()
    out = backend.deep(backend.shallow(ids, 0), 0, rows=[4, 1])
    with torch.inference_mode():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    assert out.logits.shape == (2, 64) and out.hidden.shape == (5, 32)
    assert torch.allclose(out.logits, ref.logits[0, [4, 1]], atol=1e-10)
    assert torch.allclose(out.hidden, ref.hidden_states[-1][0], atol=1e-10)  # the final norm's output, every row
    with pytest.raises(RuntimeError, match="position 3, but the cache holds 5"):
        backend.shallow([1], 3)  # positions are explicit: a call must append right after the cache


def test_keep_compacts_the_caches_to_the_kept_positions():
    model = tiny_llama(4, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    ids = [3, 9, 4, 1, 7, 8, 2]
    backend.reset()
    backend.deep(backend.shallow(ids, 0), 0)
    before = [tuple(t.clone() for t in backend.cache.layer(layer)) for layer in range(3)]
    backend.keep([0, 1, 2, 5])  # a tree round's accepted path: the prefix plus one node
    assert backend.cache_lengths() == (4, 4)
    for layer in range(3):
        for got, old in zip(backend.cache.layer(layer), before[layer]):
            assert torch.equal(got, old[:, :, [0, 1, 2, 5]]), layer
    backend.crop(2)
    assert backend.cache_lengths() == (2, 2)


def test_verdict_names_the_accepted_path_and_the_chain_loop_refuses_anything_else():
    assert Verdict.chain(3, 7).path == (0, 1, 2) and Verdict.chain(3, 7).accepted == 3
    model = tiny_llama(5)
    prompt = [1, 2, 3]
    reference = prompt + hf_greedy(model, prompt, 8)

    class TreeLike(GreedyVerifier):
        def verify(self, drafts, target_logits):
            verdict = super().verify(drafts, target_logits)
            return Verdict((1,), verdict.next_token) if len(drafts) > 1 else verdict

    engine = Engine(tiny_backend(model), ScriptedDrafter(reference, 64), FixedPolicy(), TreeLike(),
                    DecodeConfig(exit_layer=1, gamma=3, max_new_tokens=8))
    with pytest.raises(RuntimeError, match=r"path \(1,\) for a chain of 3 drafts"):
        engine.generate_ids(prompt)


# -- drafter: owns its positions, optional deep states --------------------------------------------------------------
class DeepRecorder(ScriptedDrafter):
    """A scripted drafter that asks for the target's deep states and records them by position."""

    wants_deep_states = True

    def reset(self) -> None:
        super().reset()
        self.deep: dict[int, torch.Tensor] = {}

    def observe_deep(self, start: int, hidden: torch.Tensor) -> None:
        for i, h in enumerate(hidden):
            assert start + i not in self.deep, f"position {start + i} handed over twice"
            self.deep[start + i] = h.clone()


@pytest.mark.parametrize("wrong_at", [set(), {9}, set(range(40))], ids=["full", "partial", "zero"])
def test_deep_states_reach_the_drafter_for_exactly_the_accepted_positions(wrong_at):
    model = tiny_llama(6, layers=3)
    prompt = [4, 8, 15, 16, 23, 42]
    new = 12
    reference = prompt + hf_greedy(model, prompt, new)
    drafter = DeepRecorder(reference, 64, wrong_at=wrong_at)
    engine = Engine(tiny_backend(model), drafter, ThresholdPolicy(eta=0.0), GreedyVerifier(),
                    DecodeConfig(exit_layer=1, gamma=3, max_new_tokens=new))
    result = engine.generate_ids(prompt)
    assert result.token_ids == reference[len(prompt):]
    accepted = [r.accepted for r in result.rounds]
    assert (sum(accepted) == 0) == (len(wrong_at) == 40)
    if not wrong_at:
        assert max(accepted) == 3
    # every position whose deep state verification computed and kept: the prompt, then x_n + accepted drafts
    expected = sorted(range(len(prompt) + len(result.token_ids) - 1))
    assert sorted(drafter.deep) == expected
    with torch.inference_mode():
        ref = model(torch.tensor([reference[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    for position, state in drafter.deep.items():
        assert torch.allclose(state, ref[position], atol=1e-9), position


def test_drafters_that_ignore_deep_states_get_none():
    calls = []

    class Ignores(ScriptedDrafter):
        def observe_deep(self, start, hidden):
            calls.append(start)

    model = tiny_llama(7)
    prompt = [1, 2, 3]
    engine = Engine(tiny_backend(model), Ignores(prompt + hf_greedy(model, prompt, 6), 64), FixedPolicy(),
                    GreedyVerifier(), DecodeConfig(exit_layer=1, gamma=2, max_new_tokens=6))
    engine.generate_ids(prompt)
    assert calls == [] and SelfDrafter.wants_deep_states is False


# -- defects --------------------------------------------------------------------------------------------------------
class CutCharacters:
    """A tokenizer whose odd tokens are the first byte of a two-byte character: text that ends on one ends in U+FFFD."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False, **_):
        ids = list(ids)
        text = "".join(f"<{i}>" for i in ids[:-1] if i % 2 == 0)
        return text + ("\ufffd" if ids and ids[-1] % 2 else f"<{ids[-1]}>" if ids else "")

    def encode(self, text, **_):
        return [1]


def test_text_stream_ends_cleanly_when_the_last_token_cuts_a_character():
    model = tiny_llama(8)
    backend = tiny_backend(model)
    prompt = [5, 6, 7]
    reference = hf_greedy(model, prompt, 30)
    n = next(i + 1 for i, t in enumerate(reference) if t % 2 and i >= 2)  # the budget cuts after an odd token
    backend.tokenizer = CutCharacters()
    engine = Engine(backend, None, FixedPolicy(), GreedyVerifier(), DecodeConfig(exit_layer=1, max_new_tokens=n))
    from kangaroo_core.engine import TextStream

    stream = TextStream(engine, prompt, n)
    pieces = list(stream)  # used to raise AttributeError after the last piece
    assert "".join(pieces) == stream.result.text and stream.result.text.endswith("\ufffd")
    with pytest.raises(StopIteration):
        next(stream)


def test_generation_seconds_exclude_the_consumers_time():
    model = tiny_llama(9)
    engine = Engine(tiny_backend(model), None, FixedPolicy(), GreedyVerifier(), DecodeConfig(exit_layer=1))
    from kangaroo_core.engine import TextStream

    stream = TextStream(engine, [1, 2, 3], 12)
    started = time.perf_counter()
    pieces = 0
    for _ in stream:
        pieces += 1
        time.sleep(0.05)  # a slow consumer (printing, a network client)
    elapsed = time.perf_counter() - started
    assert pieces >= 5
    assert stream.result.seconds < elapsed - 0.04 * pieces


@pytest.mark.parametrize("args, message", [
    (["--policy", "threshold", "--policy-option", "bogus=1"], "policy 'threshold': .*bogus.*; valid options: eta"),
    (["--policy", "adaptive", "--policy-option", "pivot=abc"], "policy 'adaptive': bad option value .*valid options: pivot"),
    (["--policy-option", "novalue"], "--policy-option takes KEY=VALUE"),
    (["--drafter-option", "warp=9"], "drafter 'kangaroo-hybrid': .*warp.*; valid options: adapter, max_ngram"),
    (["--drafter", "kangaroo", "--drafter-option", "warp=9"], "drafter 'kangaroo': .*warp.*; valid options: adapter"),
])
def test_bad_plugin_options_are_one_line_naming_the_valid_ones(tiny_model_dir, capsys, args, message):
    import re

    code = main(["generate", "t", "--model", str(tiny_model_dir), *args])
    err = capsys.readouterr().err
    assert code in (1, 2) and err.count("\n") == 1 and err.startswith("kangaroo: error: "), err
    assert re.search(message, err), err


def test_kangaroo_onnx_keeps_the_configured_policy(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from kangaroo_core.bench_context import BenchContext
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_plugins.onnx_bench_methods import KangarooOnnx

    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))
    opts = EngineOptions(model=str(tiny_model_dir), adapter="untrained")
    backend = opts.backend()
    context = BenchContext(backend, opts.spec())
    method = KangarooOnnx(policy="fixed")
    method.prepare(context)
    assert method.engine.backend.runtime == "onnxruntime" and method.engine.policy.name == "fixed"


def test_an_adapter_directory_named_default_is_used(tiny_model_dir, tmp_path, monkeypatch):
    from kangaroo_core.bench_context import BenchContext
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_plugins.bench_methods import KangarooMethod

    opts = EngineOptions(model=str(tiny_model_dir))
    backend = opts.backend()
    KangarooAdapter.from_base_layer(backend.base_model(), 2).save(tmp_path / "default", base_fingerprint=backend.fingerprint,
                                                                  exit_layer=2)
    monkeypatch.chdir(tmp_path)
    context = BenchContext(backend, opts.spec())
    method = KangarooMethod(adapter="default")
    method.prepare(context)
    assert method.engine.drafter.resolved_adapter == "default"


def test_train_adapter_records_the_command_line_and_refuses_bad_files_before_any_work(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"tell me a story about the sea {i}"}) + "\n" for i in range(12)))
    out, work = tmp_path / "adapter", tmp_path / "work"
    args = ["train-adapter", "--out", str(out), "--model", str(tiny_model_dir), "--prompts", str(prompts), "--work-dir",
            str(work), "--num-prompts", "4", "--heldout-prompts", "2", "--epochs", "1", "--max-new-tokens", "4",
            "--batch-size", "2"]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((out / "training_report.json").read_text())
    import shlex

    assert report["command_line"] == "kangaroo " + shlex.join(args)  # not pytest's argv
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe not utf-8\n{\"nope\": 1}\n")
    capsys.readouterr()
    assert main(["train-adapter", "--out", str(tmp_path / "o2"), "--model", str(tiny_model_dir), "--prompts", str(bad),
                 "--work-dir", str(tmp_path / "w2")]) == 1
    err = capsys.readouterr().err
    assert "holds no usable prompts" in err and not (tmp_path / "w2").exists()
    (tmp_path / "afile").write_text("x")
    start = time.perf_counter()
    assert main(["train-adapter", "--out", str(tmp_path / "afile" / "o"), "--model", str(tiny_model_dir),
                 "--prompts", str(prompts)]) == 1
    assert "is a file, not a directory" in capsys.readouterr().err and time.perf_counter() - start < 5


def test_bench_checks_out_before_the_run(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    assert main(["bench", "--questions", str(questions), "--out", str(tmp_path / "afile" / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a directory" in err


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe", "not valid UTF-8 JSON"),
    (b"[1, 2]", "must hold a JSON object, not a list"),
])
def test_bad_adapter_json_is_one_line(tmp_path, content, message):
    model = tiny_llama(1)
    backend = tiny_backend(model, exit_layer=1)
    adapter = KangarooAdapter.from_base_layer(model, 1)
    adapter.save(tmp_path / "a", base_fingerprint=backend.fingerprint, exit_layer=1)
    (tmp_path / "a" / "adapter.json").write_bytes(content)
    with pytest.raises(AdapterMismatchError, match=message):
        KangarooDrafter(adapter=str(tmp_path / "a")).bind(backend)


def test_truncated_foreign_or_misshapen_adapter_weights_are_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_llama(1)
    backend = tiny_backend(model, exit_layer=1)
    KangarooAdapter.from_base_layer(model, 1).save(tmp_path / "a", base_fingerprint=backend.fingerprint, exit_layer=1)
    weights = tmp_path / "a" / "adapter.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(AdapterMismatchError, match="not a readable safetensors file"):
        KangarooDrafter(adapter=str(tmp_path / "a")).bind(backend)
    weights.write_bytes(b"GGUF this is something else entirely")
    with pytest.raises(AdapterMismatchError, match="not a readable safetensors file"):
        KangarooDrafter(adapter=str(tmp_path / "a")).bind(backend)
    weights.write_bytes(good)
    state = load_file(weights)
    name = next(k for k in state if k.endswith("q_proj.weight"))
    state[name] = torch.zeros(3, 3, dtype=state[name].dtype)
    save_file(state, weights)
    with pytest.raises(AdapterMismatchError, match="size mismatch"):
        KangarooDrafter(adapter=str(tmp_path / "a")).bind(backend)


def test_invalid_utf8_in_prompt_and_questions_is_one_line(tiny_model_dir, tmp_path, capsys):
    code = main(["generate", "caf\udce9", "--model", str(tiny_model_dir)])  # how Python passes a raw byte argument
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == "kangaroo: error: the prompt is not valid UTF-8"
    questions = tmp_path / "q.jsonl"
    questions.write_bytes(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}).encode() + b"\n\xff\n")
    assert main(["bench", "--questions", str(questions)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "malformed line(s) 2" in err


def test_a_closed_stdout_pipe_keeps_the_stats_line_and_exit_status(tiny_model_dir, monkeypatch, capsys):
    import kangaroo_apps.cli as cli_module

    real_echo = cli_module.click.echo
    written = []

    def echo(message=None, nl=True, err=False, **kwargs):
        if not err:
            written.append(message)
            if len(written) > 1:
                raise BrokenPipeError(32, "Broken pipe")  # `| head -c 5` closed the pipe after the first piece
        return real_echo(message, nl=nl, err=err, **kwargs)

    monkeypatch.setattr(cli_module.click, "echo", echo)
    code = main(["generate", "tell me a story", "--model", str(tiny_model_dir), "--max-new-tokens", "12",
                 "--adapter", "untrained"])
    err = capsys.readouterr().err
    assert code == 0 and err.startswith("[kangaroo] ") and " tokens in " in err and err.count("\n") == 1, err
    assert len(written) == 2  # nothing more was written after the pipe closed


def test_bad_usage_exits_2_and_a_bare_kangaroo_prints_the_help(capsys):
    assert main(["generate", "hi", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert main([]) == 0
    assert "Commands:" in capsys.readouterr().out


def test_the_cli_starts_without_importing_torch():
    """Ctrl-C in the first second must reach the CLI's handler, so nothing heavy is imported before main() runs."""
    code = "import sys, kangaroo_apps.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_engine_options_resolve_plugins_before_loading_the_model(capsys):
    assert main(["generate", "hi", "--policy", "nope", "--model", "/does/not/exist"]) == 1
    assert "unknown policy 'nope'" in capsys.readouterr().err  # not "model path does not exist": no load was tried


def test_policy_create_errors_keep_config_errors_readable():
    from kangaroo_core.plugins import get_registry

    with pytest.raises(ConfigError, match=r"policy 'threshold': eta must be in \[0, 1\], got 2"):
        get_registry().create("policy", "threshold", DecodeConfig(), {"eta": 2})
    with pytest.raises(ConfigError, match=r"^backend 'torch': unknown option\(s\) kernel; valid options: model, device, "
                                          r"dtype, kernels, graphs, cache_size, graph_rows$"):
        get_registry().create("backend", "torch", DecodeConfig(), {"kernel": "plain"})


def test_onnx_backend_keeps_positions_and_returns_deep_states_like_torch(tmp_path):
    pytest.importorskip("onnxruntime")
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_apps.testing import TinyTokenizer

    model = tiny_llama(11, layers=3, dtype=torch.float32)
    export_onnx(model, tmp_path / "b", exit_layer=1, quiet=True)
    onnx = OnnxBackend(model, TinyTokenizer(64), 1, bundle=tmp_path / "b", threads=1, quiet=True)
    eager = tiny_backend(model, exit_layer=1)
    ids = [3, 9, 4, 1, 7, 8, 2]
    outs = []
    for backend in (onnx, eager):
        backend.reset()
        first = backend.deep(backend.shallow(ids, 0), 0, rows=[6])
        backend.keep([0, 1, 2, 5])
        nxt = backend.deep(backend.shallow([5], 4), 4)
        outs.append((first, nxt, backend.cache_lengths()))
    (o1, o2, o_len), (e1, e2, e_len) = outs
    assert o_len == e_len == (5, 5)
    assert o1.logits.shape == (1, 64) and torch.allclose(o1.logits, e1.logits, atol=1e-4)
    assert torch.allclose(o1.hidden, e1.hidden, atol=1e-4) and torch.allclose(o2.logits, e2.logits, atol=1e-4)


def test_bench_context_forwards_drafter_options_and_the_hybrid_measures_only_greedy_drafts(tiny_model_dir):
    from kangaroo_core.bench_context import BenchContext
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_core.config import SamplingConfig
    from kangaroo_plugins.kangaroo.hybrid import HybridDrafter

    opts = EngineOptions(model=str(tiny_model_dir), drafter="kangaroo-hybrid",
                         drafter_options=("prior=0.9", "adapter=untrained"))
    context = BenchContext(opts.backend(), opts.spec())
    drafter = context.engine().drafter
    assert isinstance(drafter, HybridDrafter) and drafter.prior == 0.9 and drafter.measure
    sampled = DecodeConfig(sampling=SamplingConfig(temperature=0.7, sample_drafts=True))
    assert not HybridDrafter.create(sampled).measure  # a drawn draft may not be the lookup token: not evidence


def test_the_exact_replay_refuses_drafters_that_read_deep_states():
    from kangaroo_core.errors import KangarooError
    from kangaroo_plugins.kangaroo.hybrid import HybridDrafter
    from kangaroo_tools.replay import replay_answer

    model = tiny_llama(1)
    backend = tiny_backend(model)
    drafter = HybridDrafter(adapter="untrained")
    drafter.bind(backend)
    with pytest.raises(KangarooError, match="does not model drafters that read the target's deep states"):
        replay_answer(backend, drafter, "qa", [1, 2, 3], [4, 5, 6], gamma=3, max_new_tokens=3)


def test_export_onnx_passes_opset_and_tolerance_to_the_adapter_graph(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bundle"
    assert main(["export-onnx", "--out", str(out), "--model", str(tiny_model_dir), "--opset", "16"]) == 0, \
        capsys.readouterr().err
    (graph,) = (out / "drafters" / "kangaroo").iterdir()
    manifest = json.loads((graph / "adapter_manifest.json").read_text())
    assert manifest["opset"] == 16 and json.loads((out / "manifest.json").read_text())["opset"] == 16
