"""Token trees: lossless under greedy (hypothesis over random tiny models, tree shapes and budgets) and sampling
(the acceptance rule analytically, and the engine's first tokens by chi-square with a power check), caches that hold
exactly the accepted path, EOS inside a tree, budget 1, the context limit, refusals.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_core.config import ConfigError, DecodeConfig, SamplingConfig
from kangaroo_core.engine import Engine
from kangaroo_core.interfaces import SelfDrafter, Verifier
from kangaroo_core.results import Verdict
from kangaroo_apps.testing import hf_greedy, set_eos, tiny_backend, tiny_llama
from kangaroo_core.tree import (DraftTree, TreeAttention, VerifyTree, first_token_distribution, greedy_tree_walk,
                                sample_tree_walk)
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_plugins.speculative_verifier import SpeculativeVerifier
from kangaroo_policies.threshold import ThresholdPolicy
from kangaroo_policies.tree_shapes import ChainTree, DynamicTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class OracleTreeDrafter(SelfDrafter):
    """Knows the target's greedy sequence; after any prefix it proposes the right next token first (prob 0.6) and a
    wrong one second (0.3) — or, at the ``swap_at`` positions, the wrong one first, so the right one is a *sibling*.
    Off the reference it proposes fixed tokens. Implements the tree contract (``advance_tree``, ``keep``)."""

    name = "oracle-tree"
    drafts_trees = True

    def __init__(self, reference, vocab: int, swap_at=()):
        self.reference, self.vocab, self.swap_at = list(reference), vocab, set(swap_at)
        self.n = 0

    @property
    def seen(self) -> int:
        return self.n

    def bind(self, backend) -> None:
        assert backend.vocab_size == self.vocab

    def reset(self) -> None:
        self.n = 0

    def crop(self, length: int) -> None:
        self.n = min(self.n, length)

    def keep(self, positions) -> None:
        positions = list(positions)
        assert positions == sorted(positions) and positions[-1] < self.n
        self.n = len(positions)

    def _logits(self, sequence) -> torch.Tensor:
        pos = len(sequence)
        on_script = pos < len(self.reference) and list(sequence) == self.reference[:pos]
        right = self.reference[pos] if on_script else (7 * pos + 3) % self.vocab
        wrong = (right + 1 + pos % (self.vocab - 1)) % self.vocab
        first, second = (wrong, right) if pos in self.swap_at else (right, wrong)
        probs = torch.full((self.vocab,), 0.1 / (self.vocab - 2), dtype=torch.float64)
        probs[first], probs[second] = 0.6, 0.3
        return probs.log()

    def advance(self, token_ids, hidden):
        self.n += hidden.shape[0]
        assert self.n == len(token_ids)
        return self._logits(token_ids)

    def advance_tree(self, token_ids, paths, hidden, start, tree):
        assert start == self.n and hidden.shape[0] == len(paths) == len(tree.positions)
        self.n += hidden.shape[0]
        return torch.stack([self._logits(list(token_ids) + list(path)) for path in paths])


def make_engine(backend, drafter, tree, *, max_new_tokens=40, sampling=SamplingConfig(), gamma=6):
    config = DecodeConfig(exit_layer=backend.exit_layer, eta=0.0, gamma=gamma, max_new_tokens=max_new_tokens,
                          sampling=sampling)
    verifier = GreedyVerifier() if sampling.greedy else SpeculativeVerifier(sampling)
    return Engine(backend, drafter, ThresholdPolicy(eta=0.0), verifier, config, tree=tree)


@torch.inference_mode()
def assert_caches_hold(engine, sequence, cached):
    """Every cache holds exactly the first ``cached`` tokens of ``sequence``, as a fresh prefill computes them."""
    backend = engine.backend
    assert backend.cache.lengths == [cached] * backend.num_layers
    fresh = tiny_backend(backend.model, exit_layer=backend.exit_layer)
    h = fresh.shallow(list(sequence[:cached]), 0)
    deep = fresh.deep(h, 0).hidden
    for i in range(backend.num_layers):
        for got, want in zip(backend.cache.layer(i), fresh.cache.layer(i)):
            assert torch.allclose(got, want, atol=1e-9), f"layer {i} differs from the target alone"
    drafter = engine.drafter
    if isinstance(drafter, KangarooDrafter) and drafter.seen:
        a, seen = drafter.adapter, drafter.seen
        if drafter.wants_deep_states:  # keys of verified positions fuse their deep states, the others do not
            known = drafter.runner.context.known
            flags = (torch.arange(seen) < known).to(h.dtype)[:, None]
            want = a.keys_values(a.kv_input(h[:seen], deep[:seen], flags)[None], torch.arange(seen))
            assert torch.allclose(drafter.runner.context.hidden[:seen], h[:seen], atol=1e-9)
        else:
            cache = a.new_cache()
            a(h[:seen][None], 0, cache)
            want = cache.layer(0)
        for got, ref in zip(drafter.runner.cache.layer(0), want):
            assert torch.allclose(got, ref, atol=1e-9), "adapter cache differs"


def run_checked(engine, prompt, max_new_tokens):
    """Decode round by round, checking every cache after each round that the generation goes on from (after the
    last one, as in the chain, the caches may also hold the accepted tokens that EOS or the budget cut off)."""
    loop = engine.decode(list(prompt), max_new_tokens)
    output = []
    while True:
        try:
            output.extend(next(loop))
        except StopIteration as done:
            return done.value
        if output[-1] not in engine.backend.eos_token_ids and len(output) < max_new_tokens:
            assert_caches_hold(engine, list(prompt) + output, len(prompt) + len(output) - 1)


# -- the pieces --------------------------------------------------------------------------------------------------
def test_tree_attention_sees_the_prefix_and_the_ancestors_only():
    attention = TreeAttention(committed=3, visible=[(3,), (3, 4), (5,)], positions=[3, 4, 3])
    allowed = attention.allowed(6)
    assert allowed.tolist() == [[True, True, True, True, False, False],
                                [True, True, True, True, True, False],
                                [True, True, True, False, False, True]]
    mask = attention.additive_mask(6, torch.float32)
    assert mask.shape == (1, 1, 3, 6) and float(mask[0, 0, 0, 4]) == torch.finfo(torch.float32).min


def test_draft_tree_and_greedy_walk():
    tree = DraftTree(tokens=[9])
    a = tree.add(0, 5, 0.6, math.log(0.6))
    b = tree.add(0, 6, 0.3, math.log(0.3))
    c = tree.add(b, 7, 0.5, math.log(0.5))
    assert tree.ancestors(c) == [b, c] and tree.depths[c] == 2 and tree.children(0) == [a, b]
    view = VerifyTree(tokens=(9, 5, 6, 7), parents=(-1, 0, 0, 2))
    assert view.children == ((1, 2), (), (3,), ())
    assert greedy_tree_walk(view, [6, 0, 7, 8]) == ([2, 3], 8)  # the sibling is accepted, then its child
    assert greedy_tree_walk(view, [4, 0, 0, 0]) == ([], 4)
    assert VerifyTree.chain([5, 6]).parents == (-1, 0, 1)


probabilities = st.lists(st.sampled_from([0.0, 0.0, 1e-3, 0.05, 0.2, 0.5, 1.0, 3.0]), min_size=2, max_size=7).filter(
    lambda w: sum(w) > 0)


@settings(max_examples=300, deadline=None)
@given(weights=probabilities, data=st.data())
def test_the_multi_candidate_rule_reproduces_p_exactly(weights, data):
    """Analytic: whatever p (zeros, point masses) and whichever distinct candidates (zero-probability ones too)."""
    p = torch.tensor(weights, dtype=torch.float64)
    p = p / p.sum()
    candidates = data.draw(st.lists(st.integers(0, len(weights) - 1), unique=True, max_size=len(weights)))
    assert torch.allclose(first_token_distribution(p, candidates), p, atol=1e-12)


def test_a_wrong_rule_is_caught_analytically():
    """Accepting each candidate with its *original* probability (no renormalisation) is not lossless."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    out, reach = torch.zeros(3, dtype=torch.float64), 1.0
    for c in (0, 1):
        out[c] += reach * p[c]
        reach *= 1 - p[c]
    out[2] += reach
    assert not torch.allclose(out, p, atol=1e-3)
    assert torch.allclose(first_token_distribution(p, [0, 1]), p)


