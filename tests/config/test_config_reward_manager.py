"""reward_model.*: the reward manager's name and DAPO's overlong punishment, and
actor_rollout_ref.actor.mask_truncated_completions (the CPU overlay's data.max_response_length is 16)."""

import pytest

from tests.conftest import stub_file_overrides
from tests.helpers.config import problems

BUFFER = "reward_model.reward_kwargs.overlong_buffer_cfg"
DAPO = ["reward_model.reward_manager=dapo", f"{BUFFER}.enable=true", f"{BUFFER}.len=4", f"{BUFFER}.penalty_factor=1.0"]


@pytest.fixture
def files(tmp_path):
    return stub_file_overrides(tmp_path)


def test_dapo_overlong_punishment_loads(files):
    assert problems(files + DAPO + [f"{BUFFER}.log=true"]) == []
    assert problems(files + DAPO + ["reward_model.reward_kwargs.max_resp_len=16", f"{BUFFER}.len=16"]) == []
    assert problems(files + ["reward_model.reward_manager=dapo"]) == []  # dapo without the punishment is naive
    assert problems(files + ["actor_rollout_ref.actor.mask_truncated_completions=true"]) == []


def test_unknown_reward_manager(files):
    [v] = problems(files + ["reward_model.reward_manager=prime"])
    assert v == "reward_model.reward_manager=prime: unknown reward manager; fix: use one of naive, dapo"


def test_the_punishment_needs_the_dapo_manager(files):
    [v] = problems(files + DAPO[1:])
    assert v.startswith(f"{BUFFER}.enable=true: only the dapo reward manager applies the overlong punishment")
    assert "fix: set reward_model.reward_manager=dapo" in v


@pytest.mark.parametrize(
    "setting, rule",
    [
        ("len=0", "the buffer must hold > 0 and <= max_resp_len (16) tokens"),
        ("len=17", "the buffer must hold > 0 and <= max_resp_len (16) tokens"),
        ("penalty_factor=-1.0", "must be >= 0"),
    ],
)
def test_buffer_rules(files, setting, rule):
    [v] = problems(files + DAPO + [f"{BUFFER}.{setting}"])
    assert v.startswith(f"{BUFFER}.{setting}: {rule}")


def test_max_resp_len_bounds_the_buffer(files):
    [v] = problems(files + DAPO + ["reward_model.reward_kwargs.max_resp_len=3"])
    assert v.startswith(f"{BUFFER}.len=4: the buffer must hold > 0 and <= max_resp_len (3) tokens")
    [v] = problems(files + DAPO + ["reward_model.reward_kwargs.max_resp_len=0"])
    assert v.startswith("reward_model.reward_kwargs.max_resp_len=0: must be >= 1 tokens")


@pytest.mark.parametrize("setting", ["len=4", "penalty_factor=1.0", "log=true"])
def test_buffer_settings_without_the_punishment_are_refused(files, setting):
    [v] = problems(files + ["reward_model.reward_manager=dapo", f"{BUFFER}.{setting}"])
    assert v.startswith(f"{BUFFER}.{setting}: has no effect while {BUFFER}.enable is false")
    [v] = problems(files + ["reward_model.reward_kwargs.max_resp_len=16"])
    assert v.startswith("reward_model.reward_kwargs.max_resp_len=16: is read only by the overlong punishment")


def test_verl_new_reward_keys_point_to_reward_model(files):
    [v] = problems(files + ["reward.reward_manager.name=dapo"])
    assert v.endswith("fix: set reward_model.reward_manager")
    [v] = problems(files + ["reward.reward_kwargs.overlong_buffer_cfg.len=4"])
    assert v.endswith(f"fix: set {BUFFER}.len")
