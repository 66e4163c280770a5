import math

import pytest
import torch

from kangaroo_core.config import ConfigError
from kangaroo_core.engine import Engine
from kangaroo_apps.testing import check_policy, make_draft_step
from kangaroo_entropy_policy import EntropyPolicy, entropy


def test_entropy_of_point_mass_and_uniform():
    assert entropy(torch.tensor([1.0, 0.0, 0.0])) == 0.0
    assert math.isclose(entropy(torch.ones(8) / 8), math.log(8))


def test_stops_on_a_flat_draft_and_continues_on_a_sharp_one():
    policy = EntropyPolicy(max_entropy=1.0)
    assert policy.keep_drafting(make_draft_step([0.97, 0.01, 0.01, 0.01])) is True
    assert policy.keep_drafting(make_draft_step([0.25, 0.25, 0.25, 0.25])) is False


def test_conforms_to_the_policy_contract_and_is_lossless():
    # "entropy" is resolved by name through the installed entry point (EntropyPolicy itself works too)
    check_policy("entropy", options={"max_entropy": 3.5})


def test_a_misspelled_option_is_refused_in_one_line_naming_the_valid_ones():
    # the policy is resolved (and refused) before any model is loaded
    with pytest.raises(ConfigError, match=r"unknown option\(s\) max_entropie; valid options: max_entropy"):
        Engine.build(policy="entropy", policy_options={"max_entropie": 1.0})