# -- greedy: identical to transformers -------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), topk=st.integers(1, 3), depth=st.integers(1, 5), budget=st.integers(1, 10),
       min_prob=st.sampled_from([0.0, 0.0, 0.25]), swaps=st.sets(st.integers(8, 40), max_size=6),
       max_new_tokens=st.integers(1, 24), eos_index=st.one_of(st.none(), st.integers(0, 20)))
def test_greedy_tree_rounds_are_identical_to_transformers(seed, topk, depth, budget, min_prob, swaps,
                                                          max_new_tokens, eos_index):
    model = tiny_llama(seed, vocab=32, hidden=16, layers=3, heads=4, kv_heads=2)
    prompt = [(seed * 7 + i * 5) % 32 for i in range(8)]
    reference = hf_greedy(model, prompt, max_new_tokens)
    if eos_index is not None and eos_index < len(reference):  # an EOS inside the answer (and maybe inside a tree)
        set_eos(model, reference[eos_index])
        reference = hf_greedy(model, prompt, max_new_tokens)
    drafter = OracleTreeDrafter(prompt + reference, 32, swap_at=swaps)
    tree = DynamicTree(budget=budget, topk=topk, depth=depth, min_prob=min_prob)
    engine = make_engine(tiny_backend(model, exit_layer=1), drafter, tree, max_new_tokens=max_new_tokens)
    result = run_checked(engine, prompt, max_new_tokens)
    assert result.token_ids == reference
    assert all(r.drafted <= budget and r.accepted <= min(depth, r.drafted) for r in result.rounds)


