"""Runs anywhere: every default ships inside the package, no file names a path outside the repository, and every
refusal of bad input comes before (and without) importing torch or loading a model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: files whose text is read for paths (records of measurements included; binary weights and plots are not text)
TEXT = re.compile(r"\.(py|toml|cfg|txt|md|json|jsonl|yml|yaml|c|h|html|js|sh)$|(^|/)(Makefile|run)$")
#: deliberate hostile inputs, each a test that such a path is refused (spelled here so this file does not name it)
HOSTILE = {("tests/test_onnx.py", "/".join(["..", "..", "etc", "passwd"]))}


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # a copy of the tree without .git (an unpacked sdist)
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return listed.stdout.splitlines()


def test_no_file_names_a_path_outside_the_repository():
    """Every relative path that climbs with ``..`` stays inside the repository: a Markdown link from its page's
    folder, anything else (a default, a command in a record) from the repository root where commands run. Nothing
    names the workplace's sibling folders."""
    escapes = []
    for name in tracked_files():
        if not TEXT.search(name) or not (ROOT / name).is_file():
            continue
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        for match in re.finditer(r"(?:\.\./)+[\w./-]*", text):
            path = match.group(0)
            link = text[max(0, match.start() - 2):match.start()] == "]("
            base = (ROOT / name).parent if link else ROOT
            if not (base / path).resolve().is_relative_to(ROOT) and (name, path) not in HOSTILE:
                escapes.append(f"{name}: {path}")
        if re.search(r"(?<![\w.])shared/(data|notes)/", text):
            escapes.append(f"{name}: names shared/")
    assert not escapes, escapes


def test_every_default_file_ships_inside_the_package():
    """The questions, the training prompts and the corpus come from the installed package, not the working
    directory; the compressed prompts read like the plain file and extend the committed corpus (same digest)."""
    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_apps.cli_options import SHIPPED_CORPUS, SHIPPED_PROMPTS, SHIPPED_QUESTIONS
    from kangaroo_tools.corpus import Corpus, file_digest
    from kangaroo_tools.prompts import read_prompts

    questions = Path(SHIPPED_QUESTIONS["default"]())
    prompts = Path(SHIPPED_PROMPTS["default"]())
    corpus = Path(SHIPPED_CORPUS["default"]())
    for path in (questions, prompts, corpus):
        assert path.is_absolute() and path.exists(), path
    assert len(load_questions(questions)) == 30
    assert len(read_prompts(prompts, warn=pytest.fail)) == 8940
    manifest = Corpus(corpus).manifest()
    assert manifest["prompts_digest"] == file_digest(prompts)
    assert {"README.md", "specbench_dev.jsonl", "train_prompts.jsonl.gz"} <= {p.name for p in prompts.parent.iterdir()}


def run_cli(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    """``kangaroo ARGS`` in a fresh interpreter from an empty directory; it prints whether torch was imported."""
    script = ("import sys\nfrom kangaroo_apps.cli import main\ncode = main(sys.argv[1:])\n"
              "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n")
    env = {**os.environ, "KANGAROO_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          cwd=cache, env=env)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """A cache directory holding the command line's copy of the plugins' facts (what `make install` leaves)."""
    cache = tmp_path_factory.mktemp("cache")
    done = run_cli(["plugins", "--json"], cache)
    assert done.returncode == 0, done.stderr
    assert len(list((cache / "plugin-index").glob("*.json"))) == 1
    return cache


def test_help_needs_no_torch(warm_cache):
    for args in (["--help"], ["generate", "--help"], ["bench", "--help"], ["serve", "--help"]):
        done = run_cli(args, warm_cache)
        assert done.returncode == 0, done.stderr
        assert "torch imported: False" in done.stderr, (args, done.stderr)
    assert "--onnx-dir" in run_cli(["generate", "--help"], warm_cache).stdout  # a backend plugin's own flag


def test_a_missing_copy_of_the_facts_is_made_again(tmp_path):
    """No copy yet (or an unreadable one): the plugins are loaded once and the copy written."""
    done = run_cli(["generate", "--help"], tmp_path)
    assert done.returncode == 0 and "--onnx-dir" in done.stdout
    index = next((tmp_path / "plugin-index").glob("*.json"))
    index.write_text("{broken")
    assert run_cli(["generate", "--help"], tmp_path).returncode == 0
    assert json.loads(index.read_text())["names"]["verifier"] == ["greedy", "speculative"]


@pytest.fixture
def bad_files(tmp_path) -> dict[str, Path]:
    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("\n")
    bad.write_text("not json\n")
    return {"missing": tmp_path / "missing.jsonl", "empty": empty, "bad": bad}


REFUSALS = [
    (lambda f: ["generate", "--prompts", str(f["missing"])], "cannot read prompts file"),
    (lambda f: ["generate", "--prompts", str(f["empty"])], "holds no prompts"),
    (lambda f: ["generate", "--prompts", str(f["bad"])], "not a JSON object"),
    (lambda f: ["train-policy", "--out", str(f["missing"].parent / "p"), "--prompts", str(f["missing"])],
     "prompts file not found"),
    (lambda f: ["generate", "hi", "--verifier", "greedy", "--temperature", "0.7"],
     "the greedy verifier is only lossless at temperature 0"),
    (lambda f: ["generate", "hi", "--backend", "onnx", "--onnx-dir", str(f["missing"].parent / "nonexistent")],
     "does not exist"),
    (lambda f: ["generate", "hi", "--policy", "nope"], "unknown policy 'nope'; known policy plugins:"),
    (lambda f: ["generate", "hi", "--policy-option", "foo=1"], "policy 'cost': unknown option(s) foo"),
    (lambda f: ["generate", "hi", "--drafter", "kangaroo", "--drafter-option", "bogus=2"],
     "drafter 'kangaroo': unknown option(s) bogus"),
    (lambda f: ["demo", "--questions", str(f["missing"])], "questions file not found"),
    (lambda f: ["bench", "--questions", str(f["bad"])], "bad.jsonl"),
    (lambda f: ["corpus", "build", "--prompts", str(f["missing"].parent / "specbench_dev.jsonl")],
     "Spec-Bench is for evaluation only"),
]


@pytest.mark.parametrize("make_args, message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_bad_input_is_refused_in_one_line_before_torch(warm_cache, bad_files, make_args, message):
    """Each refusal is one line and comes before any model loads: torch is never imported (that is also what
    keeps it under a second)."""
    done = run_cli(make_args(bad_files), warm_cache)
    assert done.returncode in (1, 2), done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "torch imported: False", done.stderr
    assert len(lines) == 2 and lines[0].startswith("kangaroo: error: ") and message in lines[0], done.stderr


def test_the_python_api_refuses_a_greedy_verifier_under_sampling_before_loading(tmp_path):
    """The composition root checks the verifier against the sampling settings before the backend loads: a model
    path that does not exist is never reached."""
    from kangaroo_core.assembly import EngineSpec
    from kangaroo_core.config import ConfigError, DecodeConfig, SamplingConfig
    from kangaroo_core.engine import assemble

    spec = EngineSpec(model=str(tmp_path / "no-model"), verifier="greedy",
                      config=DecodeConfig(sampling=SamplingConfig(temperature=0.7)))
    with pytest.raises(ConfigError, match="only lossless at temperature 0"):
        assemble(spec)
