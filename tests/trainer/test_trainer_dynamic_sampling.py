"""DAPO's dynamic sampling (algorithm.filter_groups) in a real 2-step GRPO run on the tiny model (HF rollout).

The reward gives ``acc`` = 1 to every response of a prompt whose answer is even (such groups are always dropped,
``all_correct``) and the parity of the response's digit count otherwise, so a step needs more than one round of
prompts to find ``data.train_batch_size`` groups whose acc varies. Run again with ``data.gen_batch_size`` twice the
batch: the rounds, and the sampler's batches, are then 16 prompts.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.trainer import FILTERING, PARITY_REWARD, run_config

pytestmark = pytest.mark.e2e


# null = train_batch_size (8), also the default run's dynamic sampling resume test; verl's DAPO: a multiple
@pytest.mark.parametrize("gen_batch_size", [pytest.param(None, marks=pytest.mark.slow), 16])
def test_grpo_with_dynamic_sampling_trains_two_steps(
    gen_batch_size, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    trainer, logged, (before, after), _ = run_config(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "run",
        f"custom_reward_function.path={reward}",
        *FILTERING,
        f"data.gen_batch_size={'null' if gen_batch_size is None else gen_batch_size}",
    )
    steps = [metrics for step, metrics in logged if "train/num_gen_batches" in metrics]
    assert len(steps) == 2
    batch = trainer.cfg.data.train_batch_size
    per_round = gen_batch_size or batch
    assert trainer.sampler.batch_size == per_round
    for metrics in steps:
        assert all(math.isfinite(v) for v in metrics.values())
        rounds = metrics["train/num_gen_batches"]
        assert metrics["dynamic_sampling/groups_kept"] == batch
        assert metrics["dynamic_sampling/prompts_consumed"] == rounds * per_round
        assert metrics["dynamic_sampling/groups_generated"] == rounds * per_round
        dropped = sum(metrics[f"dynamic_sampling/dropped_{r}"] for r in ("all_correct", "all_wrong", "all_equal"))
        assert dropped + metrics["dynamic_sampling/groups_informative"] == rounds * per_round
        assert 0 < metrics["timing_s/gen_round_max"] <= metrics["timing_s/gen"]
        assert metrics["dynamic_sampling/dropped_all_correct"] >= 1  # the even answers' groups
        # the kept batch: the step trained on exactly train_batch_size prompts' groups
        assert metrics["critic/score/mean"] >= 0 and metrics["actor/grad_norm"] > 0
    # Every round drew a batch from the sampler: its position counts them all (a resume continues after them).
    total_rounds = sum(int(m["train/num_gen_batches"]) for m in steps)
    if gen_batch_size is None:
        assert total_rounds > 2  # some step took more than one round
    per_epoch = trainer.sampler.batches_per_epoch
    assert trainer.sampler.epoch * per_epoch + trainer.sampler.index == total_rounds
    assert sum(not (before[k] == after[k]).all() for k in before) == len(before)