def test_siblings_are_accepted_and_trees_beat_the_chain_with_the_same_drafter():
    model = tiny_llama(4, vocab=32, hidden=16, layers=3)
    prompt = list(range(3, 11))
    reference = hf_greedy(model, prompt, 40)
    swaps = set(range(len(prompt), len(prompt) + 40, 3))  # every third position: the right token is 2nd
    chain = make_engine(tiny_backend(model, exit_layer=1), OracleTreeDrafter(prompt + reference, 32, swaps), None)
    tree = make_engine(tiny_backend(model, exit_layer=1), OracleTreeDrafter(prompt + reference, 32, swaps),
                       DynamicTree(budget=10, topk=2, depth=6, min_prob=0.0))
    a, b = chain.generate_ids(prompt, 40), tree.generate_ids(prompt, 40)
    assert a.token_ids == b.token_ids == reference
    # a chain stops at every swapped position; a round of the tree that accepts more went through a second child
    assert max(r.accepted for r in b.rounds) > max(r.accepted for r in a.rounds)
    assert b.mean_accepted_tokens > a.mean_accepted_tokens


def save_adapter(model, adapter_type: str, directory, exit_layer: int = 2) -> None:
    """An adapter of ``adapter_type`` for ``model`` saved in ``directory`` (a deep-context one with non-zero fusions,
    so the deep states really enter its keys and queries)."""
    from kangaroo_backends.torch_backend import model_fingerprint
    from kangaroo_plugins.kangaroo.networks import adapter_class

    adapter = adapter_class(adapter_type).from_base_layer(model, exit_layer)
    if adapter_type == "deep-context":
        with torch.no_grad():
            for module in (adapter.kv_fuse, adapter.query_fuse, adapter.depth_embedding):
                module.weight.normal_(0, 0.005)
    adapter.save(directory, base_fingerprint=model_fingerprint(model), exit_layer=exit_layer)


@pytest.mark.parametrize("adapter_type", ["attention", "deep-context"])
def test_the_kangaroo_drafter_drafts_trees_losslessly(adapter_type, tmp_path):
    model = tiny_llama(7, vocab=48, hidden=32, layers=4, init_std=0.02)
    save_adapter(model, adapter_type, tmp_path)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    reference = hf_greedy(model, prompt, 30)
    engine = make_engine(tiny_backend(model, exit_layer=2), KangarooDrafter(str(tmp_path)),
                         DynamicTree(budget=6, topk=3, depth=4, min_prob=0.0), max_new_tokens=30)
    result = run_checked(engine, prompt, 30)
    assert result.token_ids == reference and max(r.accepted for r in result.rounds) >= 2  # deeper than the root


