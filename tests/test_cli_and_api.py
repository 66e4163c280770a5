"""CLI and Python API on a tiny random Llama directory (fast), including every user-error path."""

import json
import subprocess
import sys

import pytest
import torch

from kangaroo_apps.cli import main
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.errors import AdapterMismatchError, PromptError
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter

PROMPT = "tell me a story about the sea"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.build(str(tiny_model_dir), config=DecodeConfig(exit_layer=2, max_new_tokens=12, eta=0.0, gamma=3))


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_matches_transformers_greedy(tiny_model_dir, engine, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "12",
                              "--eta", "0", "--gamma", "3", "--json"], capsys)
    assert code == 0, err
    payload = json.loads(out)
    for key in ("text", "token_ids", "new_tokens", "rounds", "mean_accepted_tokens", "ctar", "seconds"):
        assert key in payload
    ids = engine.encode(PROMPT)
    reference = engine.backend.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
    assert payload["token_ids"] == reference.tolist()
    assert payload["new_tokens"] == len(payload["token_ids"])
    assert len(payload["ctar"]) == 3


def test_generate_streams_text_and_prints_stats(tiny_model_dir, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "8"], capsys)
    assert code == 0, err
    assert out.strip()
    assert err.startswith("[kangaroo] ") and "CTAR(1..6)" in err and "verify passes" in err


def test_compare_reports_speedup_and_identity(tiny_model_dir, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "8",
                              "--compare", "--json"], capsys)
    assert code == 0, err
    payload = json.loads(out)
    assert payload["identical_to_vanilla"] is True
    assert payload["speedup"] > 0


def test_compare_repeats_interleave_pairs_and_report_medians(tiny_model_dir, capsys):
    base = ["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--compare", "--repeats", "3"]
    code, out, err = run_cli(base + ["--json"], capsys)
    assert code == 0, err
    payload = json.loads(out)
    vanilla, kangaroo = payload["vanilla_tokens_per_second"], payload["kangaroo_tokens_per_second"]
    assert payload["repeats"] == 3 and len(vanilla) == len(kangaroo) == 3 and payload["identical_to_vanilla"] is True
    assert payload["speedup"] == pytest.approx(sorted(kangaroo)[1] / sorted(vanilla)[1])
    code, out, err = run_cli(base, capsys)
    assert code == 0, err
    assert "[compare] median of 3 interleaved runs" in err and "identical to vanilla on every run: yes" in err
    assert out.strip()  # the first Kangaroo run still streams its text



