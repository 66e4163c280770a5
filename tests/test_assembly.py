"""The one composition root: an EngineSpec assembled once, the exit layer settled from the adapter before the other
pieces are made, backend options checked against the backend's create signature, from Python and the command line."""

from __future__ import annotations

import json

import pytest

from kangaroo_apps.cli import main
from kangaroo_apps.cli_options import EngineOptions
from kangaroo_core.assembly import EngineSpec, build_pieces
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.engine import Engine, assemble
from kangaroo_core.errors import UsageError
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.plugins import register_plugin, unregister_plugin
from kangaroo_plugins.kangaroo import drafter as kangaroo_drafter
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_policies.threshold import ThresholdPolicy


@pytest.fixture
def shipped_at_layer_1(tmp_path, tiny_model_dir, monkeypatch):
    """A shipped adapter for the tiny model trained at exit layer 1 (not the default 2)."""
    backend = Engine.build(str(tiny_model_dir), drafter=None).backend
    shipped = tmp_path / "shipped"
    KangarooAdapter.from_base_layer(backend.model, 1).save(shipped / "tiny-l1", base_fingerprint=backend.fingerprint,
                                                           exit_layer=1)
    monkeypatch.setattr(kangaroo_drafter, "SHIPPED_ADAPTERS", shipped)
    return str(shipped / "tiny-l1")


def test_engine_build_splits_at_the_shipped_adapter_s_layer(tiny_model_dir, shipped_at_layer_1, one_torch_thread):
    engine = Engine.build(str(tiny_model_dir), drafter="kangaroo")
    assert engine.backend.exit_layer == engine.config.exit_layer == 1
    assert engine.drafter.resolved_adapter == shipped_at_layer_1
    forced = assemble(EngineSpec(model=str(tiny_model_dir), drafter="kangaroo", exit_layer=2))
    assert forced.backend.exit_layer == forced.config.exit_layer == 2 and forced.drafter.resolved_adapter is None
    # the same through the command line's description
    cli = EngineOptions(model=str(tiny_model_dir), drafter="kangaroo").engine()
    assert cli.backend.exit_layer == 1 and cli.drafter.resolved_adapter == shipped_at_layer_1
    alone = EngineOptions(model=str(tiny_model_dir)).engine(vanilla=True)
    assert alone.drafter is None and alone.backend.exit_layer == 2
    prompt = [5, 6, 7, 8, 9]
    assert engine.generate_ids(prompt, 12).token_ids == alone.generate_ids(prompt, 12).token_ids


class CountingPolicy(ThresholdPolicy):
    made: list = []

    @classmethod
    def create(cls, config: DecodeConfig, eta: float | None = None) -> "CountingPolicy":
        cls.made.append(config.exit_layer)
        return cls(eta=config.eta if eta is None else eta)


class CountingPlugin:
    @hookimpl
    def register_policies(self, register):
        register("counting", CountingPolicy)


def test_each_piece_is_built_once_for_the_settled_layer(tiny_model_dir, shipped_at_layer_1, one_torch_thread):
    register_plugin(CountingPlugin(), "counting-plugin")
    try:
        CountingPolicy.made.clear()
        spec = EngineSpec(model=str(tiny_model_dir), drafter="kangaroo", policy="counting")
        engine = assemble(spec)
        assert CountingPolicy.made == [1] and engine.spec is spec
        sampled = engine.with_sampling(engine.config.sampling.replace(temperature=0.7, seed=3))
        # the policy is copied (its own per-generation state), never built again
        assert sampled.verifier.name == "speculative" and CountingPolicy.made == [1]
        assert type(sampled.policy) is CountingPolicy and sampled.policy is not engine.policy
    finally:
        unregister_plugin("counting-plugin")


def test_a_loaded_backend_is_reused_and_resplit_for_the_spec(tiny_model_dir, one_torch_thread):
    backend = EngineOptions(model=str(tiny_model_dir)).backend(vanilla=True)
    pieces = build_pieces(EngineSpec(adapter="untrained", exit_layer=3), backend)
    assert pieces.backend.exit_layer == 3 and pieces.backend.model is backend.model