def test_the_chain_shaper_reproduces_the_chain_round_for_round():
    model = tiny_llama(9, vocab=32, hidden=16, layers=3, init_std=0.02)
    prompt = [4, 8, 15, 16, 23, 4, 8, 15]
    config = DecodeConfig(exit_layer=1, eta=0.3, gamma=4, max_new_tokens=30)
    results = []
    for tree in (None, ChainTree.create(config)):
        engine = Engine(tiny_backend(model, exit_layer=1), KangarooDrafter(adapter="untrained"),
                        ThresholdPolicy(eta=0.3), GreedyVerifier(), config, tree=tree)
        results.append(engine.generate_ids(prompt))
    chain, as_tree = results
    assert chain.token_ids == as_tree.token_ids == hf_greedy(model, prompt, 30)
    assert [(r.drafted, r.accepted) for r in chain.rounds] == [(r.drafted, r.accepted) for r in as_tree.rounds]


def test_the_fan_shaper_widens_the_first_position_only():
    """``fan``: the root's top-k candidates, the chain below the most likely one; lossless, and with topk=1 it is the
    chain round for round."""
    from kangaroo_policies.tree_shapes import FanTree

    model = tiny_llama(4, vocab=32, hidden=16, layers=3)
    prompt = list(range(3, 11))
    reference = hf_greedy(model, prompt, 40)
    swaps = set(range(len(prompt), len(prompt) + 40))  # the right token is always the drafter's 2nd choice
    config = DecodeConfig(exit_layer=1, eta=0.0, gamma=4, max_new_tokens=40)
    fan = FanTree.create(config, topk=3)
    engine = make_engine(tiny_backend(model, exit_layer=1), OracleTreeDrafter(prompt + reference, 32, swaps), fan,
                         gamma=4)
    result = run_checked(engine, prompt, 40)
    assert result.token_ids == reference and fan.budget == 4 + 3 - 1
    assert all(r.drafted <= fan.budget for r in result.rounds)
    # a chain accepts nothing here; the fan accepts the runner-up at depth 1 and nothing below (it grows the top one)
    chain = make_engine(tiny_backend(model, exit_layer=1), OracleTreeDrafter(prompt + reference, 32, swaps), None,
                        gamma=4)
    assert chain.generate_ids(prompt, 40).mean_accepted_tokens == 1.0
    assert all(r.accepted == 1 for r in result.rounds[:-1]) and result.mean_accepted_tokens > 1.9
    swaps = set(range(len(prompt), len(prompt) + 40, 3))
    narrow = make_engine(tiny_backend(model, exit_layer=1), OracleTreeDrafter(prompt + reference, 32, swaps),
                         FanTree.create(config, topk=1), gamma=4)
    chain_again = make_engine(tiny_backend(model, exit_layer=1), OracleTreeDrafter(prompt + reference, 32, swaps),
                              None, gamma=4)
    a, b = narrow.generate_ids(prompt, 40), chain_again.generate_ids(prompt, 40)
    assert a.token_ids == b.token_ids == reference
    assert [(r.drafted, r.accepted) for r in a.rounds] == [(r.drafted, r.accepted) for r in b.rounds]


def test_budget_1_and_the_context_limit():
    model = tiny_llama(11, vocab=32, hidden=16, layers=3)  # max_position_embeddings 256
    prompt = [(3 * i) % 32 for i in range(230)]
    reference = hf_greedy(model, prompt, 26)
    drafter = OracleTreeDrafter(prompt + reference, 32)
    engine = make_engine(tiny_backend(model, exit_layer=1), drafter, DynamicTree(budget=1, topk=3, depth=5),
                         max_new_tokens=26)
    result = engine.generate_ids(prompt, 26)  # 230 + 26 = the whole context
    assert result.token_ids == reference and all(r.drafted <= 1 for r in result.rounds)
    with pytest.raises(Exception, match="context"):
        engine.generate_ids(prompt, 27)


