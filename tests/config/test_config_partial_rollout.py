"""``trainer.v1.*`` (verl V1's trainer modes): what validates, and what validation refuses beside partial rollout,
each with its key, its rule and its fix."""

from __future__ import annotations

import pytest

from dsrl import config as C
from tests.helpers.config import recipe

MODE = "trainer.v1.trainer_mode"
ASYNC = f"{MODE}=colocate_async"


def violations(overrides: list[str], name: str = "grpo", world_size: int = 2) -> list[str]:
    try:
        C.load_and_validate(recipe(name), overrides, world_size)
    except C.ConfigError as err:
        return err.violations
    return []


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("grpo", []),
        ("grpo", [ASYNC]),
        ("dapo", [ASYNC]),
        ("ppo", [ASYNC, "trainer.v1.sampler.max_off_policy_threshold=null"]),
        ("grpo", [ASYNC, "trainer.v1.sampler.max_off_policy_strategy=wait",
                  "trainer.v1.colocate_async.num_warmup_batches=0.5"]),
        ("grpo", [ASYNC, "actor_rollout_ref.rollout.name=vllm"]),
    ],
)  # fmt: skip
def test_the_modes_validate(name, overrides):
    assert [v for v in violations(overrides, name) if v.startswith("trainer.")] == []


@pytest.mark.parametrize(
    "overrides, key, rule, fix",
    [
        ([f"{MODE}=separate_async"], MODE, "needs rollout-only ranks", "use one of sync, colocate_async"),
        (["trainer.v1.colocate_async.num_warmup_batches=-1"], "trainer.v1.colocate_async.num_warmup_batches",
         "must be >= 0", "set it to 1"),
        (["trainer.v1.colocate_async.chunk_tokens=0"], "trainer.v1.colocate_async.chunk_tokens", "must be >= 1",
         "set it to null"),
        (["trainer.v1.sampler.max_off_policy_threshold=0"], "trainer.v1.sampler.max_off_policy_threshold",
         "at least one version", "set it to 8"),
        (["trainer.v1.sampler.max_off_policy_strategy=block"], "trainer.v1.sampler.max_off_policy_strategy",
         "unknown strategy", "use one of drop, wait"),
        ([ASYNC, "algorithm.adv_estimator=remax"], MODE, "greedy baselines", "another estimator"),
        ([ASYNC, "actor_rollout_ref.actor.router_replay.mode=R3",
          "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "actor_rollout_ref.rollout.name=hf"], MODE,
         "recorded routes (R3)", "router_replay.mode=R2"),
        ([ASYNC, "trainer.resume_allow_world_size_change=true"], MODE, "another world size",
         "resume_allow_world_size_change=false"),
        (["trainer.use_v1=true"], "trainer.use_v1", "dsrl reads trainer.v1.* always", "trainer.v1.trainer_mode"),
    ],
)  # fmt: skip
def test_what_partial_rollout_cannot_run_beside_is_refused(overrides, key, rule, fix):
    found = [v for v in violations(overrides) if v.startswith(key + "=") and rule in v]
    assert len(found) == 1, violations(overrides)
    assert fix in found[0].split("; fix: ")[1]
