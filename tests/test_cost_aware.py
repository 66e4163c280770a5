"""The cost-aware stopping policy: rounds with no drafts run no drafter work and the drafter catches up in one pass;
the rule drafts nothing where a verify row cannot pay and deep where rows are free; the measured curve is cached per
machine; greedy output is identical to the target alone, decoding alone and in a batch."""

from __future__ import annotations

import json
import random

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.results import DraftStep
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies import cost_model
from kangaroo_policies.cost_aware import CostAwarePolicy
from kangaroo_policies.threshold import ThresholdPolicy

from kangaroo_apps.testing import ScriptedDrafter, error_positions, hf_greedy, tiny_backend, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def step(index: int, confidence: float) -> DraftStep:
    import torch

    probs = torch.full((8,), (1 - confidence) / 7, dtype=torch.float64)
    probs[0] = confidence
    return DraftStep(index=index, token=0, probs=probs, confidence=confidence)


class EveryThirdRound(ThresholdPolicy):
    """Drafts only in every third round (0 drafts otherwise)."""

    rounds = 0

    def round_budget(self, most: int) -> int:
        self.rounds += 1
        return most if self.rounds % 3 == 0 else 0


def scripted_setup(seed: int = 5, n: int = 40, confidence=0.9, error_rate: float = 0.2):
    rng = random.Random(seed)
    model = tiny_llama(seed, vocab=48, hidden=16, layers=2, heads=2, kv_heads=1)
    backend = tiny_backend(model, exit_layer=1)
    prompt = [rng.randrange(48) for _ in range(5)]
    expected = hf_greedy(model, prompt, n)
    reference = prompt + expected
    drafter = ScriptedDrafter(reference, 48, wrong_at=error_positions(rng, len(prompt), len(reference) + 1, error_rate),
                              confidence=confidence)
    return backend, drafter, prompt, expected


def test_rounds_without_drafts_run_no_drafter_work_and_the_drafter_catches_up_in_one_pass():
    backend, drafter, prompt, expected = scripted_setup()
    config = DecodeConfig(gamma=4, exit_layer=1, max_new_tokens=len(expected))
    result = Engine(backend, drafter, EveryThirdRound(eta=0.5), GreedyVerifier(), config).generate_ids(prompt)
    assert result.token_ids == expected
    drafted = [r.drafted for r in result.rounds]
    assert drafted.count(0) >= 2 * len(drafted) // 3 - 1 and sum(drafted) > 0
    # one advance per draft: nothing runs in a round without drafts
    assert len(drafter.calls) == sum(drafted)
    # after skipped rounds the drafter reads every position it missed in one pass (ScriptedDrafter(strict) checks
    # that it saw each position exactly once): 3 rounds' tokens and more at once
    resumed = [states for _, states in drafter.calls[1:]]
    assert max(resumed) >= 3


@pytest.mark.parametrize("gate", [True, False])
def test_the_cost_policy_stops_drafting_where_a_verify_row_cannot_pay(gate):
    backend, drafter, prompt, expected = scripted_setup(confidence=0.9, error_rate=0.0)
    policy = CostAwarePolicy(costs="1,1,10,20,30,40,50", gate=gate)  # a second row costs 9 one-row passes
    config = DecodeConfig(gamma=4, exit_layer=1, max_new_tokens=len(expected))
    result = Engine(backend, drafter, policy, GreedyVerifier(), config).generate_ids(prompt)
    assert result.token_ids == expected
    drafted, dropped = [r.drafted for r in result.rounds], [r.dropped for r in result.rounds]
    assert len(drafter.calls) == sum(drafted) + sum(dropped)  # one drafter step per draft, verified or dropped
    if not gate:
        # even the prior's 0.6 acceptance cannot pay for a second row: only every probe-th (4th) round drafts, one
        # token
        assert all(d == 0 for i, d in enumerate(drafted, start=1) if i % 4) and set(drafted) == {0, 1}
        assert drafted.count(1) >= len(drafted) // 4 - 1 and sum(dropped) == 0
        return
    # gated: no draft is worth its row, so each probe's draft is dropped unverified: one drafter step, no row; each
    # dropped probe doubles the wait before the next (4, then 8 rounds)
    assert set(drafted) == {0} and set(dropped) == {0, 1}
    probes = [i for i, d in enumerate(dropped, start=1) if d]
    assert probes[:2] == [4, 12] and all(b - a == 8 for a, b in zip(probes[1:], probes[2:]))


