import pytest

from kangaroo_apps.testing import check_drafter
from kangaroo_prompt_lookup import PromptLookupDrafter, lookup


@pytest.mark.parametrize("tokens, expected", [
    ([1, 2, 3, 9, 1, 2], 3),             # the 2-gram (1, 2) occurred before, followed by 3
    ([1, 2, 3, 1, 2, 4, 1, 2], 4),       # the most recent match wins
    ([5, 6, 7, 8], None),                # no earlier occurrence of any suffix
    ([7, 7, 7], 7),                      # overlapping matches are fine
    ([4, 1, 2, 3, 8, 2, 3], 8),          # (2, 3) matches before (1, 2, 3) would
    ([9], None),
])
def test_lookup(tokens, expected):
    assert lookup(tokens) == expected


def test_longest_ngram_first():
    # suffix 3-gram (1, 2, 3) was followed by 4; the shorter suffix (3,) was more recently followed by 5
    assert lookup([1, 2, 3, 4, 3, 5, 1, 2, 3]) == 4
    assert lookup([1, 2, 3, 4, 3, 5, 1, 2, 3], max_ngram=1) == 5


def test_conforms_and_gets_drafts_accepted_on_repetitive_output():
    results = check_drafter(PromptLookupDrafter)  # contract + greedy identity with transformers.generate
    # the tiny model's greedy output repeats itself: lookup drafts are accepted (CR > 1 token per target pass)
    assert max(r.mean_accepted_tokens for r in results) > 1.5
    assert sum(r.mean_accepted_tokens for r in results) / len(results) > 1.2
