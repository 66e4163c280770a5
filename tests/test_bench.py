"""`kangaroo bench` on the tiny random Llama: a smoke run (2 questions, one two-turn MT-bench item, 8 tokens), the
results.json schema, losslessness of every greedy method, speedups, run-time registered methods, sweeps, errors."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from kangaroo_backends.onnx_bundle import EXPORT_KEY, FORMAT_VERSION
from kangaroo_core import plugins
from kangaroo_core.bench_context import BenchMethod, MethodResult
from kangaroo_apps.bench.harness import METRIC_KEYS, metrics, rotate
from kangaroo_apps.cli import main
from kangaroo_core.hookspecs import hookimpl

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["tell me a story about the sea", "why is the sky blue"],
     "subtask": "mt_bench"},
    {"question_id": 7, "category": "qa", "turns": ["what is the cat"], "subtask": "qa"},
]


def _has_optimum() -> bool:
    try:
        return importlib.util.find_spec("optimum.onnxruntime") is not None
    except ModuleNotFoundError:
        return False


BUILTIN = ["hf_vanilla", "hf_prompt_lookup", "hf_static", "hf_early_exit", "vanilla", "kangaroo", "kangaroo_hybrid", "kangaroo_tree", "ort_vanilla", "vanilla_onnx",
           "kangaroo_onnx", "kangaroo_onnx_hybrid", "kangaroo_onnx_tree"]
#: optimum-onnx (ort_vanilla) needs transformers 4.x: under 5.x the method is there but reports the install hint
HAS_OPTIMUM = _has_optimum()
RUNNABLE = [name for name in BUILTIN if HAS_OPTIMUM or name != "ort_vanilla"]
SEEN: list[list[dict]] = []


class EchoVanilla(BenchMethod):
    """A third-party method: our engine without drafting, recording the conversations it is shown."""

    name = "third_party_echo"

    def prepare(self, context):
        self.engine = context.engine(drafter=None)

    def run(self, messages, max_new_tokens):
        SEEN.append([dict(m) for m in messages])
        result = self.engine.generate(list(messages), max_new_tokens=max_new_tokens)
        return MethodResult(result.token_ids, result.seconds, rounds=result.rounds)

    def build(self):  # a peer's library would name its version and instruction sets here
        return "echo 1.0 (AVX2 = 1)"


class Explodes(BenchMethod):
    name = "third_party_explodes"

    def prepare(self, context):
        pass

    def run(self, messages, max_new_tokens):
        raise RuntimeError("kaboom")


class ThirdPartyPlugin:
    @hookimpl
    def register_bench_methods(self, register):
        register("third_party_echo", EchoVanilla)
        register("third_party_explodes", Explodes)


def write_questions(path, items):
    path.write_text("".join(json.dumps(q) + "\n" for q in items))
    return path


@pytest.fixture(scope="module")
def smoke(tiny_model_dir, tmp_path_factory, one_torch_thread):
    """One bench run with every registered method, a third-party plugin registered at run time included."""
    root = tmp_path_factory.mktemp("bench")
    questions = write_questions(root / "questions.jsonl", QUESTIONS)
    out = root / "out"
    plugins.register_plugin(ThirdPartyPlugin(), "third-party-bench")
    cache = os.environ.get("KANGAROO_CACHE_DIR")
    os.environ["KANGAROO_CACHE_DIR"] = str(root / "cache")  # the ONNX methods export into it
    try:
        # the threshold policy at eta 0: every method drafts the same gamma per round whatever its backend costs
        code = main(["bench", "--questions", str(questions), "--out", str(out), "--model", str(tiny_model_dir),
                     "--max-new-tokens", "8", "--gamma", "3", "--eta", "0", "--policy", "threshold"])
    finally:
        plugins.unregister_plugin("third-party-bench")
        if cache is None:
            os.environ.pop("KANGAROO_CACHE_DIR")
        else:
            os.environ["KANGAROO_CACHE_DIR"] = cache
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_run_writes_every_output_with_the_schema(smoke):
    out, results = smoke
    for name in ("results.json", "results.md", "ctar.png", "speedup.png"):
        assert (out / name).stat().st_size > 0, name
    assert set(BUILTIN) <= set(results["methods"]) and set(BUILTIN) <= set(results["speedup"])
    assert results["subtasks"] == ["mt_bench", "qa"]
    if not HAS_OPTIMUM:
        assert "ort_vanilla needs optimum-onnx" in results["methods"]["ort_vanilla"]["error"]
    for name in RUNNABLE:
        entry = results["methods"][name]
        assert entry["error"] is None
        assert set(entry["per_subtask"]) == {"mt_bench", "qa"}
        for scope in [*entry["per_subtask"].values(), entry["overall"]]:
            assert set(METRIC_KEYS) <= set(scope)
            assert scope["new_tokens"] > 0 and scope["seconds"] > 0 and scope["tokens_per_second"] > 0
        assert set(results["speedup"][name]) == {"mt_bench", "qa", "overall"}
    overall = results["methods"]["kangaroo"]["overall"]
    assert overall["runs"] == 3  # two MT-bench turns + one QA turn
    assert len(overall["ctar"]) == 6 and overall["mean_accepted_tokens"] >= 1.0
    assert results["methods"]["hf_vanilla"]["overall"]["mean_accepted_tokens"] == 1.0
    md = (out / "results.md").read_text()
    assert "| kangaroo |" in md and "MT-bench" in md and "--max-new-tokens 8" in md
    # a method naming its build has it in both files; kangaroo's own methods add nothing
    assert results["run"]["builds"] == {"third_party_echo": "echo 1.0 (AVX2 = 1)"}
    assert "- third_party_echo build: echo 1.0 (AVX2 = 1)" in md


def test_every_greedy_method_is_identical_to_hf_vanilla(smoke):
    _, results = smoke
    for name in [*RUNNABLE, "third_party_echo"]:
        entry = results["methods"][name]
        assert entry["overall"]["identical_to_vanilla"] is True, name
        assert all(s["identical_to_vanilla"] is True for s in entry["per_subtask"].values()), name


def test_drafting_methods_are_checked_against_their_own_target_alone(smoke):
    """kangaroo runs the backend of `vanilla`, kangaroo_onnx that of `vanilla_onnx`: both pairs ran, so the bench
    says per scope whether every turn equals the target alone; methods without a target alone say nothing."""
    out, results = smoke
    for name in ("kangaroo", "kangaroo_hybrid", "kangaroo_tree", "kangaroo_onnx", "kangaroo_onnx_hybrid"):
        entry = results["methods"][name]
        assert entry["overall"]["identical_to_target_alone"] is True, name
        assert all(s["identical_to_target_alone"] is True for s in entry["per_subtask"].values()), name
    assert results["methods"]["hf_vanilla"]["overall"]["identical_to_target_alone"] is None
    assert "= its target alone" in (out / "results.md").read_text()


class Scripted(BenchMethod):
    """Answers every turn with fixed tokens (a stand-in for a method's output, not for a model)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def prepare(self, context):
        pass

    def run(self, messages, max_new_tokens):
        return MethodResult(list(self.tokens), 0.01)


def test_a_method_differing_from_its_target_alone_is_reported():
    from types import SimpleNamespace

    from kangaroo_apps.bench.harness import run_bench, summarize
    from kangaroo_apps.bench.questions import Question

    def method(name, tokens, target_alone=""):
        m = Scripted(tokens)
        m.name, m.target_alone = name, target_alone
        return m

    context = SimpleNamespace(config=SimpleNamespace(sampling=SimpleNamespace(greedy=True)),
                              tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "answer"))
    methods = [("hf_vanilla", method("hf_vanilla", [1, 2, 3])),
               ("alone", method("alone", [1, 2, 4])),  # differs from transformers by design (int8, say)
               ("same", method("same", [1, 2, 4], target_alone="alone")),
               ("broken", method("broken", [1, 2, 5], target_alone="alone")),
               ("orphan", method("orphan", [1, 2, 4], target_alone="not_in_this_run"))]
    run = run_bench(context, methods, [Question("1", "qa", ("q",))], max_new_tokens=3, warmup=False, progress=False)
    overall = {label: entry["overall"] for label, entry in summarize(run)["methods"].items()}
    assert overall["same"]["identical_to_target_alone"] is True and overall["same"]["identical_to_vanilla"] is False
    assert overall["broken"]["identical_to_target_alone"] is False
    assert (overall["same"]["identical_turns"], overall["hf_vanilla"]["identical_turns"], overall["same"]["runs"]) == (0, 1, 1)
    assert overall["orphan"]["identical_to_target_alone"] is None and overall["alone"]["identical_to_target_alone"] is None


