"""Partial rollout inside colocation (``trainer.v1.trainer_mode: colocate_async``, ``dsrl.trainer.partial_rollout``)
on the tiny model: the pool carries unfinished responses into the next step, their tokens tagged with the version
that sampled them, within the staleness bound."""

from __future__ import annotations

import pytest

from tests.helpers.trainer import run_config

pytestmark = pytest.mark.e2e

ASYNC = [
    "trainer.v1.trainer_mode=colocate_async",
    "trainer.v1.colocate_async.chunk_tokens=4",
    "trainer.v1.sampler.max_off_policy_threshold=2",
    "trainer.total_training_steps=4",
]


def test_a_colocate_async_run_carries_responses_across_steps_within_the_bound(
    world_of_one, tiny_model_dir, arithmetic_data, ds_test_config, tmp_path
):
    trainer, logged, (before, after), _ = run_config(
        "grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path, *ASYNC
    )
    for step, metrics in logged:
        print(step, {k: v for k, v in metrics.items() if "off_policy" in k})
    assert 0
