"""``actor_rollout_ref.actor.router_replay.mode`` (verl's routing replay) and
``actor_rollout_ref.rollout.enable_rollout_routing_replay``: what validation refuses beside them, each with its key,
its rule and its fix, and what validates."""

from __future__ import annotations

import pytest

from dsrl import config as C
from tests.helpers.config import recipe

MODE = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
R3 = [f"{MODE}=R3", f"{RECORD}=true", "actor_rollout_ref.rollout.name=hf"]


def violations(overrides: list[str], world_size: int = 2) -> list[str]:
    try:
        C.load_and_validate(recipe("grpo"), overrides, world_size)
    except C.ConfigError as err:
        return err.violations
    return []


@pytest.mark.parametrize("overrides", [[], [f"{MODE}=R2"], R3])
def test_the_modes_validate(overrides):
    assert [v for v in violations(overrides) if "router_replay" in v or "routing_replay" in v] == []


@pytest.mark.parametrize(
    "overrides, key, rule, fix",
    [
        ([f"{MODE}=R1"], MODE, "unknown routing replay mode", "use one of disabled, R2, R3"),
        ([f"{MODE}=R3", "actor_rollout_ref.rollout.name=hf"], RECORD, "records routes for R3 alone", "set it to true"),
        ([f"{MODE}=R2", f"{RECORD}=true"], RECORD, "records routes for R3 alone", "set it to false"),
        ([f"{MODE}=R2", "algorithm.rollout_correction.bypass_mode=true",
          "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], MODE, "bypass mode does not run", "use R3"),
        ([f"{MODE}=R3", f"{RECORD}=true", "actor_rollout_ref.rollout.name=vllm"], MODE, "enable_return_routed_experts",
         "rollout.name=hf"),
        ([*R3, "actor_rollout_ref.rollout.multi_turn.enable=true"], MODE, "one generate's routes", "use R2"),
        ([f"{MODE}=R2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
          "actor_rollout_ref.model.use_remove_padding=true"], MODE, "see its shard",
         "ulysses_sequence_parallel_size=1"),
        ([f"{MODE}=R2", "actor_rollout_ref.model.shared_prompt_forward=true",
          "actor_rollout_ref.model.use_remove_padding=false"], MODE, "two forwards", "shared_prompt_forward=false"),
    ],
)  # fmt: skip
def test_what_routing_replay_cannot_run_beside_is_refused(overrides, key, rule, fix):
    found = [v for v in violations(overrides) if v.startswith(key + "=") and rule in v]
    assert len(found) == 1, violations(overrides)
    assert fix in found[0].split("; fix: ")[1]