def test_the_budget_is_read_off_the_measured_cost_curve(tiny_model_dir):
    from kangaroo_policies.tree_shapes import auto_budget, budget_from_curve

    assert budget_from_curve({1: 1.0, 2: 1.1, 3: 1.25, 4: 1.4, 5: 1.29, 6: 1.8}) == 4  # 5 rows: root + 4 nodes
    assert budget_from_curve({1: 1.0, 2: 1.5}) == 1
    backend = tiny_backend(tiny_llama(0, vocab=32, hidden=16, layers=3), exit_layer=1)
    budget, curve = auto_budget(backend, repeats=3)
    assert budget == budget_from_curve(curve.relative) and 1 <= budget <= 15 and len(curve.verify_ms) == 16


def test_refusals():
    model = tiny_llama(1, vocab=32, hidden=16, layers=3)
    backend = tiny_backend(model, exit_layer=1)
    from kangaroo_apps.testing import ScriptedDrafter

    with pytest.raises(ConfigError, match="cannot draft token trees"):
        make_engine(backend, ScriptedDrafter([1, 2, 3], 32), DynamicTree(budget=4))

    class ChainOnly(Verifier):
        name = "chain-only"

        def verify(self, drafts, target_logits):
            return Verdict.chain(0, int(target_logits[0].argmax()))

    with pytest.raises(ConfigError, match="cannot verify token trees"):
        Engine(backend, OracleTreeDrafter([1], 32), ThresholdPolicy(), ChainOnly(), DecodeConfig(exit_layer=1),
               tree=DynamicTree(budget=4))
    sampling = SamplingConfig(temperature=1.0, sample_drafts=True)
    with pytest.raises(ConfigError, match="draft-sampling"):
        make_engine(backend, OracleTreeDrafter([1], 32), DynamicTree(budget=4), sampling=sampling)
    from kangaroo_backends.torch_backend import TorchBackend

    class ChainBackend(TorchBackend):  # a backend that verifies chains only
        supports_trees = False

    with pytest.raises(ConfigError, match="cannot verify token trees"):
        make_engine(ChainBackend(model, None, 1), OracleTreeDrafter([1], 32), DynamicTree(budget=4))
    with pytest.raises(ConfigError, match="budget"):
        DynamicTree(budget=0)
    with pytest.raises(ConfigError, match="min_prob"):
        DynamicTree(min_prob=1.5)


# -- sampling: distributed as the target alone -------------------------------------------------------------------
def sampled_outcomes(backend, verifier_cls, n=400, seed0=0):
    """n seeded tree generations of 3 tokens (oracle drafter, two children per node): the outcomes as integers and
    the drafts accepted."""
    from test_sampling_distribution import PROMPT, SAMPLING, TOKENS, VOCAB

    engine = make_engine(backend, OracleTreeDrafter(PROMPT + [0, 1, 2], VOCAB),
                         DynamicTree(budget=6, topk=2, depth=2), max_new_tokens=TOKENS, sampling=SAMPLING)
    engine.verifier = verifier_cls(SAMPLING)
    out, accepted = [], 0
    for seed in range(seed0, seed0 + n):
        engine.config = engine.config.replace(sampling=SAMPLING.replace(seed=seed))
        result = engine.generate_ids(PROMPT, TOKENS)
        ids = result.token_ids
        out.append((ids[0] * VOCAB + ids[1]) * VOCAB + ids[2])
        accepted += sum(r.accepted for r in result.rounds)
    return out, accepted


class NoRenormalisation(SpeculativeVerifier):  # accepts each candidate with its original p: not lossless
    def verify_tree(self, tree, target_logits):
        from kangaroo_core.sampling import draw, target_probs, uniform

        p = target_probs(target_logits, self.sampling)
        row, path = 0, []
        while True:
            nxt = next((c for c in tree.children[row] if uniform(self.generator) < float(p[row, tree.tokens[c]])),
                       None)
            if nxt is None:
                return Verdict([r - 1 for r in path], draw(p[row], self.generator))
            path.append(nxt)
            row = nxt


def test_tree_sampling_follows_the_target_distribution_and_a_wrong_rule_is_caught():
    from test_sampling_distribution import SAMPLING, VOCAB, chi_square, exact_distribution

    model = tiny_llama(2, vocab=VOCAB, hidden=16, layers=3, heads=4, kv_heads=2)
    target = exact_distribution(model, SAMPLING)
    samples, accepted = sampled_outcomes(tiny_backend(model, exit_layer=1), SpeculativeVerifier)
    assert accepted > 50
    statistic, critical = chi_square(samples, target)
    assert statistic < critical, (statistic, critical)
    wrong, _ = sampled_outcomes(tiny_backend(model, exit_layer=1), NoRenormalisation, seed0=5000)
    assert chi_square(wrong, target)[0] > critical  # the test has the power to see a wrong rule


