"""Many streams at once (kangaroo_core.batching): lossless and batch-invariant.

Every stream's tokens must equal decoding its prompt alone, whatever shares its passes and whenever it joined:
hypothesis draws prompts, budgets, arrival times, cancellations and EOS on tiny models of every family, for the
target alone, Kangaroo chains, token trees and sampling with seeds. The merged passes must really be merged
(power: passes hold several streams).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_apps.testing import TINY_FAMILIES, TinyTokenizer, random_deep_context_adapter, tiny_model
from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core.batching import Cancelled
from kangaroo_core.config import DecodeConfig, SamplingConfig
from kangaroo_core.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
EOS = 5

_ENGINES: dict = {}


def engines(family: str):
    """(target alone, Kangaroo chain, Kangaroo dynamic tree) on one tiny float32 model (the row-exact kernels)."""
    if family not in _ENGINES:
        m = tiny_model(family, 0, dtype=torch.float32, eos_token_id=EOS)
        b = TorchBackend(m, TinyTokenizer(m.config.vocab_size, EOS), 2, f"tiny-{family}")
        config = DecodeConfig(exit_layer=2, eta=0.2, gamma=4)
        _ENGINES[family] = (Engine.build(backend=b, drafter=None),
                            Engine.build(backend=b, config=config, drafter="kangaroo"),
                            Engine.build(backend=b, config=config, drafter="kangaroo", tree="dynamic",
                                         tree_options={"budget": 5}))
    return _ENGINES[family]


@st.composite
def plans(draw):
    family = draw(st.sampled_from(TINY_FAMILIES))
    which = draw(st.sampled_from([0, 1, 1, 2]))  # target alone, chain, tree
    n = draw(st.integers(1, 5))
    streams = [(draw(st.lists(st.integers(1, 63), min_size=1, max_size=18)),  # prompt (a long one runs alone)
                draw(st.integers(1, 30)),  # token budget
                draw(st.integers(0, 12)),  # the merged pass before which it joins
                draw(st.one_of(st.none(), st.integers(0, 20))))  # cancelled before this pass, or never
               for _ in range(n)]
    return family, which, draw(st.integers(1, 4)), streams


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans())
def test_every_stream_decodes_what_it_decodes_alone(plan):
    family, which, max_batch, streams = plan
    engine = engines(family)[which]
    batch = engine.batch(max_batch)
    handles: dict[int, object] = {}
    step = 0
    while len(handles) < len(streams) or any(not h.finished.is_set() for h in handles.values()):
        for i, (prompt, budget, arrival, cancel_at) in enumerate(streams):
            if arrival == step and i not in handles or (arrival < step and i not in handles):
                handles[i] = batch.submit(prompt, max_new_tokens=budget)
            if cancel_at == step and i in handles:
                handles[i].cancel()
        batch.step()
        step += 1
        assert step < 2000
    for i, (prompt, budget, _, cancel_at) in enumerate(streams):
        want = engine.generate_ids(prompt, budget).token_ids
        h = handles[i]
        if h.error is not None:
            assert isinstance(h.error, Cancelled) and cancel_at is not None
            assert h._tokens == want[: len(h._tokens)]  # what it emitted before it left is the alone prefix
        else:
            assert h.result.token_ids == want, (i, plan)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_passes_are_merged_and_results_come_in_input_order(family):
    alone, chain, tree = engines(family)
    prompts = [[random.Random(s).randrange(1, 64) for _ in range(3 + s)] for s in range(6)]
    for engine in (alone, chain, tree):
        batch = engine.batch(4)
        results = batch.generate(prompts, max_new_tokens=24)
        assert [r.token_ids for r in results] == [engine.generate_ids(p, 24).token_ids for p in prompts]
        assert max(batch.sizes) == 4 and batch.streams_per_pass > 1.5 * batch.passes  # power: really merged


def test_a_seed_reproduces_a_stream_whatever_shares_its_passes():
    _, chain, _ = engines("llama")
    prompts = [[random.Random(s).randrange(1, 64) for _ in range(6)] for s in range(4)]
    settings_ = [SamplingConfig(temperature=1.0, seed=10 + i) for i in range(4)]
    alone = [chain.with_sampling(s).generate_ids(p, 20).token_ids for p, s in zip(prompts, settings_)]
    batch = chain.batch(4)
    streams = [batch.submit(p, max_new_tokens=20, sampling=s) for p, s in zip(prompts, settings_)]
    assert [s.wait().token_ids for s in streams] == alone
    greedy = chain.generate_ids(prompts[0], 20).token_ids
    assert alone[0] != greedy  # power: the sampled stream is not the greedy one


def test_text_streams_and_the_blocking_form_agree(tiny_model_dir):
    engine = Engine.build(str(tiny_model_dir), config=DecodeConfig(max_new_tokens=12))
    batch = engine.batch(2)
    streams = [batch.submit(q) for q in ("Hello there", "the cat", "a dog runs")]
    texts = ["".join(s) for s in streams]
    assert texts == [s.result.text for s in streams] == [engine.generate(q).text for q in ("Hello there", "the cat", "a dog runs")]
    assert [r.token_ids for r in engine.generate_many(["the cat"], max_batch=3)] == [streams[1].result.token_ids]


# -- the commands ------------------------------------------------------------------------------------------------------
def test_generate_answers_a_prompts_file_in_input_order_as_each_prompt_alone(tiny_model_dir, tmp_path, capsys):
    import json

    from kangaroo_apps.cli import main

    questions = ["Hello there", "the cat", "a dog runs", "the dog and the cat", "Hello"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    assert main(["generate", "--prompts", str(path), "--batch", "3", "--json", "--model", str(tiny_model_dir),
                 "--max-new-tokens", "10"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["id"] for line in lines] == [f"q{i}" for i in range(5)]
    engine = Engine.build(str(tiny_model_dir), config=DecodeConfig(max_new_tokens=10))
    assert [line["token_ids"] for line in lines] == [engine.generate(q).token_ids for q in questions]
    assert {"text", "new_tokens", "cr", "seconds"} <= set(lines[0]) and "5 answers" in captured.err


@pytest.mark.parametrize("content, message", [
    ("not json\n", "prompts.jsonl:1: not a JSON object"),
    ('{"id": 1}\n', 'prompts.jsonl:1: expected {"id": ..., "prompt": "<non-empty text>"}'),
    ("\n", "holds no prompts"),
])
def test_a_bad_prompts_file_is_refused_in_one_line_before_any_decoding(tiny_model_dir, tmp_path, capsys, content,
                                                                        message):
    from kangaroo_apps.cli import main

    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert main(["generate", "--prompts", str(path), "--model", str(tiny_model_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_prompt_and_prompts_file_exclude_each_other(capsys):
    from kangaroo_apps.cli import main

    assert main(["generate"]) == 2
    assert "give a PROMPT or --prompts" in capsys.readouterr().err


def test_bench_concurrency_writes_the_table_with_identity_per_stream(tiny_model_dir, tmp_path):
    import json

    from kangaroo_apps.cli import main

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": str(i), "subtask": f"s{i % 2}", "turns": [t]}) + "\n"
                                 for i, t in enumerate(["Hello there", "the cat runs", "a dog", "the dog"])))
    out = tmp_path / "out"
    assert main(["bench", "--concurrency", "1,3", "--questions", str(questions), "--model", str(tiny_model_dir),
                 "--max-new-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    saved = json.loads((out / "concurrency.json").read_text())
    rows = saved["rows"]
    assert saved["info"]["cpu_details"]["model"] and f"CPU: {saved['info']['cpu']}" in (out / "concurrency.md").read_text()
    assert [(r["method"], r["streams"]) for r in rows] == [("vanilla", 1), ("vanilla", 3), ("kangaroo", 1),
                                                           ("kangaroo", 3)]
    assert all(r["identical_to_alone"] == 4 and r["identical_to_target_alone"] == 4 for r in rows)
    assert rows[1]["streams_per_pass"] > 1.5 and "| kangaroo | 3 |" in (out / "concurrency.md").read_text()


def test_an_engine_that_cannot_fork_decodes_its_streams_one_at_a_time():
    """A drafter without fork() or a backend without stream views: a batch still runs it, its streams taking turns
    on the engine's own caches, each exactly as alone."""
    from kangaroo_apps.testing import ScriptedDrafter
    from kangaroo_core.config import ConfigError
    from kangaroo_policies.threshold import ThresholdPolicy

    alone, _, _ = engines("llama")
    with pytest.raises(ConfigError, match="max_batch must be >= 1"):
        alone.batch(0)
    prompts = [[random.Random(s).randrange(1, 64) for _ in range(4 + s)] for s in range(3)]
    reference = prompts[0] + alone.generate_ids(prompts[0], 16).token_ids
    # the threshold rule drafts whatever this machine's costs: the power check below does not hang on a timing
    scripted = Engine(alone.backend, ScriptedDrafter(reference, 64, wrong_at={len(prompts[0]) + 3}),
                      ThresholdPolicy(eta=0.5), alone.verifier, alone.config)
    view_less = Engine(_NoViews(alone.backend), None, alone.policy, alone.verifier, alone.config)
    for engine, why in ((scripted, "drafter cannot decode several streams at once"),
                        (view_less, "backend cannot decode several streams at once")):
        batch = engine.batch(3)
        assert why in batch.alone and batch.max_batch == 1
        results = batch.generate(prompts, max_new_tokens=16)
        assert [r.token_ids for r in results] == [alone.generate_ids(p, 16).token_ids for p in prompts]
        assert set(batch.sizes) == {1} and batch.passes > 3 * 16  # every pass one stream's
    first = scripted.batch(2).generate(prompts[:1], max_new_tokens=16)[0]
    assert any(r.accepted for r in first.rounds)  # power: the scripted drafts were drafted and accepted


