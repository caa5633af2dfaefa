"""scripts/compare_dynamic_sampling.py's counts, on two steps of each arm with a reward that makes some groups
all-equal: the zero-advantage share it reads from the estimator's batch, the rounds, the tokens generated."""

from __future__ import annotations

import runpy

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

# Every response to a prompt whose answer is even scores 1 (its group is all-equal: zero advantage); the others
# score their digit count, which varies within a group even for the untrained model.
EVEN_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if int(ground_truth) % 2 == 0 else sum(ch.isdigit() for ch in solution_str) / 4.0
"""


def test_the_comparison_counts_zero_advantage_groups_rounds_and_tokens(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    script = runpy.run_path(str(REPO / "scripts" / "compare_dynamic_sampling.py"))
    reward = tmp_path / "even_reward.py"
    reward.write_text(EVEN_REWARD)
    common = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        f"data.val_files={arithmetic_data / 'test.parquet'}",
        f"custom_reward_function.path={reward}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.logger=[console]",
        "trainer.log_val_generations=0",
        "trainer.log_samples_freq=-1",
    ]
    plain = script["run_arm"](common, tmp_path / "plain")
    filtered = script["run_arm"](
        [*common, *script["FILTERING"], "algorithm.filter_groups.max_num_gen_batches=0"], tmp_path / "filtered"
    )
    assert plain["steps"] == filtered["steps"] == 2
    assert plain["rounds"] == 1 and plain["zero_share"] > 0  # the even answers' groups are trained on
    assert filtered["zero_share"] == 0 and filtered["rounds"] > 1  # dropped, and more prompts drawn to replace them
    assert filtered["gen_tokens"] > plain["gen_tokens"]  # every round's responses count
    assert [step for step, _ in plain["validations"]] == [0, 2] == [step for step, _ in filtered["validations"]]


def test_zero_advantage_share_counts_groups_whose_scores_are_all_equal():
    import torch

    share = runpy.run_path(str(REPO / "scripts" / "compare_dynamic_sampling.py"))["zero_advantage_share"]
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])  # groups 0 and 2 all equal
    assert share(group_ids, scores) == (2, 4)  # group 3, of one response, has its score as advantage
