"""The hybrid drafter (prompt lookup + adapter): lossless, and its acceptance bookkeeping is exact."""

from __future__ import annotations

import pytest
import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_apps.testing import check_drafter, hf_greedy, tiny_backend, tiny_llama
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.hybrid import HybridDrafter, lookup
from kangaroo_policies.threshold import ThresholdPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lookup_finds_the_longest_latest_suffix():
    assert lookup([1, 2, 3, 9, 1, 2], 4, 2) == (3, 2)
    assert lookup([5, 1, 2, 3, 7, 1, 2, 3], 4, 2) == (7, 3)
    assert lookup([1, 2, 3], 4, 2) is None


def test_hybrid_conforms_and_is_lossless():
    results = check_drafter(HybridDrafter, options={"adapter": "untrained"}, policy="threshold")
    assert any(r.mean_accepted_tokens > 1.0 for r in results)  # lookups get accepted on the repetitive prompt


def test_bookkeeping_counts_exactly_the_verified_lookup_drafts():
    drafter = HybridDrafter(min_ngram=2, max_ngram=3)
    drafter.pending = {10: (4, 2), 11: (5, 2), 12: (6, 3), 8: (1, 2)}
    drafter.observe_deep(9, torch.zeros(2, 4))  # x_n at 9 and one accepted draft at 10; the draft at 11 was rejected
    assert drafter.counts == {2: [0, 0], 3: [0, 0]}  # scored against the committed tokens at the next advance
    committed = [0] * 10 + [4, 7]  # the target's tokens: 4 at 10 (the accepted draft), its own 7 at 11
    drafter._settle(committed)
    assert drafter.counts == {2: [1, 2], 3: [0, 0]} and drafter.pending == {}
    assert drafter.estimate(2) == pytest.approx((1 + 1.0) / (2 + 2))
    # within a round (no verification since the last settle) the round's own drafts stay pending
    drafter.pending = {12: (3, 2)}
    drafter._settle(committed)
    assert drafter.pending == {12: (3, 2)} and drafter.counts == {2: [1, 2], 3: [0, 0]}
    # a tree round: position 10 was verified (accepted path of length 1) but through another child than the lookup
    drafter.pending = {10: (6, 3)}
    drafter.observe_deep(9, torch.zeros(2, 4))
    drafter._settle(committed)
    assert drafter.counts == {2: [1, 2], 3: [0, 1]}


def test_the_index_looks_up_a_tree_nodes_path_on_top_of_the_committed_sequence():
    from kangaroo_plugins.kangaroo.hybrid import NgramIndex

    index = NgramIndex(2, 4)
    sequence = [1, 2, 3, 9, 4, 5, 6, 1]
    index.sync(sequence)
    for path in ([2], [2, 3], [7, 4], [4, 5], [8], []):
        assert index.lookup(path) == lookup(sequence + path, 4, 2), path


def test_hybrid_learns_from_the_engine_and_matches_the_target_greedy_and_sampled():
    model = tiny_llama(2, init_std=0.02, random_norms=False)  # repetitive greedy output: lookups are right
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    drafter = HybridDrafter(adapter="untrained")
    engine = Engine(tiny_backend(model), drafter, ThresholdPolicy(eta=0.3), GreedyVerifier(),
                    DecodeConfig(exit_layer=1, gamma=4, max_new_tokens=24))
    result = engine.generate_ids(prompt)
    assert result.token_ids == hf_greedy(model, prompt, 24)
    accepted, verified = map(sum, zip(*drafter.counts.values()))
    assert drafter.sources["lookup"] > 0 and verified > 0
    assert accepted <= sum(r.accepted for r in result.rounds)
    # a lookup draft's distribution (what sampled drafting draws from): mass c on the lookup token, sums to one
    drafter.reset()
    backend = engine.backend
    backend.reset()
    tokens = list(prompt)  # ends with 5, 9: the lookup proposes 14
    logits = drafter.advance(tokens, backend.shallow(tokens, 0))
    token, n = lookup(tokens, drafter.max_ngram, drafter.min_ngram)
    probs = torch.softmax(logits.double(), -1)
    assert float(probs.sum()) == pytest.approx(1.0) and int(probs.argmax()) == token
    assert float(probs[token]) >= drafter.estimate(n) - 1e-9


