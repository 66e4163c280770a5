"""The stopping policies fixed, oracle, adaptive and learned: decision rules on crafted inputs, the oracle on a
scripted drafter, the acceptance predictor (training end to end on a tiny model, file round trip, refusal of a file
made for another model), and greedy identity for every policy on tiny random models."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_apps.cli import main
from kangaroo_core.config import ConfigError, DecodeConfig, SamplingConfig
from kangaroo_core.engine import Engine
from kangaroo_core.errors import PredictorMismatchError
from kangaroo_core.results import DraftStep
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.adaptive import AdaptivePolicy
from kangaroo_policies.fixed import FixedPolicy
from kangaroo_policies.learned import LearnedPolicy
from kangaroo_policies.oracle import OraclePolicy
from kangaroo_policies.predictor import FEATURES, AcceptancePredictor, draft_features
from kangaroo_tools.policy_training import fit, round_samples
from kangaroo_policies.threshold import ThresholdPolicy

from kangaroo_apps.testing import ScriptedDrafter, error_positions, hf_greedy, tiny_backend, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def step(index: int, confidence: float, token: int = 0, vocab: int = 8) -> DraftStep:
    probs = torch.full((vocab,), (1 - confidence) / (vocab - 1), dtype=torch.float64)
    probs[token] = confidence
    return DraftStep(index=index, token=token, probs=probs, confidence=confidence)


# -- decision rules on crafted inputs ---------------------------------------------------------------------------------
def test_fixed_never_stops():
    policy = FixedPolicy()
    policy.start_round([1, 2, 3])
    assert all(policy.keep_drafting(step(i, c)) for i, c in enumerate([0.01, 0.2, 0.99, 0.13], start=1))


def test_adaptive_chooses_eta_from_the_first_draft():
    policy = AdaptivePolicy(pivot=0.8, eta_confident=0.4, eta_unsure=0.7)
    assert policy.choose_eta(0.9) == 0.4 and policy.choose_eta(0.8) == 0.4 and policy.choose_eta(0.79) == 0.7
    # a confident start: later drafts at 0.5 keep going (0.5 > 0.4), 0.3 stops
    policy.start_round([0])
    assert policy.keep_drafting(step(1, 0.95)) and policy.keep_drafting(step(2, 0.5))
    assert not policy.keep_drafting(step(3, 0.3))
    # a hesitant start: the first draft itself (0.75 > 0.7) continues, a 0.65 draft stops
    policy.start_round([0])
    assert policy.keep_drafting(step(1, 0.75)) and not policy.keep_drafting(step(2, 0.65))
    policy.start_round([0])
    assert not policy.keep_drafting(step(1, 0.5))  # 0.5 <= 0.7
    # equal etas: exactly the threshold policy
    same = AdaptivePolicy(eta_confident=0.6, eta_unsure=0.6)
    threshold = ThresholdPolicy(eta=0.6)
    for c in (0.1, 0.6, 0.61, 0.95):
        same.start_round([0])
        assert same.keep_drafting(step(1, c)) == threshold.keep_drafting(step(1, c))


def constant_predictor(p: float) -> AcceptancePredictor:
    """Predicts p for every draft (zero weights)."""
    logit = torch.tensor([float(torch.logit(torch.tensor(p, dtype=torch.float64)))])
    return AcceptancePredictor(torch.zeros(len(FEATURES)), logit)


def test_learned_expected_value_rule():
    # p = 0.9 everywhere, draft_cost 0.5: after draft i, alive = 0.9^i and the next gain is 0.9^(i+1)
    policy = LearnedPolicy(constant_predictor(0.9), value_of_token=1.0, draft_cost=0.5)
    policy.start_round([0])
    decisions = [policy.keep_drafting(step(i, 0.5)) for i in range(1, 7)]
    # 0.9^2=.81 .729 .656 .59 .531 .478 -> stop after draft 6
    assert decisions == [True, True, True, True, True, False]
    # a new round starts from alive = 1 again
    policy.start_round([0])
    assert policy.keep_drafting(step(1, 0.5))
    # a cheaper draft step drafts longer, a pricier one stops at once
    cheap = LearnedPolicy(constant_predictor(0.9), draft_cost=0.05)
    cheap.start_round([0])
    assert all(cheap.keep_drafting(step(i, 0.5)) for i in range(1, 7))
    dear = LearnedPolicy(constant_predictor(0.9), draft_cost=0.9)
    dear.start_round([0])
    assert not dear.keep_drafting(step(1, 0.5))
    # value_of_token scales the gain
    valued = LearnedPolicy(constant_predictor(0.9), value_of_token=2.0, draft_cost=0.9)
    valued.start_round([0])
    assert valued.keep_drafting(step(1, 0.5))


def test_learned_rule_follows_the_confidence_feature():
    # weight only on top-1 probability: confident drafts continue, doubtful ones stop
    predictor = AcceptancePredictor(torch.tensor([20.0, 0, 0, 0]), torch.tensor([-10.0]))
    policy = LearnedPolicy(predictor, draft_cost=0.3)
    policy.start_round([0])
    assert policy.keep_drafting(step(1, 0.95))
    policy.start_round([0])
    assert not policy.keep_drafting(step(1, 0.3))


def test_learned_without_options_uses_the_predictor_shipped_with_the_adapter(tmp_path):
    """No predictor option: the one in ``<adapter>/predictor/`` (the drafter's ``default_predictor``); an adapter
    without one is refused in one line at the first generation."""
    from kangaroo_core.engine import Engine
    from kangaroo_apps.testing import hf_greedy, tiny_backend, tiny_llama
    from kangaroo_plugins.greedy_verifier import GreedyVerifier
    from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter

    model = tiny_llama(3)
    backend = tiny_backend(model, exit_layer=1)
    KangarooAdapter.from_base_layer(model, 1).save(tmp_path / "a", base_fingerprint=backend.fingerprint, exit_layer=1)
    config = DecodeConfig(exit_layer=1, max_new_tokens=8)
    engine = Engine(backend, KangarooDrafter(str(tmp_path / "a")), LearnedPolicy.create(config), GreedyVerifier(), config)
    with pytest.raises(ConfigError, match="ships none") as info:
        engine.generate_ids([1, 2, 3])
    assert "\n" not in str(info.value)
    constant_predictor(0.99).save(tmp_path / "a" / "predictor", base_fingerprint=backend.fingerprint, exit_layer=1)
    engine = Engine(backend, KangarooDrafter(str(tmp_path / "a")), LearnedPolicy.create(config), GreedyVerifier(), config)
    result = engine.generate_ids([1, 2, 3])
    assert result.token_ids == hf_greedy(model, [1, 2, 3], 8)
    assert engine.policy.predictor.predict([0.5, 0.1, 1.0, 1.0]) == pytest.approx(0.99)
    assert result.rounds[0].drafted == 6  # p = 0.99 everywhere: it keeps drafting up to gamma


def test_features_and_conditional_samples():
    probs = torch.tensor([0.5, 0.3, 0.2])
    top1, margin, entropy, index = draft_features(probs, 3)
    assert (top1, index) == (0.5, 3.0) and abs(margin - 0.2) < 1e-6
    assert abs(entropy - float(-(probs * probs.log()).sum())) < 1e-6
    feats = [[float(i)] for i in range(5)]
    assert round_samples(feats, 5, 2) == [([0.0], 1), ([1.0], 1), ([2.0], 0)]
    assert round_samples(feats, 3, 3) == [([0.0], 1), ([1.0], 1), ([2.0], 1)]


# -- the oracle -------------------------------------------------------------------------------------------------------
def test_oracle_stops_exactly_at_the_first_mismatch():
    reference = [5, 6, 7, 8, 9, 10, 11, 12]
    policy = OraclePolicy(reference=reference)
    policy.start_round(reference[:3])  # the first draft goes to position 3 (token 8)
    assert policy.keep_drafting(step(1, 0.1, token=8, vocab=16))
    assert policy.keep_drafting(step(2, 0.1, token=9, vocab=16))
    assert not policy.keep_drafting(step(3, 0.99, token=4, vocab=16))  # mismatch: stop here
    policy.start_round(reference[:7])
    assert policy.keep_drafting(step(1, 0.5, token=12, vocab=16))
    assert not policy.keep_drafting(step(2, 0.5, token=12, vocab=16))  # past the reference: never accepted
    with pytest.raises(ConfigError, match="greedy"):
        OraclePolicy.create(DecodeConfig(sampling=SamplingConfig(temperature=0.7)))


def check_oracle_rounds(result, gamma: int, max_new_tokens: int) -> None:
    """Every round either ends with exactly one rejected draft or accepted all drafts because gamma/budget capped it."""
    produced = 1  # the prefill's token
    for r in result.rounds:
        cap = min(gamma, max_new_tokens - produced - 1)
        if r.drafted > r.accepted:
            assert r.drafted == r.accepted + 1, r
        else:
            assert r.drafted == cap, (r, cap)
        produced += r.emitted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_rounds_waste_no_draft_with_a_scripted_drafter(seed):
    rng = random.Random(seed)
    model = tiny_llama(seed)
    backend = tiny_backend(model, exit_layer=1)
    prompt = [rng.randrange(64) for _ in range(5)]
    n, gamma = 40, 4
    reference = prompt + hf_greedy(model, prompt, n)
    drafter = ScriptedDrafter(reference, 64, wrong_at=error_positions(rng, len(prompt) + 1, len(reference), 0.25),
                              confidence=lambda pos: 0.05 + 0.9 * ((pos * 37) % 10) / 10)
    config = DecodeConfig(gamma=gamma, exit_layer=1, max_new_tokens=n)
    for policy in (OraclePolicy(reference=reference), OraclePolicy()):  # given, and computed by prepare()
        result = Engine(backend, drafter, policy, GreedyVerifier(), config).generate_ids(prompt)
        assert result.token_ids == reference[len(prompt):]
        check_oracle_rounds(result, gamma, n)
        assert any(r.accepted == r.drafted for r in result.rounds)
        assert policy.reference == reference
    # the oracle's CR is at least fixed's and threshold's on the same drafter
    fixed = Engine(backend, drafter, FixedPolicy(), GreedyVerifier(), config).generate_ids(prompt)
    oracle = Engine(backend, drafter, OraclePolicy(reference=reference), GreedyVerifier(), config).generate_ids(prompt)
    assert sum(r.drafted for r in oracle.rounds) <= sum(r.drafted for r in fixed.rounds)
    assert oracle.mean_accepted_tokens >= fixed.mean_accepted_tokens - 1e-9


# -- greedy identity for every policy ---------------------------------------------------------------------------------
POLICIES = ["fixed", "adaptive", "learned", "oracle", "threshold"]


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 10_000), policy_name=st.sampled_from(POLICIES), scripted=st.booleans(),
       gamma=st.integers(1, 5), n=st.integers(2, 24), error_rate=st.sampled_from([0.0, 0.2, 0.6]),
       eos=st.booleans())
def test_every_policy_is_token_identical_to_greedy_generate(seed, policy_name, scripted, gamma, n, error_rate, eos):
    rng = random.Random(seed)
    model = tiny_llama(seed, vocab=48, hidden=16, layers=2, heads=2, kv_heads=1,
                       eos_token_id=rng.randrange(48) if eos else None)
    backend = tiny_backend(model, exit_layer=1)
    prompt = [rng.randrange(48) for _ in range(rng.randint(1, 6))]
    expected = hf_greedy(model, prompt, n)
    reference = prompt + expected
    policy = {
        "fixed": lambda: FixedPolicy(),
        "adaptive": lambda: AdaptivePolicy(pivot=rng.random(), eta_confident=rng.random(), eta_unsure=rng.random()),
        "learned": lambda: LearnedPolicy(AcceptancePredictor.random(seed), draft_cost=rng.random()),
        "oracle": lambda: OraclePolicy(reference=reference),
        "threshold": lambda: ThresholdPolicy(eta=rng.random()),
    }[policy_name]()
    if scripted:
        drafter = ScriptedDrafter(reference, 48, wrong_at=error_positions(rng, len(prompt), len(reference) + 1, error_rate),
                                  confidence=lambda pos: 0.03 + 0.95 * ((pos * 7919) % 97) / 97)
    else:
        drafter = KangarooDrafter()
    config = DecodeConfig(gamma=gamma, exit_layer=1, max_new_tokens=n)
    result = Engine(backend, drafter, policy, GreedyVerifier(), config).generate_ids(prompt)
    assert result.token_ids == expected
    if policy_name == "oracle":
        check_oracle_rounds(result, gamma, n)


# -- the predictor: training, files, refusal --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train_prompts.jsonl"
    words = "the sky is blue why tell me about the sea write a poem explain light one two three".split()
    rng = random.Random(0)
    lines = [json.dumps({"id": str(i), "prompt": " ".join(rng.choice(words) for _ in range(6)), "category": "x"})
             for i in range(6)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fit_recovers_a_separable_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(400, len(FEATURES), generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0.5).double()
    predictor, report = fit(x, y, steps=300)
    assert report["train_accuracy"] > 0.95 and report["train_log_loss"] < report["constant_log_loss"]
    assert predictor.predict([0.9, 0.5, 0.5, 1.0]) > 0.8 > 0.2 > predictor.predict([0.1, 0.5, 0.5, 1.0])


def test_train_policy_end_to_end_round_trip_and_refusal(tiny_model_dir, other_tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "predictor"
    assert main(["train-policy", "--out", str(out), "--model", str(tiny_model_dir), "--adapter", "untrained",
                 "--prompts", str(prompts_file), "--num-prompts", "4", "--gamma", "3", "--max-new-tokens", "12",
                 "--steps", "50"]) == 0
    meta = json.loads((out / "predictor.json").read_text())
    assert meta["features"] == list(FEATURES) and meta["exit_layer"] == 2
    assert meta["training"]["samples"] > 0 and meta["training"]["num_prompts"] == 4
    assert not any(p.suffix in (".pkl", ".pt", ".bin") for p in out.iterdir())
    loaded = AcceptancePredictor.load(out, base_fingerprint=meta["base_model_fingerprint"], exit_layer=2)
    again_dir = tmp_path / "again"
    loaded.save(again_dir, base_fingerprint=meta["base_model_fingerprint"], exit_layer=2)
    again = AcceptancePredictor.load(again_dir)
    features = [0.7, 0.3, 1.2, 2.0]
    assert again.predict(features) == pytest.approx(loaded.predict(features), abs=1e-12)
    assert torch.equal(again.weight, loaded.weight) and torch.equal(again.std, loaded.std)
    # used from the CLI on the same model
    capsys.readouterr()
    assert main(["generate", "t", "--model", str(tiny_model_dir), "--max-new-tokens", "6", "--vanilla", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["generate", "t", "--model", str(tiny_model_dir), "--adapter", "untrained", "--max-new-tokens", "6",
                 "--policy", "learned", "--policy-option", f"predictor={out}", "--policy-option", "draft_cost=0.2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == alone  # lossless with the learned policy
    # refused: another base model, another exit layer, a file given by path to the loader
    assert main(["generate", "t", "--model", str(other_tiny_model_dir), "--adapter", "untrained", "--max-new-tokens", "6",
                 "--policy", "learned", "--policy-option", f"predictor={out}"]) == 1
    assert "was made for base model" in capsys.readouterr().err
    with pytest.raises(PredictorMismatchError, match="exit layer"):
        AcceptancePredictor.load(out, exit_layer=1)
    with pytest.raises(PredictorMismatchError, match="cannot read"):
        AcceptancePredictor.load(tmp_path / "missing")


def test_train_policy_refuses_spec_bench(tiny_model_dir, prompts_file, tmp_path, capsys):
    bench = tmp_path / "specbench_dev.jsonl"
    bench.write_text(prompts_file.read_text())
    assert main(["train-policy", "--out", str(tmp_path / "p"), "--model", str(tiny_model_dir), "--adapter", "untrained",
                 "--prompts", str(bench), "--num-prompts", "1"]) == 1
    assert "Spec-Bench" in capsys.readouterr().err


def test_generate_with_every_policy_from_the_cli(tiny_model_dir, capsys):
    assert main(["generate", "t", "--model", str(tiny_model_dir), "--max-new-tokens", "6", "--vanilla", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["token_ids"]
    for policy in ("fixed", "adaptive", "oracle"):
        assert main(["generate", "t", "--model", str(tiny_model_dir), "--adapter", "untrained", "--max-new-tokens", "6",
                     "--policy", policy, "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["token_ids"] == alone, policy


def test_learned_draft_cost_can_be_measured_on_the_backend():
    model = tiny_llama(3, vocab=48, hidden=16, layers=2, heads=2, kv_heads=1)
    backend = tiny_backend(model, exit_layer=1)
    policy = LearnedPolicy.create(DecodeConfig(exit_layer=1), predictor=constant_predictor(0.9), draft_cost="measured")
    assert policy.measure_draft_cost
    prompt = [1, 2, 3]
    result = Engine(backend, KangarooDrafter(), policy, GreedyVerifier(), DecodeConfig(exit_layer=1, max_new_tokens=8)).generate_ids(prompt)
    assert result.token_ids == hf_greedy(model, prompt, 8)  # measuring first leaves nothing behind in the caches
    assert not policy.measure_draft_cost and 0.0 < policy.draft_cost != 0.3
    with pytest.raises(ConfigError, match="draft_cost must be a number or measured"):
        LearnedPolicy.create(DecodeConfig(), predictor=constant_predictor(0.9), draft_cost="cheap")