def test_the_cost_policy_drafts_deep_where_rows_are_free():
    backend, drafter, prompt, expected = scripted_setup(confidence=0.95, error_rate=0.0)
    config = DecodeConfig(gamma=4, exit_layer=1, max_new_tokens=len(expected))
    cheap = CostAwarePolicy(costs="0.01,1,1,1,1,1,1")
    result = Engine(backend, drafter, cheap, GreedyVerifier(), config).generate_ids(prompt)
    assert result.token_ids == expected
    budget = len(expected) - 1  # after the prefill's token
    for r in result.rounds:
        assert r.drafted == min(4, budget - 1)
        budget -= r.emitted


def test_the_rule_on_crafted_numbers():
    # t(n) = 1 + 0.2 (n - 1), a draft step 0.1: after a draft of p = 0.9, going on gains more than stopping; rounds
    # decided from the first drafts' acceptance (the earlier model: gate=False)
    policy = CostAwarePolicy(costs="0.1,1,1.2,1.4,1.6,1.8,2.0,2.2", prior=1e6, gate=False)  # p = confidence
    policy.round_budget(6)
    policy.begin_round()
    assert policy.keep_drafting(step(1, 0.9))
    # E_1 = 0.9: rate(1) = 1.9 / 1.3; one more at 0.05 adds 0.045 for 0.3 more time: stop
    policy.begin_round()
    assert not policy.keep_drafting(step(1, 0.05))
    # before a round: recent rounds accepted nothing, so k = 0 until a probe round drafts one token
    policy.first, policy.later = 0.0, 0.0
    assert [policy.round_budget(6) for _ in range(4)] == [0, 0, 0, 1]
    policy.end_round([step(1, 0.5)], 0)  # the probe failed: twice as long to the next one
    assert [policy.round_budget(6) for _ in range(8)] == [0] * 7 + [1]
    policy.end_round([step(1, 0.5)], 0)  # at most twice
    assert [policy.round_budget(6) for _ in range(8)] == [0] * 7 + [1]
    policy.end_round([step(1, 0.5)], 1)  # a hit: the text turned predictable, drafting resumes
    assert policy.first >= 0.6 and policy.round_budget(6) == 6
    for _ in range(12):  # until misses bring the estimate down again; then probes every probe-th round again
        policy.end_round([step(1, 0.5)], 0)
    assert [policy.round_budget(6) for _ in range(4)] == [0, 0, 0, 1]
    policy.first, policy.later = 0.8, 0.8
    assert policy.round_budget(6) == 6