def test_speedup_is_the_tokens_per_second_ratio_to_hf_vanilla(smoke):
    _, results = smoke
    ref = results["methods"]["hf_vanilla"]
    for name, row in results["speedup"].items():
        if results["methods"][name]["error"]:
            assert all(v is None for v in row.values())
            continue
        mine = results["methods"][name]
        assert row["overall"] == pytest.approx(mine["overall"]["tokens_per_second"] / ref["overall"]["tokens_per_second"])
        for s in ("mt_bench", "qa"):
            expected = mine["per_subtask"][s]["tokens_per_second"] / ref["per_subtask"][s]["tokens_per_second"]
            assert row[s] == pytest.approx(expected)
    assert results["speedup"]["hf_vanilla"]["overall"] == pytest.approx(1.0)


def test_runtime_registered_methods_show_up_and_failures_are_reported(smoke):
    _, results = smoke
    assert results["methods"]["third_party_echo"]["overall"]["runs"] == 3
    error = results["methods"]["third_party_explodes"]["error"]
    assert "RuntimeError: kaboom" in error and results["methods"]["third_party_explodes"]["overall"]["runs"] == 0


def test_second_turn_follows_the_reference_answer(smoke):
    second = [m for m in SEEN if len(m) == 3]
    assert second, "the two-turn item was never asked its second turn"
    first_answers = {m[1]["content"] for m in second}
    assert len(first_answers) == 1  # the same conversation for every run
    assert [m["role"] for m in second[0]] == ["user", "assistant", "user"]
    assert second[0][0]["content"] == QUESTIONS[0]["turns"][0] and second[0][2]["content"] == QUESTIONS[0]["turns"][1]


