"""The tutorials' example packages (docs/examples/) are installed by `make install`; CI proves they work.

Each is listed by `kangaroo plugins`, resolved by the engine by name, and keeps the output token-identical to
transformers' greedy generate (the backend example: to the torch backend) on the tiny model. The compose tutorial's
script runs as is.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from kangaroo_core import DecodeConfig
from kangaroo_apps.cli import main
from kangaroo_core.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
# (distribution, entry-point name, kind, registered name, module)
PACKAGES = [
    ("kangaroo-entropy-policy", "entropy", "policy", "entropy", "kangaroo_entropy_policy"),
    ("kangaroo-prompt-lookup", "prompt-lookup", "drafter", "prompt-lookup", "kangaroo_prompt_lookup"),
    ("kangaroo-pass-log", "pass-log", "backend", "pass-log", "kangaroo_pass_log"),
]
PROMPT = "the cat runs and the cat runs and the cat"


def test_every_example_package_is_tested_here():
    packages = sorted(p.name for p in EXAMPLES.iterdir() if (p / "pyproject.toml").exists())
    assert packages == sorted(dist for dist, *_ in PACKAGES)
    makefile = (ROOT / "Makefile").read_text()
    for dist, *_ in PACKAGES:
        assert f"docs/examples/{dist}" in makefile, f"make install does not install {dist}"


@pytest.mark.parametrize("dist, ep, kind, name, module", PACKAGES)
def test_kangaroo_plugins_lists_the_example(dist, ep, kind, name, module, capsys, fresh_global_registry):
    assert main(["plugins", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert ep in listed, f"{dist} is not installed: run `make install` (pip install -e docs/examples/{dist})"
    assert listed[ep]["distribution"] == dist
    assert listed[ep]["registers"] == {kind: [name]}
    assert listed[ep]["errors"] == []


@pytest.mark.parametrize("dist, ep, kind, name, module", PACKAGES)
def test_the_example_declares_its_entry_point(dist, ep, kind, name, module):
    text = (EXAMPLES / dist / "pyproject.toml").read_text()
    assert "[project.entry-points.kangaroo]" in text
    assert f'{ep} = "{module}"' in text


@pytest.mark.parametrize("drafter, policy, options", [
    ("prompt-lookup", "threshold", {}),
    ("kangaroo", "entropy", {"max_entropy": 3.0}),
    ("prompt-lookup", "entropy", {"max_entropy": 0.5}),
])
def test_engine_resolves_examples_by_name_and_stays_lossless(tiny_model_dir, drafter, policy, options, one_torch_thread):
    engine = Engine.build(str(tiny_model_dir), config=DecodeConfig(exit_layer=2, max_new_tokens=16, gamma=4),
                          drafter=drafter, policy=policy, policy_options=options)
    assert type(engine.policy).__name__ == {"entropy": "EntropyPolicy", "threshold": "ThresholdPolicy"}[policy]
    ids = engine.encode(PROMPT)
    result = engine.generate_ids(ids)
    with torch.inference_mode():
        reference = engine.backend.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert result.token_ids == reference.tolist()[: len(result.token_ids)]
    assert len(result.token_ids) == 16 or result.stopped_on_eos


def test_engine_resolves_the_backend_example_by_name_and_logs_every_pass(tiny_model_dir, tmp_path, one_torch_thread):
    config = DecodeConfig(exit_layer=2, max_new_tokens=16, gamma=4)
    log = tmp_path / "passes.jsonl"
    # the threshold policy: the default cost-aware one times the backend's passes when the engine is built
    engine = Engine.build(str(tiny_model_dir), config=config, backend="pass-log", backend_options={"log": str(log)},
                          policy="threshold")
    assert type(engine.backend).__name__ == "PassLogBackend"
    result = engine.generate_ids(engine.encode(PROMPT))
    reference = Engine.build(str(tiny_model_dir), config=config, backend="torch").generate_ids(engine.encode(PROMPT))
    assert result.token_ids == reference.token_ids
    passes = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(passes) == len(engine.backend.passes) > 0
    assert sum(p["part"] == "deep" for p in passes) == 1 + result.num_rounds  # the prefill + one verify pass a round


def test_compose_tutorial_script_runs(tiny_model_dir, capsys, one_torch_thread):
    spec = importlib.util.spec_from_file_location("compose_engine", EXAMPLES / "compose_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stats = module.main(str(tiny_model_dir), PROMPT, max_new_tokens=12)  # asserts identity with the target alone
    assert stats["new_tokens"] == 12 or stats["stopped_on_eos"]
    assert "tokens in" in capsys.readouterr().out


def test_tutorials_include_the_example_code_instead_of_copying_it():
    """Tutorial code comes from the files (pymdownx.snippets), so it cannot drift from what CI runs."""
    tutorials = {p.name: p.read_text() for p in (ROOT / "docs" / "tutorials").glob("*.md")}
    included = set()
    for text in tutorials.values():
        included |= set(re.findall(r'^--8<-- "([^"]+)"', text, flags=re.M))
    for dist, ep, kind, name, module in PACKAGES:
        for path in (f"docs/examples/{dist}/{module}.py", f"docs/examples/{dist}/pyproject.toml"):
            assert path in included, path
    assert "docs/examples/compose_engine.py" in included
    for path in included:
        assert (ROOT / path).is_file(), path
