"""What an estimator needs of a step is declared once, where it is registered (``register_estimator(needs=...)``),
and read alike by the config's rules, the memory plan and the trainer: the built-ins' restated torch-free in
``dsrl.config.names.ESTIMATOR_NEEDS`` (kept equal here), a user's read from the registry."""

from __future__ import annotations

import pytest
import torch

from dsrl import algorithms, config
from dsrl.algorithms import estimators
from dsrl.config.rules.need import critic_used
from dsrl.config.user_code import estimator_needs
from tests.conftest import recipe, stub_file_overrides


def test_the_config_restates_every_built_in_estimators_needs():
    registry = {name: algorithms.estimator_needs(name) for name in algorithms.estimator_names()}
    assert {name: frozenset(needs) for name, needs in config.ESTIMATOR_NEEDS.items()} == registry


def test_the_named_tuples_are_the_needs_read_back():
    assert config.names.CRITIC_ESTIMATORS == ("gae",)
    assert config.names.SUM_PI_SQUARED_ESTIMATORS == ("optimal_token_baseline", "tir_optimal_token_baseline")
    assert "remax" not in config.GROUP_ESTIMATORS and "grpo" in config.GROUP_ESTIMATORS


def test_the_estimators_said_to_need_a_greedy_baseline_refuse_to_run_without_one():
    rewards = torch.zeros(4, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    inputs = algorithms.EstimatorInputs(rewards, torch.ones(4, 2), torch.tensor([0, 0, 1, 1]))

    def refuses(name: str) -> bool:
        try:
            algorithms.compute_advantages(name, inputs)
        except ValueError as err:
            return "EstimatorInputs.reward_baselines" in str(err)
        return False

    needing = [name for name, needs in config.ESTIMATOR_NEEDS.items() if "greedy_baseline" in needs]
    assert needing == ["remax"] and list(filter(refuses, config.ADV_ESTIMATORS)) == needing


def test_an_unknown_need_is_refused_at_registration():
    with pytest.raises(ValueError, match=r"unknown needs \['a_teacher'\]; known: critic, groups, sum_pi_squared"):
        algorithms.register_estimator("test_needs_unknown", needs=("a_teacher",))
    assert "test_needs_unknown" not in algorithms.estimator_names()


@pytest.fixture
def user_estimator(tmp_path):
    """``user_estimator(name, needs)``: a module registering estimator ``name`` with ``needs``, for
    ``algorithm.import_modules``; the registrations are removed afterwards."""
    names = []

    def write(name: str, needs: tuple[str, ...]) -> str:
        module = tmp_path / f"{name}.py"
        module.write_text(
            "from dsrl.algorithms import register_estimator\n"
            f"@register_estimator({name!r}, needs={needs!r})\n"
            "def estimate(inputs, **_):\n"
            "    return inputs.token_level_rewards, inputs.token_level_rewards\n"
        )
        names.append(name)
        return str(module)

    yield write
    for name in names:
        for registry in (estimators._ESTIMATORS, estimators._OPTIONS, estimators._NEEDS):
            registry.pop(name, None)


def violations(files, overrides):
    try:
        config.load_and_validate(recipe("grpo"), files + overrides, 1)
    except config.ConfigError as err:
        return err.violations
    return []


def test_a_user_estimator_that_needs_a_critic_is_asked_for_one_and_gets_it(user_estimator, tmp_path):
    files = stub_file_overrides(tmp_path)
    module = user_estimator("test_needs_critic", ("critic",))
    chosen = [f"algorithm.import_modules=[{module}]", "algorithm.adv_estimator=test_needs_critic"]
    [line] = [v for v in violations(files, chosen) if v.startswith("critic.model.path=")]
    assert "test_needs_critic learns a value function and needs a critic model" in line
    critic = files[2].replace("actor_rollout_ref.model.path", "critic.model.path")
    cfg, _ = config.load_and_validate(recipe("grpo"), files + chosen + [critic], 1)
    assert critic_used(cfg)  # what the trainer asks before it builds a critic engine


def test_a_user_estimator_that_needs_groups_or_sum_pi_squared_gets_them(user_estimator, tmp_path):
    files = stub_file_overrides(tmp_path)
    grouped = user_estimator("test_needs_groups", ("groups",))
    chosen = [f"algorithm.import_modules=[{grouped}]", "algorithm.adv_estimator=test_needs_groups"]
    [line] = violations(files, chosen + ["actor_rollout_ref.rollout.n=1"])
    assert line.startswith("actor_rollout_ref.rollout.n=1: test_needs_groups compares the responses to the same prompt")
    weighted = user_estimator("test_needs_spi", ("groups", "sum_pi_squared"))
    chosen = [f"algorithm.import_modules=[{weighted}]", "algorithm.adv_estimator=test_needs_spi"]
    cfg, notes = config.load_and_validate(recipe("grpo"), files + chosen, 1)
    assert cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
    assert any("test_needs_spi needs sum_pi_squared" in note for note in notes)


def test_an_estimator_nothing_registered_needs_nothing():
    assert estimator_needs("no_such_estimator") == frozenset()
