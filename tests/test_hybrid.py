"""The hybrid drafter (prompt lookup + adapter): lossless, and its acceptance bookkeeping is exact."""

from __future__ import annotations

import pytest
import torch

from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.testing import check_drafter, hf_greedy, tiny_backend, tiny_llama
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
    assert drafter.counts == {2: [1, 2], 3: [0, 0]} and drafter.pending == {}
    assert drafter.estimate(2) == pytest.approx((1 + 1.0) / (2 + 2))


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