@pytest.mark.parametrize("tree", [None, "chain"])
def test_a_stateful_policy_in_a_batch_of_3_decides_as_each_prompt_alone(tree):
    """Each stream's policy and tree shaper are its own (Engine.for_stream): the adaptive policy's per-round eta
    and every drafting decision (drafts and accepted drafts per round) are those of the prompt decoded alone."""
    _, chain, _ = engines("llama")
    engine = Engine.build(backend=chain.backend, config=chain.config, drafter="kangaroo", policy="adaptive",
                          policy_options=ADAPTIVE, tree=tree)
    prompts = [[random.Random(s).randrange(1, 64) for _ in range(5 + s)] for s in range(3)]
    alone = [engine.generate_ids(p, 30) for p in prompts]
    batched = engine.batch(3).generate(prompts, max_new_tokens=30)

    def decisions(result):
        return [(r.drafted, r.accepted) for r in result.rounds]

    assert [decisions(r) for r in batched] == [decisions(r) for r in alone]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    drafted = {r.drafted for result in alone for r in result.rounds}
    assert {1, chain.config.gamma} <= drafted  # power: both of the policy's choices happen


#: adaptive options under which the tiny model's first drafts fall on both sides of the pivot: a confident start
#: drafts gamma tokens, a hesitant one a single draft
ADAPTIVE = {"pivot": 0.13, "eta_confident": 0.0, "eta_unsure": 1.0}


