"""dsrl.config keeps static name lists (it may not import torch); they must match the registries."""

from dsrl import algorithms, config


def test_estimator_names_match_the_registry():
    assert sorted(config.ADV_ESTIMATORS) == algorithms.estimator_names()


def test_policy_loss_names_match_the_registry():
    assert sorted(config.POLICY_LOSS_MODES) == algorithms.policy_loss_names()


def test_loss_agg_modes_match():
    assert sorted(config.LOSS_AGG_MODES) == sorted(algorithms.LOSS_AGG_MODES)


def test_kl_kinds_match():
    assert sorted(config.KL_KINDS) == sorted(algorithms.KL_KINDS)


def test_policy_loss_params_match_the_registry_and_default_to_the_schema():
    for mode in config.POLICY_LOSS_MODES:
        declared = algorithms.policy_loss_params(mode)
        assert tuple(declared) == config.POLICY_LOSS_PARAMS.get(mode, ()), mode
        keys = {name: config.loading.policy_loss_param_key(name) for name in declared}
        assert {name: schema_default(key) for name, key in keys.items()} == declared, mode


def schema_default(key: str):
    """A key's default; a section's (bypass_mode's rollout_correction) as the dict of its keys' defaults."""
    inner = {k[len(key) + 1 :]: entry.default for k, entry in config.SCHEMA.items() if k.startswith(f"{key}.")}
    return inner or config.SCHEMA[key].default


def test_length_weighted_estimators_match_the_declared_options():
    declared = [n for n in algorithms.estimator_names() if "length_weighted_baseline" in algorithms.estimator_options(n)]
    assert sorted(config.LENGTH_WEIGHTED_ESTIMATORS) == declared


def test_pf_ppo_methods_match():
    assert config.PF_PPO_METHODS == algorithms.PF_PPO_METHODS