def test_sample_walk_uses_the_residual():
    """One row, two candidates with all the mass: the emitted token is a candidate, drawn as p says."""
    view = VerifyTree(tokens=(0, 1, 2), parents=(-1, 0, 0))
    p = torch.tensor([[0.0, 0.7, 0.3, 0.0], [1, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = {1: 0, 2: 0}
    for _ in range(2000):
        path, _ = sample_tree_walk(view, p, lambda: float(torch.rand((), generator=gen)),
                                   lambda q: int(torch.multinomial(q, 1, generator=gen)))
        counts[view.tokens[path[0]]] += 1
    assert abs(counts[1] / 2000 - 0.7) < 0.04


# -- the command line and the bench ------------------------------------------------------------------------------
def test_generate_tree_from_the_command_line(tiny_model_dir, capsys):
    import json

    from kangaroo_apps.cli import main

    base = ["generate", "tell me a story", "--model", str(tiny_model_dir), "--max-new-tokens", "12", "--json",
            "--exit-layer", "1"]
    assert main(base + ["--tree", "dynamic", "--tree-budget", "4", "--tree-topk", "2", "--compare"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["identical_to_vanilla"] is True
    assert main(base + ["--tree", "chain", "--temperature", "0.8", "--seed", "3"]) == 0
    capsys.readouterr()
    assert main(base + ["--tree-budget", "4"]) == 2
    assert "need --tree" in capsys.readouterr().err
    assert main(base + ["--tree", "dynamic", "--tree-budget", "lots"]) == 2
    assert main(base + ["--tree", "nope"]) == 1
    assert "nope" in capsys.readouterr().err


def bench_identical(model_dir, questions, out, labels, *flags) -> dict:
    """Run ``kangaroo bench`` (8 new tokens) and assert the ``labels`` ran without error, identical to the baseline."""
    import json

    from kangaroo_apps.cli import main

    assert main(["bench", "--questions", str(questions), "--model", str(model_dir), "--exit-layer", "1",
                 "--max-new-tokens", "8", "--no-progress", "--no-warmup", "--out", str(out), *flags]) == 0
    summary = json.loads((out / "results.json").read_text())
    for label in labels:
        entry = summary["methods"][label]
        assert entry["error"] is None and entry["overall"]["identical_to_vanilla"] is True, label
    return summary


def test_bench_runs_tree_methods_next_to_the_chain(tiny_model_dir, tmp_path):
    import json

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [t]})
                                   for i, t in enumerate(["tell me a story", "why is the sky blue"])) + "\n")
    bench_identical(tiny_model_dir, questions, tmp_path / "out",
                    ("kangaroo_tree", "kangaroo_tree[budget=2]", "kangaroo_tree[budget=5]"),
                    "--methods", "vanilla,kangaroo,kangaroo_tree", "--tree-budgets", "2,5", "--tree-topk", "2",
                    "--baseline", "vanilla")
    summary = bench_identical(tiny_model_dir, questions, tmp_path / "fan", ("kangaroo_tree",),
                              "--methods", "vanilla,kangaroo_tree", "--tree", "fan", "--tree-topk", "3",
                              "--baseline", "vanilla")
    assert "--tree fan" in summary["run"]["command"]


# -- the onnx backend: the same graphs verify chains and trees (masks and positions are inputs) ------------------
HAS_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
needs_ort = pytest.mark.skipif(not HAS_ORT, reason="onnxruntime/onnx not installed (pip install '.[onnx]')")
ONNX_MODELS: dict = {}


def onnx_target(family: str, seed: int, exit_layer: int, root):
    """(float32 model, onnx backend) exported once per (family, seed, exit layer) for the module."""
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_apps.testing import TinyTokenizer, tiny_model

    key = (family, seed, exit_layer)
    if key not in ONNX_MODELS:
        model = tiny_model(family, seed, vocab=32, hidden=16, layers=3, heads=4, kv_heads=2, dtype=torch.float32,
                           init_std=0.2)
        directory = root / "-".join(map(str, key))
        export_onnx(model, directory, exit_layer=exit_layer, quiet=True)
        ONNX_MODELS[key] = (model, directory)
    model, directory = ONNX_MODELS[key]
    backend = OnnxBackend(model, TinyTokenizer(32, model.generation_config.eos_token_id), exit_layer,
                          bundle=directory, threads=1, quiet=True)
    return model, backend


@pytest.fixture(scope="module")
def onnx_root(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-tree-bundles")


def assert_onnx_caches_hold(engine, sequence, cached):
    """The onnx backend's KV buffers hold exactly the first ``cached`` tokens, as the eager target computes them."""
    backend = engine.backend
    assert backend.cache_lengths() == (cached, cached)
    fresh = tiny_backend(backend.model, exit_layer=backend.exit_layer)
    with torch.inference_mode():
        fresh.deep(fresh.shallow(list(sequence[:cached]), 0), 0)
    runners = [(backend.shallow_runner, range(backend.exit_layer)),
               (backend.deep_runner, range(backend.exit_layer, backend.num_layers))]
    for runner, layers in runners:
        for j, layer in enumerate(layers):
            for got, want in zip(runner.cache[2 * j: 2 * j + 2], fresh.cache.layer(layer)):
                assert torch.allclose(got[0, :cached], want[0].transpose(0, 1), atol=1e-4), f"layer {layer} differs"


@needs_ort
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(["llama", "gemma3", "qwen2"]), seed=st.integers(0, 1), topk=st.integers(1, 3),
       depth=st.integers(1, 4), budget=st.integers(1, 8), swaps=st.sets(st.integers(8, 30), max_size=5),
       max_new_tokens=st.integers(1, 20), eos_index=st.one_of(st.none(), st.integers(0, 15)))
def test_onnx_tree_rounds_are_identical_to_transformers(onnx_root, family, seed, topk, depth, budget, swaps,
                                                        max_new_tokens, eos_index):
    model, backend = onnx_target(family, seed, 1, onnx_root)
    prompt = [(seed * 7 + i * 5) % 32 for i in range(8)]
    set_eos(model, None)
    reference = hf_greedy(model, prompt, max_new_tokens)
    if eos_index is not None and eos_index < len(reference):
        set_eos(model, reference[eos_index])
        reference = hf_greedy(model, prompt, max_new_tokens)
        backend = onnx_target(family, seed, 1, onnx_root)[1]  # reads the EOS when built
    drafter = OracleTreeDrafter(prompt + reference, 32, swap_at=swaps)
    engine = make_engine(backend, drafter, DynamicTree(budget=budget, topk=topk, depth=depth, min_prob=0.0),
                         max_new_tokens=max_new_tokens)
    loop, output = engine.decode(list(prompt), max_new_tokens), []
    while True:
        try:
            output.extend(next(loop))
        except StopIteration as done:
            result = done.value
            break
        if output[-1] not in backend.eos_token_ids and len(output) < max_new_tokens:
            assert_onnx_caches_hold(engine, prompt + output, len(prompt) + len(output) - 1)
    set_eos(model, None)
    assert result.token_ids == reference
    assert all(r.drafted <= budget and r.accepted <= min(depth, r.drafted) for r in result.rounds)


@needs_ort
def test_onnx_tree_sampling_follows_the_target_distribution(tmp_path, one_torch_thread):
    """Sampled tree rounds on onnxruntime: the first three tokens pass chi-square against the exact target
    distribution, and the wrong rule is caught on the same backend."""
    from kangaroo_backends.onnx_backend import OnnxBackend
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_apps.testing import TinyTokenizer
    from test_sampling_distribution import SAMPLING, VOCAB, chi_square, exact_distribution

    model = tiny_llama(2, vocab=VOCAB, hidden=16, layers=3, heads=4, kv_heads=2, dtype=torch.float32)
    export_onnx(model, tmp_path / "bundle", exit_layer=1, quiet=True)

    def backend():
        return OnnxBackend(model, TinyTokenizer(VOCAB, model.generation_config.eos_token_id), 1,
                           bundle=tmp_path / "bundle", threads=1, quiet=True)

    target = exact_distribution(model, SAMPLING)
    samples, accepted = sampled_outcomes(backend(), SpeculativeVerifier)
    assert accepted > 50
    statistic, critical = chi_square(samples, target)
    assert statistic < critical, (statistic, critical)
    wrong, _ = sampled_outcomes(backend(), NoRenormalisation, seed0=5000)
    assert chi_square(wrong, target)[0] > critical


@needs_ort
def test_onnx_trees_accept_siblings(onnx_root, one_torch_thread):
    model, backend = onnx_target("llama", 0, 1, onnx_root)
    set_eos(model, None)
    prompt = list(range(3, 11))
    reference = hf_greedy(model, prompt, 30)
    swaps = set(range(len(prompt), len(prompt) + 30, 3))
    engine = make_engine(backend, OracleTreeDrafter(prompt + reference, 32, swaps),
                         DynamicTree(budget=10, topk=2, depth=6, min_prob=0.0))
    result = engine.generate_ids(prompt, 30)
    assert result.token_ids == reference
    assert max(r.accepted for r in result.rounds) >= 3  # through second-ranked children at the swapped positions


@needs_ort
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("adapter_type", ["attention", "deep-context"])
def test_the_kangaroo_drafter_drafts_the_same_trees_on_onnx_as_on_torch(onnx_root, tmp_path, family, adapter_type,
                                                                        one_torch_thread):
    """Both runtimes: identical output, the same rounds (the adapter graph takes the tree mask too: nodes below the
    root are drafted by ``advance_tree``), and the adapter graph's KV cache equal to the eager adapter's."""
    model, backend = onnx_target(family, 5, 2, onnx_root)
    set_eos(model, None)
    save_adapter(model, adapter_type, tmp_path)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    reference = hf_greedy(model, prompt, 24)
    results, runners = [], []
    for target in (backend, tiny_backend(model, exit_layer=2)):
        drafter = KangarooDrafter(str(tmp_path))
        engine = make_engine(target, drafter, DynamicTree(budget=6, topk=3, depth=4, min_prob=0.0),
                             max_new_tokens=24)
        results.append(engine.generate_ids(prompt, 24))
        runners.append(drafter.runner)
    on_onnx, on_torch = results
    assert on_onnx.token_ids == on_torch.token_ids == reference
    assert [(r.drafted, r.accepted) for r in on_onnx.rounds] == [(r.drafted, r.accepted) for r in on_torch.rounds]
    assert max(r.accepted for r in on_onnx.rounds) >= 2  # paths through advance_tree were accepted
    graph, eager = runners
    getattr(graph, "catch_up", lambda: None)()  # the deep-context graph rewrites verified slots on its next run
    assert graph.length == eager.length == graph.graph.length
    for got, want in zip(graph.graph.cache, eager.cache.layer(0)):  # [1, slots, kvh, hd] vs [1, kvh, slots, hd]
        assert torch.allclose(got[0, :graph.length], want[0].transpose(0, 1), atol=1e-4)
    if adapter_type == "deep-context":
        assert torch.allclose(graph.context.hidden[:graph.length], eager.context.hidden[:eager.length], atol=1e-4)


@needs_ort
def test_onnx_trees_from_the_command_line_and_the_bench(tiny_model_dir, tmp_path, capsys):
    import json

    from kangaroo_apps.cli import main

    base = ["generate", "tell me a story", "--model", str(tiny_model_dir), "--max-new-tokens", "12", "--json",
            "--exit-layer", "1", "--backend", "onnx"]
    assert main(base + ["--tree", "dynamic", "--tree-budget", "4", "--tree-topk", "2", "--compare"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["identical_to_vanilla"] is True
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["tell me a story"]}) + "\n")
    bench_identical(tiny_model_dir, questions, tmp_path / "out",
                    ("kangaroo_onnx_tree", "kangaroo_onnx_tree[budget=3]", "kangaroo_tree[budget=3]"),
                    "--methods", "vanilla_onnx,kangaroo_onnx,kangaroo_onnx_tree", "--tree-budgets", "3",
                    "--baseline", "vanilla_onnx")
