import attrs
import pytest

from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_policies.threshold import ThresholdPolicy


def test_defaults_are_the_papers():
    config = DecodeConfig()
    assert (config.eta, config.gamma, config.exit_layer, config.max_new_tokens) == (0.6, 6, 2, 128)


@pytest.mark.parametrize(
    "field, value",
    [("eta", -0.1), ("eta", 1.5), ("eta", "0.5"), ("gamma", 0), ("gamma", 2.5), ("exit_layer", 0),
     ("max_new_tokens", 0), ("max_new_tokens", True)],
)
def test_invalid_values_fail_at_construction_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^{field} must be"):
        DecodeConfig(**{field: value})


def test_boundaries_are_valid():
    DecodeConfig(eta=0.0, gamma=1, exit_layer=1, max_new_tokens=1)
    DecodeConfig(eta=1.0)


def test_config_is_frozen_and_evolvable():
    config = DecodeConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.eta = 0.1
    assert config.replace(gamma=3).gamma == 3
    with pytest.raises(ConfigError, match="gamma"):
        config.replace(gamma=-1)


def test_threshold_policy_validates_eta():
    with pytest.raises(ConfigError, match="^eta must be in"):
        ThresholdPolicy(eta=1.2)


def test_the_test_suite_never_writes_into_the_users_cache():
    from conftest import USER_CACHE

    from kangaroo_backends.loading import cache_dir

    assert cache_dir().resolve() != USER_CACHE.resolve()