def test_the_gate_drops_drafts_not_worth_their_row_and_drafts_only_while_drafting_has_paid():
    # a round of k drafts costs 0.1 k + t(k + 1), t(n) = 1 + 0.2 (n - 1): a plain step 1, a first draft's step and
    # row 1.3, a dropped draft 1.1 (its step spent)
    policy = CostAwarePolicy(costs="0.1,1,1.2,1.4,1.6,1.8,2.0,2.2", prior=1e6)  # a strong prior: p = confidence
    policy.prepare(None, [], 64)
    assert policy.gate and policy.drop_ms == 0.1
    assert policy.round_budget(6) == 6  # the prior's yield pays
    prior = policy.prior_round(6)
    policy.begin_round()
    # kept while (1 + p) / 1.3 >= 1 / 1.1: p >= 0.18
    assert policy.worth_verifying(step(1, 0.2)) and not policy.worth_verifying(step(1, 0.15))
    assert policy.yielded == pytest.approx((0.9 * prior[0] + 0.1 * 1, 0.9 * prior[1] + 0.1 * 1.1))
    policy.begin_round()
    assert policy.worth_verifying(step(1, 0.9)) and policy.keep_drafting(step(1, 0.9))
    # a later draft at 0.1: 1.99 tokens for 1.6 is worse than 1.9 for 1.3 + 0.1 (its step spent): dropped
    assert not policy.worth_verifying(step(2, 0.1)) and policy.dropped_later
    before = policy.yielded
    policy.end_round([step(1, 0.9)], 1)  # the verified round is priced with its dropped draft's step
    assert policy.yielded == pytest.approx((0.9 * before[0] + 0.1 * 2, 0.9 * before[1] + 0.1 * (1.3 + 0.1)))
    # rounds yielding one token at a dropped draft's cost bring the yield under plain steps'
    for _ in range(40):
        policy.begin_round()
        assert not policy.worth_verifying(step(1, 0.05))
    assert policy.yielded[0] / policy.yielded[1] < 1
    assert [policy.round_budget(6) for _ in range(4)] == [0, 0, 0, 6]  # a gated probe may draft on
    policy.begin_round()
    assert policy.worth_verifying(step(1, 0.95))
    policy.end_round([step(1, 0.95)], 1)  # the probe hit: the prior's yield again, drafting resumes
    assert policy.yielded == prior and policy.round_budget(6) == 6
    # the margin: a yield 3 % over plain steps' is not enough to draft (5 %), 8 % is
    policy.yielded = (1.03, 1.0)
    assert policy.round_budget(6) == 0
    policy.yielded = (1.08, 1.0)
    assert policy.round_budget(6) == 6
    # ungated, every draft is verified
    assert CostAwarePolicy(costs="0.2,1,1.4", gate=False).worth_verifying(step(1, 0.01))


def test_calibration_learns_from_verdicts():
    policy = CostAwarePolicy(costs="0.1,1,1.2", prior=4)
    policy.prepare(None, [], 8)
    assert policy.probability(0.9) == pytest.approx(0.9)
    for _ in range(20):  # drafts at 0.9 that the target always rejects
        policy.end_round([step(1, 0.9), step(2, 0.9)], 0)
    assert policy.probability(0.9) < 0.2 and policy.first < 0.1 and policy.later is None
    policy.end_round([step(1, 0.9), step(2, 0.9), step(3, 0.9)], 2)
    assert policy.later == 0.5  # of drafts 2 and 3, verified, the target took draft 2
    policy.prepare(None, [], 8)  # every generation starts from the prior again
    assert policy.probability(0.9) == pytest.approx(0.9) and policy.first is None


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="costs must be"):
        CostAwarePolicy(costs="fast")
    with pytest.raises(ConfigError, match="costs must be"):
        CostAwarePolicy(costs="0.1,0")
    with pytest.raises(ConfigError, match="probe"):
        CostAwarePolicy(probe=0)
    with pytest.raises(ConfigError, match="batch must be 'together' or 'wait'"):
        CostAwarePolicy(batch="alone")


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 10_000), gamma=st.integers(1, 5), n=st.integers(2, 24),
       error_rate=st.sampled_from([0.0, 0.3, 0.7]), slope=st.sampled_from([0.0, 0.3, 3.0]),
       confidence=st.sampled_from([0.2, 0.6, 0.97, "varied"]), gate=st.booleans())
def test_greedy_identity_under_any_costs(seed, gamma, n, error_rate, slope, confidence, gate):
    rng = random.Random(seed)
    if confidence == "varied":  # drafts the gate keeps and drafts it drops, in one generation
        confidence = lambda position: (0.05, 0.3, 0.95)[position % 3]  # noqa: E731
    backend, drafter, prompt, expected = scripted_setup(seed, n, confidence, error_rate)
    costs = ",".join(str(x) for x in [rng.random()] + [1 + slope * i for i in range(8)])
    config = DecodeConfig(gamma=gamma, exit_layer=1, max_new_tokens=n)
    policy = CostAwarePolicy(costs=costs, gate=gate)
    result = Engine(backend, drafter, policy, GreedyVerifier(), config).generate_ids(prompt)
    assert result.token_ids == expected
    assert len(drafter.calls) == sum(r.drafted + r.dropped for r in result.rounds)
    assert gate or not any(r.dropped for r in result.rounds)


