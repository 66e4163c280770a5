"""`kangaroo analyze-policies`: the greedy replay equals the real engine round by round for every policy, the
calibration bins and ECE on a hand-made example, the cost model, and the command's outputs on a tiny model."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_apps.cli import main
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.adaptive import AdaptivePolicy
from kangaroo_tools.policy_analysis import AnswerRecord, Costs, calibration, round_summary
from kangaroo_core.results import RoundResult
from kangaroo_tools.replay import replay_answer, simulate_policy
from kangaroo_policies.fixed import FixedPolicy
from kangaroo_policies.learned import LearnedPolicy
from kangaroo_policies.oracle import OraclePolicy
from kangaroo_policies.predictor import AcceptancePredictor
from kangaroo_policies.threshold import ThresholdPolicy

from kangaroo_apps.testing import ScriptedDrafter, error_positions, tiny_backend, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")
POLICIES = ["fixed", "adaptive", "learned", "oracle", "threshold"]


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 10_000), policy_name=st.sampled_from(POLICIES), scripted=st.booleans(),
       gamma=st.integers(1, 5), n=st.integers(1, 24), error_rate=st.sampled_from([0.0, 0.2, 0.6]), eos=st.booleans())
def test_replay_equals_the_engine_round_by_round(seed, policy_name, scripted, gamma, n, error_rate, eos):
    rng = random.Random(seed)
    model = tiny_llama(seed, vocab=48, hidden=16, layers=2, heads=2, kv_heads=1,
                       eos_token_id=rng.randrange(48) if eos else None)
    backend = tiny_backend(model, exit_layer=1)
    prompt = [rng.randrange(48) for _ in range(rng.randint(1, 6))]
    config = DecodeConfig(gamma=gamma, exit_layer=1, max_new_tokens=n)
    alone = Engine(backend, None, FixedPolicy(), GreedyVerifier(), config).generate_ids(prompt)
    reference = prompt + alone.token_ids
    options = dict(pivot=rng.random(), eta_confident=rng.random(), eta_unsure=rng.random(), eta=rng.random(),
                   draft_cost=rng.random())

    def make_policy():
        return {
            "fixed": lambda: FixedPolicy(),
            "adaptive": lambda: AdaptivePolicy(pivot=options["pivot"], eta_confident=options["eta_confident"],
                                               eta_unsure=options["eta_unsure"]),
            "learned": lambda: LearnedPolicy(AcceptancePredictor.random(seed), draft_cost=options["draft_cost"]),
            "oracle": lambda: OraclePolicy(reference=reference),
            "threshold": lambda: ThresholdPolicy(eta=options["eta"]),
        }[policy_name]()

    if scripted:
        wrong = error_positions(rng, len(prompt), len(reference) + 1, error_rate)
        drafter = ScriptedDrafter(reference, 48, wrong_at=wrong,
                                  confidence=lambda pos: 0.03 + 0.95 * ((pos * 7919) % 97) / 97)
    else:
        drafter = KangarooDrafter()
    engine = Engine(backend, drafter, make_policy(), GreedyVerifier(), config)
    result = engine.generate_ids(prompt)
    assert result.token_ids == alone.token_ids
    real = [(r.drafted, r.accepted, r.emitted) for r in result.rounds]

    answer = replay_answer(backend, drafter, "qa", prompt, alone.token_ids, gamma=gamma, max_new_tokens=n)
    replay = simulate_policy(answer, make_policy(), gamma)
    assert [(r.drafted, r.accepted, r.emitted) for r in replay] == real
    summary = round_summary(replay, None, gamma)
    if real:
        assert summary["cr"] == pytest.approx(result.mean_accepted_tokens)


def record(subtask, pairs, rounds=None):
    return AnswerRecord(subtask, [c for c, _ in pairs], [ok for _, ok in pairs], rounds or {})


def test_calibration_bins_and_ece_by_hand():
    records = [record("qa", [(0.05, False), (0.15, True), (0.95, True), (1.0, True)]),
               record("rag", [(0.12, False), (0.91, False)])]
    data = calibration(records, bins=10)
    assert list(data) == ["qa", "rag", "overall"]
    overall = data["overall"]
    assert overall["drafts"] == 6 and overall["acceptance_rate"] == pytest.approx(3 / 6)
    bins = overall["bins"]
    assert [b["count"] for b in bins] == [1, 2, 0, 0, 0, 0, 0, 0, 0, 3]  # 1.0 falls into the last bin
    assert bins[1]["mean_confidence"] == pytest.approx(0.135) and bins[1]["acceptance_rate"] == pytest.approx(0.5)
    assert bins[9]["acceptance_rate"] == pytest.approx(2 / 3)
    expected = (1 * abs(0.05 - 0) + 2 * abs(0.135 - 0.5) + 3 * abs((0.95 + 1.0 + 0.91) / 3 - 2 / 3)) / 6
    assert overall["expected_calibration_error"] == pytest.approx(expected)
    assert data["qa"]["drafts"] == 4 and data["rag"]["acceptance_rate"] == 0.0


def test_round_summary_and_cost_model():
    costs = Costs(t_exit=1.0, t_draft=2.0, t_verify=(10.0, 11.0, 12.0, 13.0))
    assert costs.verify_line == pytest.approx((10.0, 1.0))
    assert costs.as_dict()["marginal_draft_cost"] == pytest.approx((2.0 + 1.0) / 10.0)
    noisy = Costs(t_exit=1.0, t_draft=2.0, t_verify=(10.0, 12.0, 11.0, 13.0))
    assert noisy.verify_line == pytest.approx((10.3, 0.8))  # least squares, not the single medians
    rounds = [RoundResult(d, a, a + 1, 0.0, 0.0) for a, d in [(3, 3), (0, 1), (1, 2)]]  # (accepted, drafted)
    summary = round_summary(rounds, costs, gamma=3)
    assert summary["cr"] == pytest.approx((4 + 1 + 2) / 3)
    assert summary["ctar"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert summary["drafts_per_round"] == pytest.approx(2.0)
    assert summary["wasted_drafts_per_round"] == pytest.approx((0 + 1 + 1) / 3)
    seconds = (1 + 6 + 13) + (1 + 2 + 11) + (1 + 4 + 12)
    assert summary["predicted_speedup"] == pytest.approx(7 * 11.0 / seconds)
    assert round_summary([], costs, 3)["cr"] is None


def test_analyze_policies_command_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    items = [{"question_id": 1, "turns": ["tell me a story", "and another"], "subtask": "mt_bench"},
             {"question_id": 2, "turns": ["what is the sea"], "subtask": "qa"}]
    questions.write_text("".join(json.dumps(q) + "\n" for q in items))
    out = tmp_path / "out"
    code = main(["analyze-policies", "--questions", str(questions), "--out", str(out), "--model", str(tiny_model_dir),
                 "--max-new-tokens", "12", "--gamma", "3", "--no-progress",
                 "--policies", "fixed,threshold,adaptive:pivot=0.5,oracle"])
    assert code == 0, capsys.readouterr().err
    for name in ("calibration.json", "optimal_eta.json", "policies.json", "calibration.png", "eta_curves.png",
                 "analysis.md"):
        assert (out / name).stat().st_size > 0, name
    policies = json.loads((out / "policies.json").read_text())["policies"]
    assert list(policies) == ["fixed", "threshold", "adaptive:pivot=0.5", "oracle"]
    eta = json.loads((out / "optimal_eta.json").read_text())["eta"]
    assert set(eta) == {"mt_bench", "qa", "overall"}
    at06 = next(p for p in eta["overall"]["points"] if p["eta"] == 0.6)
    assert policies["threshold"]["overall"]["cr"] == pytest.approx(at06["cr"])  # same rule, same rounds
    assert policies["oracle"]["overall"]["cr"] >= policies["fixed"]["overall"]["cr"] - 1e-12
    assert policies["oracle"]["overall"]["wasted_drafts_per_round"] <= 1.0
    calibration_data = json.loads((out / "calibration.json").read_text())["calibration"]
    assert calibration_data["overall"]["drafts"] == sum(calibration_data[s]["drafts"] for s in ("mt_bench", "qa"))
    assert "optimal eta" in capsys.readouterr().err


def test_analyze_policies_rejects_an_unknown_policy(tiny_model_dir, tmp_path, capsys):
    code = main(["analyze-policies", "--model", str(tiny_model_dir), "--policies", "fixed,psychic"])
    assert code == 2  # bad usage
    err = capsys.readouterr().err
    assert "unknown policy 'psychic'" in err and "Traceback" not in err


def test_analyze_policies_replays_several_adapters_on_the_same_answers(tiny_model_dir, tmp_path, capsys):
    import torch

    from kangaroo_backends.loading import load_model
    from kangaroo_backends.torch_backend import model_fingerprint
    from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
    from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
    from kangaroo_tools.policy_analysis import PAST_A_REJECTION

    model, _, _ = load_model(str(tiny_model_dir))
    dirs = []
    for name, seed, kind in (("plain", None, KangarooAdapter), ("shaken", 0, DeepContextAdapter)):
        adapter = kind.from_base_layer(model, 1)
        if seed is not None:  # another drafter: other drafts, other acceptance
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in adapter.parameters():
                    p.add_(0.5 * torch.randn_like(p))
        dirs.append(adapter.save(tmp_path / name, base_fingerprint=model_fingerprint(model), exit_layer=1))
    questions = tmp_path / "q.jsonl"
    items = [{"question_id": 1, "turns": ["tell me a story", "and another"], "subtask": "mt_bench"}]
    questions.write_text("".join(json.dumps(q) + "\n" for q in items))
    out = tmp_path / "out"
    code = main(["analyze-policies", "--questions", str(questions), "--out", str(out), "--model", str(tiny_model_dir),
                 "--max-new-tokens", "12", "--gamma", "3", "--no-progress", "--policies", "fixed,threshold",
                 "--adapters", ",".join(str(d) for d in dirs)])
    assert code == 0, capsys.readouterr().err
    drafters = json.loads((out / "drafters.json").read_text())["drafters"]
    assert list(drafters) == ["plain", "shaken"]
    for name, entry in drafters.items():  # each drafter's own analysis, and the same numbers side by side
        own = json.loads((out / name / "policies.json").read_text())
        assert own["policies"] == entry["policies"] and own["run"]["adapter"] == str(tmp_path / name)
        assert entry["costs"]["t_draft"] > 0
    fixed = [drafters[n]["policies"]["fixed"]["overall"] for n in drafters]
    assert all(len(f["ctar"]) == 3 for f in fixed)
    assert fixed[0]["ctar"] != fixed[1]["ctar"]  # two drafters, really replayed one each
    # the same target answers: as many rounds' tokens for each
    assert len({f["rounds"] * f["cr"] for f in fixed}) == 1
    text = (out / "drafters.md").read_text()
    assert "CTAR(3)" in text and "| plain |" in text
    # the deep-context drafter's drafts past a rejection are not replayed: its drafts/round is marked a lower bound
    assert [drafters[n]["drafted_exact"] for n in drafters] == [True, False]
    assert "| shaken * |" in text and PAST_A_REJECTION in text
    code = main(["analyze-policies", "--model", str(tiny_model_dir), "--out", str(tmp_path / "bad"),
                 "--adapters", str(tmp_path)])
    assert code == 2 and "not an adapter directory" in capsys.readouterr().err
