"""Multi-turn rollouts with the calculator tool in real 2-step runs (HF rollout, ZeRO-3 + offload): the tiny
tool model calls the calculator in some of its responses, and every estimator family trains on responses whose
tool outputs sit in the context with response_mask 0.

The reward (``TURNS_REWARD``) is the calculator task's score plus what the rewards see of the conversation:
``extra_info["num_turns"]`` and ``["num_tool_calls"]`` come back as extras (``reward/turns/mean``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.trainer import changed_fraction

pytestmark = pytest.mark.e2e

TURNS_REWARD = """
from dsrl.rewards.calculator import compute_score as calculator_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": calculator_score(solution_str, ground_truth), "turns": extra_info["num_turns"],
            "calls": extra_info["num_tool_calls"]}
"""


def multi_turn_overrides(model, data, reward):
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"custom_reward_function.path={reward}",
        "data.max_prompt_length=40",
        "data.max_response_length=160",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=calculator",  # the shipped configs/tools/calculator.yaml
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    ]


def captured_batches(trainer):
    """Every batch the trainer generates from now on (training and validation)."""
    batches = []
    generate = trainer.generate

    def recording(prompts, sampling):
        batch = generate(prompts, sampling)
        batches.append(batch)
        return batch

    trainer.generate = recording
    return batches


@pytest.mark.parametrize("name", ["grpo", "tir_otb", pytest.param("ppo", marks=pytest.mark.slow)])
def test_each_estimator_family_trains_on_multi_turn_responses(
    name, tool_model_dir, calculator_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    from tests.helpers.trainer import trainer_for

    reward = tmp_path / "turns_reward.py"
    reward.write_text(TURNS_REWARD)
    overrides = multi_turn_overrides(tool_model_dir, calculator_data, reward)
    if name == "ppo":
        overrides.append(f"critic.model.path={tool_model_dir}")
    trainer = trainer_for(name, tool_model_dir, calculator_data, ds_test_config, tmp_path / "run", *overrides)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    batches = captured_batches(trainer)
    before = {k: v.clone() for k, v in trainer_parameters(trainer)}
    trainer.fit()
    after = dict(trainer_parameters(trainer))
    steps = [m for _, m in logged if "actor/grad_norm" in m]
    assert len(steps) == 2
    for metrics in steps:
        assert all(math.isfinite(v) for k, v in metrics.items() if not k.startswith("training/rollout_actor"))
        assert metrics["multi_turn/calls_per_response/mean"] > 0 and metrics["tool/calls/calculator"] > 0
        assert metrics["reward/turns/mean"] == metrics["multi_turn/turns_per_response/mean"]
        assert metrics["reward/calls/mean"] == metrics["multi_turn/calls_per_response/mean"]
        # The actor reads the model's tokens with the tool outputs in its context as the rollout generated them.
        assert metrics["training/rollout_probs_diff_max"] < 1e-4, metrics["training/rollout_probs_diff_max"]
    validation = [m for _, m in logged if "val-aux/multi_turn/calls_per_response/mean" in m]
    assert validation, "validation runs the tool loop too"
    holes = 0
    for batch in batches:
        inside = batch.response_attention.bool() & ~batch.response_mask.bool()
        holes += int(inside.sum())
        assert not batch.rollout_log_probs[inside].any()  # no log-prob on a tool output's token
        assert (batch.response_attention.sum(-1) >= batch.response_mask.sum(-1)).all()
    assert holes > 0  # some response had a tool output in its context
    assert changed_fraction(before, after) == 1.0


def trainer_parameters(trainer):
    from dsrl.engines.weight_sync import iter_full_parameters

    return iter_full_parameters(trainer.actor.module)


def test_conversations_go_on_across_steps_with_partial_rollout(
    tool_model_dir, calculator_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """colocate_async with tool calls: conversations stop mid-turn or between turns at a step's end and go on under
    the next step's weights, their tool outputs still in the context only (response_mask 0, no log-prob); the step's
    rollout-vs-actor gap over the tokens its own weights sampled stays at float round-off."""
    from tests.helpers.trainer import trainer_for

    reward = tmp_path / "turns_reward.py"
    reward.write_text(TURNS_REWARD)
    overrides = [
        *multi_turn_overrides(tool_model_dir, calculator_data, reward),
        "trainer.v1.trainer_mode=colocate_async",
        "trainer.v1.colocate_async.chunk_tokens=8",
        "trainer.total_training_steps=3",
    ]
    trainer = trainer_for("grpo", tool_model_dir, calculator_data, ds_test_config, tmp_path / "run", *overrides)
    logged, batches = [], []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    partial_rollout = trainer.partial_rollout

    def recording():
        batch, metrics = partial_rollout()
        batches.append(batch)
        return batch, metrics

    trainer.partial_rollout = recording
    trainer.fit()
    steps = [m for _, m in logged if "actor/grad_norm" in m]
    assert len(steps) == 3 and all(m["training/off_policy/groups_carried"] > 0 for m in steps[1:])
    assert sum(m["tool/calls/calculator"] for m in steps) > 0
    assert all(m["training/rollout_probs_diff_max"] < 1e-4 for m in steps if m["training/rollout_probs_diff_valid"])
    spanning_with_tools = 0
    for batch in batches:
        inside = batch.response_attention.bool() & ~batch.response_mask.bool()
        assert not batch.rollout_log_probs[inside].any()
        versions = batch.rollout_versions.masked_fill(~batch.response_attention.bool(), -1)
        spans = versions.max(-1).values > versions.masked_fill(versions < 0, 10**6).min(-1).values
        spanning_with_tools += int((spans & inside.any(-1)).sum())
        turns = torch.tensor([info["num_turns"] for info in batch.extra_infos])
        assert (turns >= 1).all()
    assert spanning_with_tools > 0  # a conversation with a tool call went on under newer weights