def test_the_measured_curve_is_cached_per_machine_and_identity_holds_in_a_batch(monkeypatch):
    model = tiny_llama(11, vocab=64, hidden=32, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    config = DecodeConfig(gamma=3, exit_layer=1, max_new_tokens=12)
    engine = Engine(backend, KangarooDrafter(), CostAwarePolicy.create(config), GreedyVerifier(), config)
    key = cost_model.cost_key(backend, engine.drafter)
    path = cost_model.cost_file(key)
    assert path.exists() and key["machine"] and key["threads"] >= 1
    measured = engine.policy.pass_ms
    sizes = tuple(cost_model.wanted_positions(3, backend.max_context))
    assert engine.policy.pass_sizes == sizes and sizes[:4] == (1, 2, 4, 8)
    assert len(measured) == len(sizes) and all(t > 0 for t in measured) and engine.policy.draft_ms > 0
    assert len(engine.policy.round_ms) == 4 and all(t > 0 for t in engine.policy.round_ms)  # rounds of 0..3 drafts
    curve = cost_model.curve_from_dict(json.loads(path.read_text())["curve"])
    assert curve.dropped_round_ms > 0 and 0 < curve.advance_ms < curve.draft_step_ms  # a dropped draft's round
    assert engine.policy.drop_ms >= curve.advance_ms
    assert engine.policy.draft_streams == cost_model.DRAFT_STREAMS  # a batch's draft step by streams drafting
    assert len(engine.policy.draft_many_ms) == len(cost_model.DRAFT_STREAMS) and min(engine.policy.draft_many_ms) > 0

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although this machine's curve is cached")

    monkeypatch.setattr(cost_model, "measure_costs", no_measuring)
    again = Engine(backend, KangarooDrafter(), CostAwarePolicy.create(config), GreedyVerifier(), config)
    assert again.policy.pass_ms == measured

    prompts = [[3, 5, 7], [11, 2, 9, 4, 1], [8]]
    alone = [engine.generate_ids(p).token_ids for p in prompts]
    assert alone == [hf_greedy(model, p, 12) for p in prompts]
    together = engine.generate_many(prompts, max_batch=3)
    assert [r.token_ids for r in together] == alone


def test_bench_compares_policies_on_every_drafting_method_and_names_the_cpu(tiny_model_dir, tmp_path):
    import json

    from kangaroo_apps.cli import main
    from kangaroo_core.machine import cpu_description

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": str(i), "subtask": f"s{i % 2}", "turns": [t]}) + "\n"
                                 for i, t in enumerate(["Hello there", "the cat runs"])))
    out = tmp_path / "out"
    assert main(["bench", "--methods", "vanilla,kangaroo,kangaroo_hybrid", "--policies", "threshold,cost",
                 "--questions", str(questions), "--model", str(tiny_model_dir), "--max-new-tokens", "6",
                 "--out", str(out), "--no-progress", "--baseline", "vanilla"]) == 0
    results = json.loads((out / "results.json").read_text())
    columns = list(results["methods"])
    for method in ("kangaroo", "kangaroo_hybrid"):
        for policy in ("threshold", "cost"):
            entry = results["methods"][f"{method}[policy={policy}]"]
            assert entry["error"] is None and entry["overall"]["identical_to_target_alone"] is True
    assert len(columns) == 1 + 3 + 4  # hf_vanilla, the three methods, one column per (drafting method, policy)
    cpu = results["run"]["cpu_details"]
    assert cpu == cpu_description() and cpu["model"] in results["run"]["cpu"]
    assert f"- cpu: {results['run']['cpu']}" in (out / "results.md").read_text()


class _Streams:
    """A backend as the cost policy sees it: how many streams share its passes."""

    def __init__(self, streams: int):
        self.streams = streams


def test_in_a_batch_drafting_turns_itself_down_where_a_row_is_worth_more_as_another_streams_step():
    # passes over up to 4 rows cost one pass; every further row costs as much again
    policy = CostAwarePolicy(costs="0.5,10,10,10,10,20,30,40,50,60,70,80", prior=1e6)
    policy.prepare(None, [], 64)
    policy.first = policy.later = 0.7
    policy.backend = _Streams(1)
    assert policy.round_budget(6) == 6  # alone: three drafts ride in the same pass
    policy.begin_round()
    assert policy.keep_drafting(step(1, 0.9))
    policy.backend = _Streams(4)  # four streams fill the free rows: a draft displaces nothing but costs a pass
    assert policy.round_budget(6) == 0
    assert policy.rate(1, 0.7) < policy.rate(0, 0.0)