class _NoViews:
    """A backend without stream views (the contract's default)."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def stream_view(self):
        from kangaroo_core.interfaces import Backend

        return Backend.stream_view(self)


# -- the drafter's step, merged across streams ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep_context_engine(tmp_path_factory):
    """Kangaroo chains with a deep-context adapter (random fusions, an MLP block, a draft head) on a tiny float32
    model: the drafter whose step a batch merges (DeepContextTorchRunner.advance_many). The threshold policy decides
    as alone whatever the batch (the cost policy counts the streams that share a pass)."""
    _, chain, _ = engines("llama")
    model = chain.backend.model
    adapter = random_deep_context_adapter(model, 2, 3, draft_vocab=list(range(1, 64, 2)) + [EOS], ffn=True)
    directory = tmp_path_factory.mktemp("deep") / "adapter"
    adapter.save(directory, base_fingerprint=chain.backend.fingerprint, exit_layer=2)
    engine = Engine.build(backend=chain.backend, config=chain.config, drafter="kangaroo-hybrid", policy="threshold",
                          drafter_options={"adapter": str(directory)})
    if engine.drafter.adapter.runner.kernel is None:
        pytest.skip("the small-batch kernel is not built on this machine: draft steps run one by one")
    return engine


def _stream_at(drafter, view, tokens: list[int], prompt: int, steps: int):
    """A fork where a stream would be: its prompt prefilled (the drafter given its deep states), then ``steps`` more
    positions drafted one at a time; returns the call that advances it over the rest of ``tokens`` (its whole prompt
    when it has not drafted yet)."""
    view.reset()
    drafter.reset()
    h = view.shallow(tokens[:prompt], 0)
    drafter.observe_deep(0, view.deep(h, 0, rows=[prompt - 1]).hidden)
    if prompt == len(tokens):
        return drafter, tokens, h
    drafter.advance(tokens[:prompt], h)
    for p in range(prompt, prompt + steps):
        drafter.advance(tokens[:p + 1], view.shallow(tokens[p:p + 1], p))
    cut = prompt + steps
    return drafter, tokens, view.shallow(tokens[cut:], cut)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams=st.lists(st.tuples(st.integers(2, 24), st.integers(0, 4), st.integers(1, 5)), min_size=2, max_size=5))
def test_a_merged_draft_step_gives_each_stream_exactly_its_own_logits(deep_context_engine, streams):
    """Streams at different depths, each advancing by one to five rows, or by its whole prompt (more than 16 rows:
    run on its own), in one draft pass: every stream's logits, and its next step after it, are bit for bit those of
    the same step taken alone."""
    engine = deep_context_engine
    base, backend = engine.drafter, engine.backend
    calls, alone = [], []
    for i, (prompt, steps, new) in enumerate(streams):
        rng = random.Random(i)
        first = steps == 0 and new == 1  # its first step: the whole prompt at once
        tokens = [rng.randrange(1, 64) for _ in range(prompt + (0 if first else steps + new))]
        calls.append(_stream_at(base.fork(view := backend.stream_view()), view, tokens, prompt, steps))
        alone.append(_stream_at(base.fork(view := backend.stream_view()), view, tokens, prompt, steps))
    together = base.advance_many(calls)
    for (drafter, tokens, hidden), row in zip(alone, together):
        assert torch.equal(drafter.advance(tokens, hidden), row)
    follow = [torch.randn(1, backend.hidden_size, generator=torch.Generator().manual_seed(i)) for i in range(len(calls))]
    again = base.advance_many([(d, t + [7], h) for (d, t, _), h in zip(calls, follow)])
    for (drafter, tokens, _), h, row in zip(alone, follow, again):
        assert torch.equal(drafter.advance(tokens + [7], h), row)


def test_draft_steps_are_merged_and_every_stream_drafts_as_alone(deep_context_engine):
    """In a batch of 4 (two greedy streams, two sampling from the drafter's distribution with their own seeds) the
    draft steps run merged, and every stream drafts, accepts and emits exactly what it does alone."""
    engine = deep_context_engine
    prompts = [[random.Random(s).randrange(1, 64) for _ in range(4 + 3 * s)] for s in range(4)]
    samplings = [None, None, SamplingConfig(temperature=0.8, seed=3, sample_drafts=True),
                 SamplingConfig(temperature=1.0, seed=4, sample_drafts=True)]
    alone = [(engine if s is None else engine.with_sampling(s)).generate_ids(p, 24) for p, s in zip(prompts, samplings)]
    batch = engine.batch(4)
    streams = [batch.submit(p, max_new_tokens=24, sampling=s) for p, s in zip(prompts, samplings)]
    batched = [s.wait() for s in streams]

    def decisions(result):
        return [(r.drafted, r.accepted) for r in result.rounds]

    assert [decisions(r) for r in batched] == [decisions(r) for r in alone]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    steps = sum(r.drafted for result in batched for r in result.rounds)
    assert 0 < batch.kinds["draft"] < 0.7 * steps  # power: draft steps of several streams ran as one
    apart = Engine.build(backend=engine.backend, config=engine.config, drafter="kangaroo-hybrid", policy="threshold",
                         drafter_options={"adapter": engine.drafter.resolved_adapter, "merge_steps": False})
    assert [r.token_ids for r in apart.batch(4).generate(prompts[:2], max_new_tokens=24)] == [r.token_ids for r in alone[:2]]
