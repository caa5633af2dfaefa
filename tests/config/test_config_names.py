"""dsrl.config keeps static name lists (``dsrl.config.names``: it may not import torch); they must match the
registries."""

import dataclasses

import pytest
import torch

from dsrl import algorithms, config
from dsrl.config.schema import BypassCorrectionConfig


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
    declared = [
        n for n in algorithms.estimator_names() if "length_weighted_baseline" in algorithms.estimator_options(n)
    ]
    assert sorted(config.LENGTH_WEIGHTED_ESTIMATORS) == declared


def test_pf_ppo_methods_match():
    assert config.PF_PPO_METHODS == algorithms.PF_PPO_METHODS


def test_rollout_correction_names_match_the_algorithms():
    assert config.ROLLOUT_IS_LEVELS == algorithms.ROLLOUT_IS_LEVELS
    assert config.ROLLOUT_RS_OPTIONS == algorithms.ROLLOUT_RS_OPTIONS
    assert config.BYPASS_LOSS_TYPES == algorithms.BYPASS_LOSS_TYPES
    defaults = algorithms.policy_loss_params("bypass_mode")["rollout_correction"]
    assert defaults == {f.name: f.default for f in dataclasses.fields(BypassCorrectionConfig)}


def advantages(name: str, group_ids: list[int], **left_out: None) -> torch.Tensor:
    """Estimator ``name``'s advantages for four responses scoring 1, 0, 1 and 0.5, given every optional input an
    estimator reads but those ``left_out``."""
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    given = dict(
        token_level_rewards=torch.stack([torch.zeros(4), scores], dim=1),  # the score at the last token
        response_mask=torch.ones(4, 2),
        group_ids=torch.tensor(group_ids),
        values=torch.zeros(4, 2),
        old_log_probs=torch.full((4, 2), -1.0),
        sum_pi_squared=torch.full((4, 2), 0.5),
        reward_baselines=torch.zeros(4),
        reward_components={"acc": scores},
    )
    return algorithms.compute_advantages(name, algorithms.EstimatorInputs(**{**given, **left_out}))[0]


def test_group_estimators_are_the_ones_whose_advantages_depend_on_the_groups():
    regrouped = [
        name
        for name in config.ADV_ESTIMATORS
        if not torch.allclose(advantages(name, [0, 0, 1, 1]), advantages(name, [0, 1, 0, 1]))
    ]
    assert sorted(regrouped) == sorted(config.GROUP_ESTIMATORS)


@pytest.mark.parametrize(
    "estimators, tensor", [("CRITIC_ESTIMATORS", "values"), ("SUM_PI_SQUARED_ESTIMATORS", "sum_pi_squared")]
)
def test_the_estimators_said_to_need_a_tensor_are_the_ones_that_refuse_to_run_without_it(estimators, tensor):
    def needs(name: str) -> bool:
        try:
            advantages(name, [0, 0, 1, 1], **{tensor: None})
        except ValueError as err:
            return f"EstimatorInputs.{tensor}" in str(err)
        return False

    assert sorted(filter(needs, config.ADV_ESTIMATORS)) == sorted(getattr(config.names, estimators))