class _Recording(CostAwarePolicy):
    bound: list = []

    def bind_engine(self, engine):
        super().bind_engine(engine)
        type(self).bound.append(getattr(engine.backend, "streams", None))


def test_a_batch_binds_every_streams_policy_to_its_own_engine():
    model = tiny_llama(12, vocab=64, hidden=32, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    config = DecodeConfig(gamma=3, exit_layer=1, max_new_tokens=10)
    engine = Engine(backend, KangarooDrafter(), _Recording(costs="0.1,1,1.1,1.2,1.3"), GreedyVerifier(), config)
    _Recording.bound.clear()
    prompts = [[3, 5, 7], [11, 2, 9, 4, 1], [8]]
    together = engine.generate_many(prompts, max_batch=3)
    assert [r.token_ids for r in together] == [hf_greedy(model, p, 10) for p in prompts]
    assert len(_Recording.bound) == 3 and all(n is not None and n >= 1 for n in _Recording.bound)


def test_in_a_batch_a_skipping_stream_probes_less_often():
    policy = CostAwarePolicy(costs="0.5,10,15,20,25,30,35,40", prior=1e6, gate=False)
    policy.prepare(None, [], 64)
    policy.first = policy.later = 0.0
    policy.backend = _Streams(1)
    assert [policy.round_budget(6) for _ in range(4)] == [0, 0, 0, 1]
    policy.end_round([step(1, 0.5)], 1)
    policy.first = policy.later = 0.0
    policy.backend = _Streams(3)  # the probe's draft holds up two other streams
    assert [policy.round_budget(6) for _ in range(12)] == [0] * 11 + [1]


@pytest.mark.parametrize("batch", ["together", "wait"])
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_the_gate_decides_for_a_stream_alone_and_a_batch_decides_as_before(batch, streams):
    # rows are nearly free: drafting pays whatever the batch's pricing
    policy = CostAwarePolicy(costs="1," + ",".join(str(10 + 0.2 * i) for i in range(64)), batch=batch, prior=1e6)
    policy.prepare(None, [], 64)
    policy.backend = _Streams(streams)
    assert [policy.round_budget(6) for _ in range(5)] == [6] * 5
    assert policy.gated == (streams == 1)
    policy.begin_round()
    # a hopeless draft: dropped by a stream alone; in a batch every draft is verified (the earlier model)
    assert policy.worth_verifying(step(1, 0.001)) == (streams > 1)
    policy.yielded = (1.0, 2 * policy.round_cost(0, streams))  # drafting yielded half a plain step's rate
    policy.first = policy.later = 0.9
    assert policy.round_budget(6) == (0 if streams == 1 else 6)


def test_the_curve_is_measured_on_the_backends_host_threads_although_an_engine_binds_outside_the_loop(monkeypatch,
                                                                                                    tmp_path):
    """A backend on its own thread pools (``host_threads``, the onnx backend on CPU) is priced as the loop runs it:
    every pass of the curve (rounds, passes, a batch's merged passes) with torch held to those threads, although the
    policy measures when its engine binds; torch's setting is back after."""
    import torch

    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))  # nothing cached: the engine below measures
    monkeypatch.setenv("KANGAROO_COST_REPEATS", "1")
    backend = tiny_backend(tiny_llama(12, vocab=64, hidden=32, layers=3), exit_layer=1)
    backend.host_threads = 1
    seen = []
    for name in ("shallow", "shallow_many"):  # every measured pass, round and batch pass starts with M[:l]
        method = getattr(type(backend), name)
        monkeypatch.setattr(type(backend), name,
                            lambda self, *a, _m=method, **k: seen.append(torch.get_num_threads()) or _m(self, *a, **k))
    config = DecodeConfig(gamma=2, exit_layer=1, max_new_tokens=8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Engine(backend, KangarooDrafter(), CostAwarePolicy.create(config), GreedyVerifier(), config)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_timings_per_size_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KANGAROO_COST_REPEATS", "2")
    assert cost_model._repeats(9) == 2
    monkeypatch.setenv("KANGAROO_COST_REPEATS", "")
    assert cost_model._repeats(9) == 9
    monkeypatch.setenv("KANGAROO_COST_REPEATS", "many")
    with pytest.raises(ValueError, match="KANGAROO_COST_REPEATS must be a whole number"):
        cost_model._repeats(9)


def test_in_a_batch_merged_draft_steps_keep_drafting_where_one_by_one_steps_would_not():
    # rows are cheap (half a millisecond each); a draft step costs 3 alone
    costs = "3," + ",".join(str(10 + 0.5 * i) for i in range(64))
    decisions = {}
    for name, draft_many in {"merged": (3.0, 3.3, 3.6, 4.2), "one_by_one": (3.0, 6.0, 12.0, 24.0)}.items():
        policy = CostAwarePolicy(costs=costs, prior=1e6)
        policy.draft_streams, policy.draft_many_ms = (1, 2, 4, 8), draft_many
        policy.prepare(None, [], 64)
        policy.first = policy.later = 0.7
        policy.backend = _Streams(4)
        decisions[name] = policy.round_budget(6)
        # every stream drafting 2: two merged draft steps (each D(4) - D(1) more than alone) and 4 x 3 verify rows
        assert policy.round_cost(2, 4) == pytest.approx(6 + 11 + 2 * (draft_many[2] - 3) + (10 + 0.5 * 11) - 11)
    assert decisions == {"merged": 6, "one_by_one": 0}
    wait = CostAwarePolicy(costs=costs, prior=1e6, batch="wait")  # the others wait for its drafts: no merged steps
    wait.draft_streams, wait.draft_many_ms = (1, 2, 4, 8), (3.0, 3.3, 3.6, 4.2)
    wait.prepare(None, [], 64)
    wait.first = wait.later = 0.7
    wait.backend, wait.streams = _Streams(4), 4
    assert wait.round_cost(2, 4) == pytest.approx(6 + 11 + (10 + 0.5 * 5) - 11)  # t(s + k): one row per other stream
    assert wait.rate(1, 0.7) == pytest.approx(4.7 / (3 + 10.5 + 12 - 10.5))
    policy = CostAwarePolicy(costs=costs)  # given as numbers: a batch's draft steps priced one by one
    assert policy.draft_pass_cost(4) == pytest.approx(12.0) and policy.round_cost(1, 1) == pytest.approx(13.5)


def test_in_a_batch_the_streams_draft_their_first_step_together_and_a_further_step_is_priced_as_alone():
    decisions = {}
    for streams in (1, 4):
        policy = CostAwarePolicy(costs="3," + ",".join(str(10 + 0.5 * i) for i in range(64)), prior=1e6)
        policy.draft_streams, policy.draft_many_ms = (1, 2, 4, 8), (3.0, 3.3, 3.6, 4.2)
        policy.prepare(None, [], 64)
        policy.first = policy.later = 0.9
        policy.backend = _Streams(streams)
        budget = policy.round_budget(6)
        policy.begin_round()
        decisions[streams] = budget, policy.keep_drafting(step(1, 0.9))
    # alone a second draft pays (2.71 tokens in 17 ms against 1.9 in 13.5); in a batch of 4 the first step is
    # merged, but a second one alone holds up three streams for 3.5 ms (5.71 tokens in 18.5 ms against 4.9 in 15)
    assert decisions == {1: (6, True), 4: (6, False)}


class _CountingDrafter(KangarooDrafter):
    """Records how many streams each merged draft step held."""

    sizes: list = []

    def advance_many(self, calls):
        type(self).sizes.append(len(calls))
        return super().advance_many(calls)


def test_a_batchs_passes_are_measured_as_a_batch_runs_them_or_as_one_stream_where_streams_cannot_merge():
    model = tiny_llama(13, vocab=64, hidden=32, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    drafter = _CountingDrafter()
    drafter.bind(backend)
    _CountingDrafter.sizes.clear()
    calls = []
    backend.deep_many = lambda parts, run=backend.deep_many: calls.append([p[1].shape[0] for p in parts]) or run(parts)
    steps, passes = cost_model.measure_batch_passes(backend, drafter, context=20, streams=(1, 2, 4), rows=(1, 3),
                                                    repeats=3)
    assert len(steps) == 3 and len(passes) == 6 and min(steps + passes) > 0
    assert sorted(_CountingDrafter.sizes) == [1] * 3 + [2] * 3 + [4] * 3  # each a merged step of that many streams
    assert sorted(map(tuple, calls)) == sorted([(r,) * s for s in (1, 2, 4) for r in (1, 3)] * 3)
    curve = cost_model.CostCurve("torch", "plain", 1, 20, (1,), (5.0,), steps[0], 3, draft_streams=(1, 2, 4),
                                 draft_many_ms=steps, verify_rows=(1, 3), verify_many_ms=passes)
    table = curve.table()  # what `kangaroo profile` prints
    assert "| streams drafting together | 1 | 2 | 4 |" in table and f"| 4 | {passes[4]:.1f} | {passes[5]:.1f} |" in table

    scripted = ScriptedDrafter(list(range(40)), 64, strict=False)  # cannot fork: a batch runs one stream at a time
    scripted.bind(backend)
    assert cost_model.measure_batch_passes(backend, scripted, context=20) is None
    curve = cost_model.with_batch_passes(cost_model.CostCurve("torch", "plain", 1, 20, (1,), (5.0,), 2.0, 1), backend,
                                         scripted, repeats=1)
    assert (curve.draft_streams, curve.draft_many_ms, curve.verify_many_ms) == ((1,), (2.0,), ())


def test_in_a_batch_the_verify_pass_is_priced_from_the_measured_merged_passes():
    policy = CostAwarePolicy(costs="3," + ",".join(str(10 + 0.5 * i) for i in range(64)), prior=1e6)
    policy.draft_streams, policy.draft_many_ms = (1, 2, 4, 8), (3.0, 3.3, 3.6, 4.2)
    policy.verify_rows = (1, 2, 4, 8)
    policy.verify_many_ms = (10, 11, 12, 14,  10, 12, 14, 18,  12, 14, 18, 26,  14, 18, 26, 42)
    policy.prepare(None, [], 64)
    assert policy.verify_pass_cost(1, 4) == 12 and policy.verify_pass_cost(2, 3) == pytest.approx(13)
    assert policy.verify_pass_cost(2, 1) == pytest.approx(10.5)  # never below one stream's pass over as many rows
    assert policy.verify_pass_cost(6, 2) == pytest.approx(16)  # between 4 and 8 streams
    # every stream drafting 3: V(4, 4) - V(1, 4) on top of the stream's own round and its merged draft steps
    assert policy.round_cost(3, 4) == pytest.approx(3 * 3 + 11.5 + 3 * 0.6 + 18 - 12)


def test_whole_rounds_are_timed_back_to_back_each_from_where_the_last_ended():
    model = tiny_llama(17, vocab=64, hidden=32, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    drafter = KangarooDrafter()
    drafter.bind(backend)
    events = []
    backend.deep = lambda hidden, start, rows=None, tree=None, run=backend.deep: (
        events.append(("deep", start, hidden.shape[0])) or run(hidden, start, rows, tree))
    drafter.advance = lambda sequence, unseen, run=drafter.advance: (
        events.append(("advance", len(sequence), unseen.shape[0])) or run(sequence, unseen))
    ids = cost_model._context_ids(backend, 60, seed=0)
    backend.reset()
    h = backend.shallow(ids[:20], 0)
    backend.deep(h, 0, rows=[19])
    drafter.reset()
    drafter.advance(ids[:20], h)
    for k, count in ((2, 4), (0, 5), (1, 3)):
        events.clear()
        times = cost_model._time_rounds(backend, drafter, ids, 20, k, count, cost_model.time.perf_counter)
        assert len(times) == count and min(times) > 0
        passes = [e for e in events if e[0] == "deep"]
        # every round verifies its k drafts and x_n, starting where the previous round's accepted tokens ended
        assert passes == [("deep", 20 + i * (k + 1), k + 1) for i in range(count)]
        steps = [e for e in events if e[0] == "advance"]
        assert len(steps) == k * count  # a plain step (k = 0) runs no drafter work
        if k:  # the drafter catches up on its last draft's state and the new x_n, then reads one state per draft
            assert [s[2] for s in steps[k::k]][:count - 1] == [2] * (count - 1)
            assert steps[0] == ("advance", 21, 1)


def test_a_round_is_priced_at_the_context_its_answer_runs_at():
    policy = CostAwarePolicy(costs="3,10,14", gamma=1)
    policy.round_contexts, policy.rounds_by_context = (64, 300), (10.0, 17.0, 12.0, 18.0)
    policy.prepare(None, [1] * 20, 88)  # the answer's middle: 20 + 44 = 64 tokens in
    assert policy.round_ms == (10.0, 17.0)
    assert policy.round_budget(1) == 0  # a first draft at 0.6: 1.6 / 17 < 1 / 10
    policy.prepare(None, [1] * 182, 0)
    assert policy.round_ms == pytest.approx((11.0, 17.5))
    policy.prepare(None, [1] * 1000, 128)  # past the longest measured context: its costs
    assert policy.round_ms == (12.0, 18.0)
    assert policy.round_budget(1) == 1  # 1.6 / 18 > 1 / 12
    curve = cost_model.CostCurve("torch", "plain", 1, 300, (1,), (5.0,), 2.0, 1, round_ms=(12.0, 18.0),
                                 short_context=64, short_round_ms=(10.0, 17.0))
    assert "| 64 | 10.0 | 17.0 |" in curve.table()  # what `kangaroo profile` prints
    assert cost_model.curve_from_dict(json.loads(json.dumps(attrs.asdict(curve)))) == curve  # as cached


def test_every_kernel_cap_is_named_in_results_and_keys_its_own_cost_curve(monkeypatch):
    from kangaroo_core import machine

    class _Backend:
        name, exit_layer, model_name = "torch", 2, "m"

    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KANGAROO_ISA", "auto")  # not a cap
    assert machine.forced_paths() == "" and "forced_isa" not in machine.cpu_description()
    uncapped = cost_model.cost_key(_Backend(), None)
    monkeypatch.setenv("KANGAROO_ISA", "avx2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # torch's own kernels capped too: a forced-AVX2 run's speed
    assert machine.forced_paths() == "KANGAROO_ISA=avx2 ATEN_CPU_CAPABILITY=avx2"
    assert machine.cpu_description()["forced_isa"] == machine.forced_paths()
    assert cost_model.cost_key(_Backend(), None) != uncapped
    rebuilt = _Backend()
    rebuilt.kernel_sources = "another build of the kernels"  # a curve measured on other kernels is measured again
    assert cost_model.cost_key(rebuilt, None) != cost_model.cost_key(_Backend(), None)


def test_a_backend_s_kernel_sources_name_its_c_code():
    from kangaroo_backends import native
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.torch_backend import TorchBackend

    digest = native.sources_digest()
    assert len(digest) == 16 and TorchBackend.kernel_sources.fget(None) == OnnxBackend.kernel_sources.fget(None) == digest


def test_the_gated_drafts_study_reads_its_variants_and_sums_seconds_per_subtask():
    import click

    from kangaroo_apps.studies.gated_drafts import parse_variant, summary

    assert parse_variant("default") == {} and parse_variant("gate=false;margin=0.1;batch=wait") == {
        "gate": False, "margin": 0.1, "batch": "wait"}
    with pytest.raises(click.BadParameter, match="KEY=VALUE"):
        parse_variant("gate")
    rows = [{"subtask": s, "seconds": {"alone": a, "default": d}} for s, a, d in [("qa", 1.0, 2.0), ("qa", 3.0, 2.0),
                                                                                 ("math", 2.0, 1.0)]]
    assert summary({"variants": ["default"], "questions": rows}).splitlines() == [
        "qa: default x1.000", "math: default x2.000", "overall: default x1.200"]