def test_sweeps_and_adapter_comparison_write_json_and_png(tiny_model_dir, tmp_path, one_torch_thread):
    from kangaroo_backends.loading import load_model
    from kangaroo_backends.torch_backend import model_fingerprint
    from kangaroo_plugins.kangaroo.adapter import KangarooAdapter

    model, _, _ = load_model(str(tiny_model_dir))
    dirs = []
    for layer in (1, 2):
        adapter = KangarooAdapter.from_base_layer(model, layer)
        dirs.append(str(adapter.save(tmp_path / f"l{layer}", base_fingerprint=model_fingerprint(model), exit_layer=layer)))
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[1:])
    out = tmp_path / "out"
    code = main(["bench", "--questions", str(questions), "--out", str(out), "--model", str(tiny_model_dir),
                 "--max-new-tokens", "4", "--no-warmup", "--no-progress", "--threads", "1", "--sweep-eta", "0,0.9",
                 "--sweep-gamma", "2,3", "--adapters", ",".join(dirs)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    sweep = json.loads((out / "sweep.json").read_text())["points"]
    assert {(p["eta"], p["gamma"]) for p in sweep} == {(0.0, 2), (0.9, 2), (0.0, 3), (0.9, 3)}
    assert all(p["speedup"] and p["mean_accepted_tokens"] for p in sweep)
    adapters = json.loads((out / "adapters.json").read_text())["adapters"]
    assert [a["exit_layer"] for a in adapters] == [1, 2] and all(a["error"] is None for a in adapters)
    assert all(results["methods"][a["label"]]["overall"]["identical_to_vanilla"] for a in adapters)
    for name in ("sweep_eta_gamma.png", "adapters.png", "results.md"):
        assert (out / name).stat().st_size > 0
    assert set(results["methods"]) == {"hf_vanilla", *(p["label"] for p in sweep), *(a["label"] for a in adapters)}


def test_onnx_methods_export_once_into_the_cache(smoke):
    out, results = smoke
    cache = out.parent / "cache"
    if HAS_OPTIMUM:
        assert (next((cache / "ort").iterdir()) / "model.onnx").is_file()  # optimum's export for ort_vanilla
        assert results["methods"]["ort_vanilla"]["overall"]["mean_accepted_tokens"] is None  # no layers to count
    exports = [d for d in (cache / "onnx" / EXPORT_KEY).iterdir() if (d / "manifest.json").is_file()]  # our split graphs
    assert len(exports) == 1
    assert list((exports[0] / "drafters" / "kangaroo").glob("*/adapter.onnx"))  # the drafter's graph beside them
    assert results["methods"]["kangaroo_onnx"]["overall"]["mean_accepted_tokens"] == pytest.approx(
        results["methods"]["kangaroo"]["overall"]["mean_accepted_tokens"])  # same drafts, same rounds


def test_ort_vanilla_without_optimum_gives_the_install_hint(monkeypatch):
    from kangaroo_core.errors import MissingDependencyError
    from kangaroo_plugins.onnx_bench_methods import import_ort_model

    monkeypatch.setitem(sys.modules, "optimum.onnxruntime", None)  # import fails as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install optimum-onnx onnxruntime \(kangaroo's \[optimum\] extra"):
        import_ort_model()


def test_policy_columns_and_baseline(tiny_model_dir, tmp_path, one_torch_thread, capsys):
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[1:])
    out = tmp_path / "out"
    code = main(["bench", "--questions", str(questions), "--out", str(out), "--model", str(tiny_model_dir),
                 "--max-new-tokens", "6", "--no-warmup", "--no-progress", "--threads", "1", "--methods", "vanilla",
                 "--policies", "fixed,oracle,adaptive:pivot=0.5:eta_unsure=0.9", "--baseline", "vanilla",
                 "--policy", "threshold", "--policy-option", "eta=0.3"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    labels = ["kangaroo[policy=fixed]", "kangaroo[policy=oracle]", "kangaroo[policy=adaptive:pivot=0.5:eta_unsure=0.9]"]
    assert list(results["methods"]) == ["hf_vanilla", "vanilla", *labels]
    assert results["baseline"] == "vanilla" and results["speedup"]["vanilla"]["overall"] == pytest.approx(1.0)
    assert all(results["methods"][label]["overall"]["identical_to_vanilla"] for label in labels)
    assert results["run"]["config"]["policy_options"] == {"eta": 0.3}
    assert "Speedup vs `vanilla`" in (out / "results.md").read_text()
    assert main(["bench", "--questions", str(questions), "--model", str(tiny_model_dir), "--baseline", "nope"]) == 2
    assert "--baseline 'nope' is not one of the measured methods" in capsys.readouterr().err
    assert main(["bench", "--questions", str(questions), "--model", str(tiny_model_dir), "--policies", "psychic"]) == 2
    assert "--policies: unknown policy 'psychic'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"turns": ["hi"], "subtask": "qa"}', "not json", '{"turns": []}', '{"turns": ["ok"]}'],
         r"malformed line\(s\) 2, 3 \(line 2: not JSON"),
        ([""], "has no questions"),
    ],
)
def test_bad_questions_file_is_a_one_line_error(tmp_path, capsys, lines, message):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["bench", "--questions", str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kangaroo: error:") and "\n" not in err
    assert pytest.importorskip("re").search(message, err), err


def test_missing_questions_file_and_unknown_method(tmp_path, capsys):
    assert main(["bench", "--questions", str(tmp_path / "nope.jsonl")]) == 1
    assert "questions file not found" in capsys.readouterr().err
    path = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    assert main(["bench", "--questions", str(path), "--methods", "kangaroo,warp_drive"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown bench method(s) warp_drive; known bench methods: " + ", ".join(BUILTIN) in err


def test_metrics_pool_rounds_and_passes():
    from kangaroo_apps.bench.harness import Record
    from kangaroo_core.results import RoundResult

    rounds = [RoundResult(3, 3, 4, 0.3, 0.1), RoundResult(2, 0, 1, 0.1, 0.1)]
    ours = Record("k", "qa", "1", 1, 0, MethodResult([1] * 6, 2.0, rounds=rounds), True)
    m = metrics([ours], greedy=True)
    assert m["mean_accepted_tokens"] == 2.5 and m["ctar"] == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]
    assert m["tokens_per_second"] == 3.0 and m["mean_drafted"] == 2.5 and m["draft_share"] == pytest.approx(4 / 6)
    hf = Record("h", "qa", "1", 1, 0, MethodResult([1] * 4, 1.0, target_passes=2, generated_tokens=6), None)
    m = metrics([hf], greedy=True)
    assert m["mean_accepted_tokens"] == 3.0 and m["ctar"] is None and m["identical_to_vanilla"] is None
    assert rotate(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_sampling_skips_the_identity_check(tiny_model_dir, tmp_path, one_torch_thread):
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[1:])
    out = tmp_path / "out"
    assert main(["bench", "--questions", str(questions), "--out", str(out), "--model", str(tiny_model_dir),
                 "--max-new-tokens", "4", "--no-warmup", "--no-progress", "--methods", "hf_vanilla,kangaroo",
                 "--temperature", "0.7", "--seed", "1"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"hf_vanilla", "kangaroo"}
    for entry in results["methods"].values():
        assert entry["error"] is None and entry["overall"]["identical_to_vanilla"] is None


def test_adapters_give_one_column_per_drafting_method(tmp_path):
    from kangaroo_apps.cli import _adapter_specs

    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter.json").write_text(json.dumps({"exit_layer": 2, "architecture": {"ffn": True}}))
    text = f"{tmp_path / 'old'},{tmp_path / 'new'}"
    specs, points = _adapter_specs(text, ["hf_vanilla", "vanilla_onnx_gguf_int8", "kangaroo", "kangaroo_onnx_gguf_int8"])
    assert [s.label for s in specs] == ["kangaroo[adapter=old]", "kangaroo_onnx_gguf_int8[adapter=old]",
                                        "kangaroo[adapter=new]", "kangaroo_onnx_gguf_int8[adapter=new]"]
    assert all(s.options == {"adapter": str(tmp_path / p["name"]), "exit_layer": 2} for s, p in zip(specs, points))
    assert [s.label for s in _adapter_specs(text, [])[0]] == ["kangaroo[adapter=old]", "kangaroo[adapter=new]"]