def test_sampling_json_is_reproducible(tiny_model_dir, capsys):
    base = ["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "10", "--temperature", "0.7",
            "--top-p", "0.9"]
    runs = {}
    for name, extra in [("a", ["--seed", "1"]), ("b", ["--seed", "1"]), ("draft", ["--seed", "1", "--draft-sampling"]),
                        ("vanilla", ["--seed", "1", "--vanilla"])]:
        code, out, err = run_cli(base + extra + ["--json"], capsys)
        assert code == 0, err
        runs[name] = json.loads(out)
    assert runs["a"]["token_ids"] == runs["b"]["token_ids"] and runs["a"]["new_tokens"] >= 1
    assert runs["vanilla"]["method"] == "vanilla" and runs["vanilla"]["mean_drafted"] == 0
    code, out, err = run_cli(base + ["--top-k", "5", "--seed", "1"], capsys)  # streaming: the stats still print
    assert code == 0 and err.startswith("[kangaroo] ") and "CTAR(1..6)" in err, err
    code, out, err = run_cli(base + ["--seed", "1", "--compare", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["identical_to_vanilla"] is None  # sampling: same distribution, not the same draws


def test_greedy_verifier_with_temperature_is_a_one_line_error(tiny_model_dir, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_model_dir), "--temperature", "0.7",
                              "--verifier", "greedy"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "greedy verifier is only lossless at temperature 0" in err


def test_vanilla_flag_drafts_nothing(tiny_model_dir, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "6",
                              "--vanilla", "--json"], capsys)
    assert code == 0, err
    payload = json.loads(out)
    assert payload["mean_drafted"] == 0 and payload["new_tokens"] == 6


def test_stream_pieces_concatenate_to_the_text(engine):
    stream = engine.stream(PROMPT)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    assert stream.result.new_tokens == 12


def test_exact_max_new_tokens_without_eos(tiny_model_dir):
    # no EOS in the generation config: generation must run to exactly max_new_tokens, for any budget
    eng = Engine.build(str(tiny_model_dir), config=DecodeConfig(exit_layer=1, eta=0.0, gamma=6))
    eng.backend.eos_token_ids = frozenset()
    for n in (1, 2, 5, 7, 13):
        assert eng.generate(PROMPT, max_new_tokens=n).new_tokens == n


def adapter_dir(tmp_path, engine, exit_layer=2):
    adapter = KangarooAdapter.from_base_layer(engine.backend.model, exit_layer)
    return adapter.save(tmp_path / "adapter", base_fingerprint=engine.backend.fingerprint, exit_layer=exit_layer)


def test_adapter_file_round_trip(tmp_path, engine, tiny_model_dir):
    path = adapter_dir(tmp_path, engine)
    meta = json.loads((path / "adapter.json").read_text())
    assert meta["exit_layer"] == 2 and meta["base_model_fingerprint"] == engine.backend.fingerprint
    loaded = KangarooAdapter.load(path, engine.backend.model, base_fingerprint=engine.backend.fingerprint, exit_layer=2)
    fresh = KangarooAdapter.from_base_layer(engine.backend.model, 2)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    with_adapter = Engine.build(str(tiny_model_dir), config=engine.config, adapter=str(path))
    assert with_adapter.generate(PROMPT).token_ids == engine.generate(PROMPT).token_ids


def test_adapter_for_another_layer_or_model_is_refused(tmp_path, engine, other_tiny_model_dir):
    path = adapter_dir(tmp_path, engine)
    with pytest.raises(AdapterMismatchError, match="exit layer 2, but exit layer 1 was requested"):
        KangarooAdapter.load(path, engine.backend.model, base_fingerprint=engine.backend.fingerprint, exit_layer=1)
    with pytest.raises(AdapterMismatchError, match="was made for base model"):
        Engine.build(str(other_tiny_model_dir), config=engine.config, adapter=str(path))


def test_prompt_errors(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.generate("   ")
    with pytest.raises(PromptError, match="exceeds the model's context of 128 tokens"):
        engine.generate(" ".join(["sea"] * 200))


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", ""], "the prompt is empty"),
        (["generate", "hi", "--eta", "1.5"], "eta must be in [0, 1], got 1.5"),
        (["generate", "hi", "--gamma", "0"], "gamma must be an integer >= 1, got 0"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1, got 0"),
        (["generate", "hi", "--policy", "nope"], "unknown policy 'nope'; known policy plugins: "),
        (["generate", "hi", "--drafter", "nope"], "unknown drafter 'nope'"),
        (["generate", "hi", "--backend", "nope"], "unknown backend 'nope'"),
        (["generate", "hi", "--model", "/does/not/exist"], "model path does not exist: /does/not/exist"),
        (["generate", "hi", "--eta", "abc"], "'abc' is not a valid float"),
        (["generate", "hi", "--vanilla", "--compare"], "--vanilla and --compare exclude each other"),
        (["generate", "hi", "--repeats", "3"], "--repeats applies to --compare"),
        (["generate"], "give a PROMPT or --prompts FILE.jsonl"),
        (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["generate", "hi", "--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
        (["generate", "hi", "--top-k", "-2"], "top_k must be an integer >= 0, got -2"),
        (["generate", "hi", "--seed", "x"], "'x' is not a valid integer"),
    ],
)
def test_cli_user_errors_are_one_line(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("kangaroo: error: ") and message in err, err


def test_cli_model_and_adapter_errors(tmp_path, engine, tiny_model_dir, other_tiny_model_dir, capsys):
    path = adapter_dir(tmp_path, engine)
    long_prompt = " ".join(["sea"] * 200)
    cases = [
        (["--model", str(tiny_model_dir), long_prompt], "exceeds the model's context"),
        (["--model", str(tiny_model_dir), "--exit-layer", "4", "hi"], "exit_layer must be in [1, 3]"),
        (["--model", str(tiny_model_dir), "--adapter", str(tmp_path / "missing"), "hi"], "is not an adapter directory"),
        (["--model", str(other_tiny_model_dir), "--adapter", str(path), "hi"], "was made for base model"),
        (["--model", str(tiny_model_dir), "--adapter", str(path), "--exit-layer", "1", "hi"], "trained at exit layer 2"),
        (["--model", str(tiny_model_dir / "config.json"), "hi"], "not a .gguf file"),
        (["--model", str(tmp_path), "hi"], "not a HF model directory"),
    ]
    for args, message in cases:
        code, out, err = run_cli(["generate", *args], capsys)
        assert code == 1 and err.count("\n") == 1 and message in err, (args, err)


def test_console_script_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "kangaroo_apps.cli", "generate", "hi", "--eta", "7"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "kangaroo: error: eta must be in [0, 1], got 7.0"
    assert "Traceback" not in proc.stderr


def test_shipped_adapter_is_the_default_for_its_base_model(tmp_path, engine, tiny_model_dir, monkeypatch):
    from kangaroo_plugins.kangaroo import drafter as kangaroo_drafter

    shipped = tmp_path / "shipped"
    adapter = KangarooAdapter.from_base_layer(engine.backend.model, 2)
    with torch.no_grad():
        adapter.output_norm.weight.mul_(3.0)  # distinguishable from the untrained initialisation
    adapter.save(shipped / "tiny-l2", base_fingerprint=engine.backend.fingerprint, exit_layer=2)
    monkeypatch.setattr(kangaroo_drafter, "SHIPPED_ADAPTERS", shipped)
    default = kangaroo_drafter.KangarooDrafter()
    default.bind(engine.backend)
    assert default.resolved_adapter == str(shipped / "tiny-l2")
    assert torch.equal(default.adapter.output_norm.weight, adapter.output_norm.weight)
    untrained = kangaroo_drafter.KangarooDrafter(adapter="untrained")
    untrained.bind(engine.backend)
    assert untrained.resolved_adapter is None
    other_layer = Engine.build(str(tiny_model_dir), config=DecodeConfig(exit_layer=1, max_new_tokens=4))
    assert other_layer.drafter.resolved_adapter is None  # no shipped adapter for exit layer 1
    # two shipped adapters for the same model and layer: the one marked default wins; the other is picked by name
    adapter.save(shipped / "a-first-by-name", base_fingerprint=engine.backend.fingerprint, exit_layer=2)
    meta = json.loads((shipped / "tiny-l2" / "adapter.json").read_text())
    (shipped / "tiny-l2" / "adapter.json").write_text(json.dumps({**meta, "default": True}))
    again = kangaroo_drafter.KangarooDrafter()
    again.bind(engine.backend)
    assert again.resolved_adapter == str(shipped / "tiny-l2")
    by_name = kangaroo_drafter.KangarooDrafter(adapter="a-first-by-name")
    by_name.bind(engine.backend)
    assert by_name.resolved_adapter == str(shipped / "a-first-by-name")


def test_engine_options_from_the_generate_flags():
    from kangaroo_apps.cli_options import EngineOptions

    opts = EngineOptions.from_args(["--tree", "dynamic", "--tree-budget", "4", "--eta", "0.3", "--threads", "1"])
    assert opts.tree == "dynamic" and opts.eta == 0.3 and opts.threads == 1
    assert opts.parsed_tree_options() == {"budget": 4}
    assert EngineOptions.from_args([]) == EngineOptions()