def test_the_incremental_ngram_index_answers_like_the_scan_through_growth_and_rollback():
    import random

    from kangaroo_plugins.kangaroo.hybrid import NgramIndex

    rng = random.Random(0)
    index = NgramIndex(2, 4)
    sequence: list[int] = []
    for step in range(400):
        if sequence and rng.random() < 0.3:  # a rollback after rejected drafts
            del sequence[rng.randrange(len(sequence)):]
        sequence += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        index.sync(sequence)
        assert index.lookup() == lookup(sequence, 4, 2), step


@pytest.mark.parametrize("adapter_type", ["attention", "deep-context"])
def test_the_hybrid_drafts_trees_with_lookup_branches_losslessly(adapter_type, tmp_path):
    """Token trees with the hybrid: every node may get a lookup child next to the adapter's top-k; the output is the
    target's greedy output, lookups are proposed inside trees, and the root's lookups are scored."""
    from test_trees import make_engine, run_checked, save_adapter

    from kangaroo_policies.tree_shapes import DynamicTree

    model = tiny_llama(7, vocab=48, hidden=32, layers=4, init_std=0.02)
    save_adapter(model, adapter_type, tmp_path)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 3, 7, 11, 5, 9, 14, 3]
    reference = hf_greedy(model, prompt, 30)
    drafter = HybridDrafter(adapter=str(tmp_path))
    engine = make_engine(tiny_backend(model, exit_layer=2), drafter, DynamicTree(budget=6, topk=2, depth=4, min_prob=0.0),
                         max_new_tokens=30)
    assert drafter.drafts_trees
    result = run_checked(engine, prompt, 30)
    assert result.token_ids == reference
    assert drafter.sources["lookup"] > 0 and sum(v for _, v in drafter.counts.values()) > 0


def test_the_hybrid_tree_child_is_the_lookup_continuation_of_the_nodes_path():
    model = tiny_llama(7, vocab=48, hidden=32, layers=4, init_std=0.02)
    backend = tiny_backend(model, exit_layer=2)
    drafter = HybridDrafter(adapter="untrained", prior=0.9)
    drafter.bind(backend)
    tokens = [5, 9, 14, 21, 30, 5, 9]
    drafter.advance(tokens, backend.shallow(tokens, 0))  # the root: syncs the index
    from kangaroo_core.tree import TreeAttention

    paths = [[14], [2], [14, 21]]  # nodes at depths 1, 1, 2 below x_n = 9
    attention = TreeAttention(committed=len(tokens), visible=[(7,), (8,), (7, 9)], positions=[7, 7, 8])
    logits = drafter.advance_tree(tokens, paths, backend.shallow([14, 2, 21], 7, tree=attention), 7, attention)
    assert logits.shape == (3, 48)
    assert int(logits[0].argmax()) == 21 and int(logits[2].argmax()) == 30  # copied: 9 14 -> 21, 14 21 -> 30
    assert lookup(tokens + paths[1], 4, 2) is None


@pytest.mark.parametrize("c", [0.05, 0.5, 0.93, 1.0])
@pytest.mark.parametrize("peak", [0.0, 8.0, 40.0])
def test_the_mixed_row_is_mass_c_on_the_lookup_token_and_the_adapters_ratios_elsewhere(c, peak):
    """The mixture's softmax, exactly as defined: c on the lookup token, the adapter's distribution renormalised to
    1 - c elsewhere — also when the adapter is all but certain of the token (peak 40: float32 cannot resolve the
    rest, the float64 branch) and for c = 1 (a point mass)."""
    generator = torch.Generator().manual_seed(int(peak) + int(100 * c))
    logits = torch.randn(500, generator=generator) * 3
    token = 17
    logits[token] += peak
    mixed = HybridDrafter._mix(logits, torch.logsumexp(logits, dim=-1), token, c)
    probs = torch.softmax(mixed.double(), dim=-1)
    others = torch.softmax(logits.double(), dim=-1)
    others[token] = 0.0
    expected = others / others.sum() * (1 - c)
    expected[token] = c
    assert torch.allclose(probs, expected, rtol=1e-4, atol=1e-9)
    assert int(mixed.argmax()) == token or c < 0.5