def test_backend_options_are_checked_before_the_model_loads(capsys):
    assert main(["generate", "hi", "--backend-option", "kernel=plain", "--model", "/does/not/exist"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("kangaroo: error: backend 'torch': unknown option(s) kernel; valid options: model, device, dtype, kernels, graphs, cache_size, graph_rows")
    with pytest.raises(ConfigError, match=r"^drafter 'kangaroo': unknown option\(s\) nope; valid options: adapter"):
        assemble(EngineSpec(model="/does/not/exist", drafter="kangaroo", drafter_options={"nope": 1}))


def test_backend_flags_and_backend_options_reach_the_backend(tiny_model_dir, capsys, one_torch_thread):
    outs = []
    for flags in (["--kernels", "plain"], ["--backend-option", "kernels=plain"], []):
        assert main(["generate", "Hello", "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--json",
                     *flags]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"]
    opts = EngineOptions.from_args(["--kernels", "plain", "--backend-option", "dtype=float32"])
    assert opts.spec().backend_options == {"kernels": "plain", "dtype": "float32"}
    assert EngineOptions.from_args(["--backend-option", "kernels=plain"]).engine(vanilla=True).backend.kernels == "plain"


def test_a_flag_of_another_backend_is_refused(capsys, tmp_path):
    assert main(["generate", "hi", "--onnx-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("kangaroo: error: --onnx-dir is an option of the onnx backend; this "
                                               "command uses --backend torch")
    with pytest.raises(UsageError, match=r"--kernels is an option of the (.+ and )?torch backends?; this command uses "
                                         r"--backend onnx"):
        EngineOptions.from_args(["--backend", "onnx", "--kernels", "plain"]).spec()


def test_the_spec_describes_itself_as_plain_data(tiny_model_dir):
    described = EngineSpec(model="m", drafter=None, policy=ThresholdPolicy(0.5), backend_options={"kernels": "plain"},
                           config=DecodeConfig(eta=0.5)).describe()
    assert described["policy"] == "threshold" and described["drafter"] is None
    assert described["backend_options"] == {"kernels": "plain"} and described["config"]["eta"] == 0.5
    json.dumps(described)


def test_demo_shows_kangaroo_next_to_generate_and_the_target_alone(tiny_model_dir, tmp_path, capsys, one_torch_thread):
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [t, "and then?"]}
            for i, (c, t) in enumerate([("qa", "Why is the sky blue?"), ("qa", "skipped: one per kind"),
                                        ("math_reasoning", "What is 2 + 2?")])]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["demo", "--model", str(tiny_model_dir), "--questions", str(questions), "--max-new-tokens", "6",
                 "--no-progress"]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| kind | target alone tok/s | kangaroo tok/s | × target alone | CR |")
    assert [line.split("|")[1].strip() for line in table[2:]] == ["qa", "math_reasoning", "**overall**"]
    assert all(line.rstrip("| ").endswith("yes") for line in table[2:])
    assert main(["demo", "--model", str(tiny_model_dir), "--prompt", "Hello", "--max-new-tokens", "4",
                 "--no-progress"]) == 0
    assert "| your prompt |" in capsys.readouterr().out


def test_the_demo_fails_when_an_answer_differs_or_a_method_fails():
    from kangaroo_apps.demo import demo_failure

    def summary(kangaroo_same: bool, error: str | None = None) -> dict:
        same = {"identical_to_vanilla": True, "identical_to_target_alone": True}
        mine = {"identical_to_vanilla": kangaroo_same, "identical_to_target_alone": kangaroo_same}
        return {"methods": {"hf_vanilla": {"error": None, "overall": same}, "vanilla": {"error": None, "overall": same},
                            "kangaroo": {"error": error, "overall": mine}}}

    assert demo_failure(summary(True)) is None
    assert "differs from the target alone" in demo_failure(summary(False))
    assert demo_failure(summary(True, "boom")) == "a method failed: kangaroo: boom"
