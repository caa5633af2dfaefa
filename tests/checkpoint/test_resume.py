"""Exact resume on one rank, in every configuration dsrl ships (each recipe under the CPU overlay, and
the quickstart): runs killed with SIGKILL (mid-step, and at each phase of writing a checkpoint) or
stopped by SIGTERM, then resumed, are bit-identical to an uninterrupted run at every step after the
resume: metrics, DeepSpeed partitions and optimizer states, RNG, trainer state, the exported model.

Each run is a real process (``tests/helpers/train_worker.py``): the configuration as shipped but for the tiny
model, the test data and reward, and ``STEPS`` steps with a checkpoint after each (``resume_overrides``).
Under the CPU overlay every recipe takes one optimizer step per training step, so the resume points
below are also optimizer-step counts: 2 (DeepSpeed's CPU Adam once took the third step differently in a
resumed process), and 3 after a kill. Uninterrupted runs execute beside the resumed ones (one thread
each, two cores).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.resume import (
    LORA,
    SHIPPED,
    STEPS,
    Baselines,
    assert_same_run,
    finish,
    logged_steps,
    resume_chain,
    resume_overrides,
    run_worker,
    start_worker,
)

pytestmark = pytest.mark.e2e

# Each resumed chain starts from the uninterrupted run's step-2 checkpoint; three are killed with SIGKILL on the
# way, at a phase of writing a checkpoint or in the middle of a step (and RLOO's is stopped by SIGTERM below): (kill
# point, the checkpoint the next run resumes from: a kill while a checkpoint is written falls back to the one before).
# tests/checkpoint/test_resume_2ranks.py resumes the same configurations at step 3, and
# tests/checkpoint/test_adam_resume.py the optimizer at every count.
RESUME_AT = 2
KILLS = {
    "grpo": [("save_engines@4", 3)],
    "ppo": [("publish@3", 3)],
    "quickstart": [("update@4", 3)],
}


@pytest.fixture(scope="module")
def overrides_for(tiny_model_dir, arithmetic_data, ds_test_config):
    ds_config = ds_test_config("zero3_offload")
    return lambda name, ckpt: resume_overrides(
        name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt
    )


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, overrides_for, free_port, deepspeed_cpu_ops):
    return Baselines(tmp_path_factory.mktemp("baselines"), overrides_for, free_port, world=1)


# REINFORCE++, OPO, OTB and RLOO resume through the same outcome-estimator path as GRPO (whose full and LoRA runs
# stay in the default run), DAPO through GRPO's and dynamic sampling's
# (test_resume_with_dynamic_sampling_is_bit_identical): slow variants.
SLOW_RESUMES = ("reinforce_pp", "opo", "otb", "rloo", "dapo")


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_RESUMES else name for name in SHIPPED]
)
def test_killed_and_resumed_run_is_bit_identical(name, baselines, overrides_for, free_port, tmp_path):
    start = baselines.checkpoint(name, RESUME_AT)  # the chain runs beside the rest of the uninterrupted run
    resume_chain(
        name,
        start,
        KILLS.get(name, []),
        out=tmp_path,
        overrides=overrides_for(name, tmp_path / "ckpt"),
        world=1,
        free_port=free_port,
    )
    assert assert_same_run(baselines.result(name), tmp_path, first_step=RESUME_AT + 1) == STEPS - RESUME_AT + 1


def kill_and_resume_grpo(overrides_for, free_port, tmp_path) -> Path:
    """GRPO's uninterrupted run with ``overrides_for(name, ckpt)`` and the chain resumed from its step-2 checkpoint
    (killed while saving), which must be the same run; the checkpoint the chain started from."""
    runs = Baselines(tmp_path / "baseline", overrides_for, free_port, world=1)
    start = runs.checkpoint("grpo", RESUME_AT)
    chain = tmp_path / "chain"
    overrides = runs.overrides_for("grpo", chain / "ckpt")
    resume_chain("grpo", start, KILLS["grpo"], out=chain, overrides=overrides, world=1, free_port=free_port)
    assert assert_same_run(runs.result("grpo"), chain, first_step=RESUME_AT + 1) == STEPS - RESUME_AT + 1
    return start


# GRPO's recipe has a KL loss: the reference log-probs are the LoRA actor's with its adapters off.
@pytest.mark.parametrize("zero", ["zero3_offload", pytest.param("zero2", marks=pytest.mark.slow)])
def test_killed_and_resumed_lora_run_is_bit_identical(
    zero, tiny_model_dir, arithmetic_data, ds_test_config, free_port, deepspeed_cpu_ops, tmp_path
):
    """A LoRA actor's checkpoints hold its adapters and their optimizer state, not the frozen base (loaded from
    model.path again on resume); a run killed while saving and resumed is the uninterrupted one, its merged
    model and adapter export included."""
    ds_config = ds_test_config(zero)
    start = kill_and_resume_grpo(
        lambda name, ckpt: (
            resume_overrides(name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt) + LORA
        ),
        free_port,
        tmp_path,
    )
    engine_files = list((start / "actor" / "ds").rglob("*.pt"))
    states = next(f for f in engine_files if f.name.endswith("model_states.pt"))
    module = torch.load(states, weights_only=False)["module"]
    assert module and all(".lora_A." in name or ".lora_B." in name for name in module)  # the tied output layer too
    base_bytes = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in engine_files) < base_bytes / 2


def test_killed_and_resumed_mixture_of_experts_run_is_bit_identical(
    moe_model_dir, arithmetic_data, ds_test_config, free_port, deepspeed_cpu_ops, tmp_path
):
    """A tiny Qwen3-MoE (8 experts, top 2) under ZeRO-3 with offload, its routers' aux loss on: killed while saving
    and resumed, the run is the uninterrupted one, its export (one tensor per expert, the checkpoint's format)
    included."""
    ds_config = ds_test_config("zero3_offload")
    kill_and_resume_grpo(
        lambda name, ckpt: [
            *resume_overrides(name, model=moe_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt),
            "actor_rollout_ref.actor.router_aux_loss_coef=0.001",
        ],
        free_port,
        tmp_path,
    )
    index = json.loads((tmp_path / "chain" / "ckpt" / "huggingface" / "model.safetensors.index.json").read_text())
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in index["weight_map"]


def test_killed_and_resumed_run_with_a_reward_model_and_a_teacher_is_bit_identical(
    tiny_model_dir,
    tiny_reward_model_dir,
    tiny_teacher_dir,
    arithmetic_data,
    ds_test_config,
    free_port,
    deepspeed_cpu_ops,
    tmp_path,
):
    """GRPO whose reward function adds the reward model's score, distilled from a teacher beside its task: the two
    frozen engines hold no state of their own and load again on resume, and a run killed while saving and resumed is
    the uninterrupted one."""
    ds_config, frozen = ds_test_config("zero3_offload"), ds_test_config("zero3_offload_inference")
    reward = tmp_path / "rm_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(ch.isdigit() for ch in solution_str) + extra_info['reward_model_score']\n"
    )
    kill_and_resume_grpo(
        lambda name, ckpt: [
            *resume_overrides(name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt),
            f"custom_reward_function.path={reward}",
            "reward_model.enable=true",
            f"reward_model.model.path={tiny_reward_model_dir}",
            f"reward_model.deepspeed_config={frozen}",
            "distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={tiny_teacher_dir}",
            f"distillation.teacher_models.teacher_model.deepspeed_config={frozen}",
        ],
        free_port,
        tmp_path,
    )
    steps = [e["metrics"] for e in logged_steps(tmp_path / "baseline" / "grpo") if "actor/grad_norm" in e["metrics"]]
    assert len(steps) == STEPS
    assert all("reward/reward_model_score/mean" in m and "distillation/loss" in m for m in steps)


PARTIAL_ROLLOUT = [
    "trainer.v1.trainer_mode=colocate_async",
    "trainer.v1.colocate_async.chunk_tokens=4",
    "trainer.v1.sampler.max_off_policy_threshold=2",
    "algorithm.rollout_correction.rollout_is=token",
]


def test_killed_and_resumed_colocate_async_run_is_bit_identical(
    tiny_model_dir, arithmetic_data, ds_test_config, free_port, deepspeed_cpu_ops, tmp_path
):
    """Partial rollout (GRPO): from the second step on the pool carries groups, the trained responses span versions
    within the bound, and rollout correction weighs their stale tokens; each checkpoint holds the groups in flight
    (tokens, float32 log-probs, versions), and a run killed while saving and resumed is the uninterrupted one, the
    responses it carried over the resume included."""
    ds_config = ds_test_config("zero3_offload")
    start = kill_and_resume_grpo(
        lambda name, ckpt: [
            *resume_overrides(name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt),
            *PARTIAL_ROLLOUT,
        ],
        free_port,
        tmp_path,
    )
    in_flight = torch.load(start / "in_flight" / "rank_0.pt", weights_only=True)
    assert len(in_flight["groups"]) and len(in_flight["tokens"]) and not in_flight["finished"].all()
    steps = [e["metrics"] for e in logged_steps(tmp_path / "baseline" / "grpo") if "actor/grad_norm" in e["metrics"]]
    off_policy = "training/off_policy"
    assert len(steps) == STEPS and steps[0][f"{off_policy}/groups_carried"] == 0
    assert all(m[f"{off_policy}/groups_carried"] > 0 for m in steps[1:])
    assert max(m[f"{off_policy}/trajectory_spans/max"] for m in steps) == 2  # the bound, reached
    assert all(m[f"{off_policy}/trajectory_staleness_worst/max"] + 1 <= 2 for m in steps)
    stale = [m for m in steps if m[f"{off_policy}/trajectory_staleness_worst/max"] > 0]
    assert stale and all(m["rollout_corr/is_ratio_min"] < 1 < m["rollout_corr/is_ratio_max"] for m in stale)


def test_sigterm_saves_exits_143_and_resumes_exactly(baselines, overrides_for, free_port, tmp_path):
    start = baselines.checkpoint("rloo", RESUME_AT)
    shutil.copytree(start, tmp_path / "ckpt" / start.name)
    overrides = overrides_for("rloo", tmp_path / "ckpt")
    process = start_worker("rloo", overrides, tmp_path, port=free_port())
    deadline = time.time() + 300
    while not any(e["step"] == RESUME_AT + 1 for e in logged_steps(tmp_path)):
        assert process.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    code, output = finish(process)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    stopped = max(e["step"] for e in logged_steps(tmp_path))
    assert stopped < STEPS
    assert f"checkpoint saved to {tmp_path / 'ckpt' / f'global_step_{stopped}'}" in output
    assert "SIGTERM received: finishing this step" in output
    code, output = run_worker("rloo", overrides, tmp_path, port=free_port())
    assert code == 0, output[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / f'global_step_{stopped}'}" in output
    assert assert_same_run(baselines.result("rloo"), tmp_path, first_step=RESUME_AT + 1) == STEPS - RESUME_AT + 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_second_signal_exits_at_once(signum, tmp_path):
    """The first signal only asks the loop to stop after its step; a second one ends the process at once
    with 128 + the signal number, once the at_kill callbacks ran (the MLflow run marked KILLED)."""
    import subprocess
    import sys

    code = (
        "import os, sys, time\n"
        "from dsrl.tracking.console import setup_logging\n"
        "from dsrl.runtime.signals import RunSignals\n"
        "setup_logging(rank=0)\n"
        "signals = RunSignals().install()\n"
        "signals.at_kill(lambda: open(sys.argv[1], 'w').write('killed'))\n"
        "with signals.deferred(rank=0):\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        f"    assert signals.signum == {int(signum)}\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        "    time.sleep(60)\n"
    )
    start = time.time()
    marker = tmp_path / "at_kill"
    result = subprocess.run([sys.executable, "-c", code, str(marker)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + signum, result.stderr
    assert f"{signal.Signals(signum).name} received: finishing this step" in result.stdout
    assert marker.read_text() == "killed"
    assert time.time() - start < 60


# data.gen_batch_size=16 (rounds of twice the batch of 8) is slow-marked: the sampler's batches are then a round's
@pytest.mark.parametrize("gen_batch_size", [None, pytest.param(16, marks=pytest.mark.slow)])
def test_resume_with_dynamic_sampling_is_bit_identical(
    gen_batch_size, overrides_for, free_port, deepspeed_cpu_ops, tmp_path
):
    """algorithm.filter_groups draws extra prompt batches in a step; the checkpoint's sampler position counts
    them, so a run killed mid-step and resumed draws the same prompts as the uninterrupted one."""
    from tests.helpers.trainer import FILTERING, PARITY_REWARD

    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    extra = [f"custom_reward_function.path={reward}", *FILTERING]
    if gen_batch_size is not None:
        extra.append(f"data.gen_batch_size={gen_batch_size}")
    baseline = tmp_path / "baseline"
    code, output = run_worker("grpo", overrides_for("grpo", baseline / "ckpt") + extra, baseline, port=free_port())
    assert code == 0, output[-4000:]
    rounds = [
        e["metrics"]["train/num_gen_batches"] for e in logged_steps(baseline) if "train/num_gen_batches" in e["metrics"]
    ]
    assert len(rounds) == STEPS and sum(rounds) > STEPS  # some step drew more than one batch of prompts
    chain = tmp_path / "chain"
    resume_chain(
        "grpo",
        baseline / "ckpt" / f"global_step_{RESUME_AT}",
        [("update@4", 3)],
        out=chain,
        overrides=overrides_for("grpo", chain / "ckpt") + extra,
        world=1,
        free_port=free_port,
    )
    assert assert_same_run(baseline, chain, first_step=RESUME_AT + 1) == STEPS - RESUME_AT + 1


# the loop's state is the same with tools (multi-turn trains in tests/trainer/test_trainer_multi_turn.py)
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_resume_with_tool_calls_is_bit_identical(
    mode, tool_model_dir, calculator_data, ds_test_config, free_port, deepspeed_cpu_ops, tmp_path
):
    """TIR-OTB with the calculator (configs/tir_otb.yaml, the tool task's CPU overlay): every turn of a
    conversation is seeded from the step, and the calculator gives the same outputs, so a run killed mid-step
    and resumed generates the same conversations as the uninterrupted one. With partial rollout the checkpoint holds
    the conversations in flight (their turns, tool messages and masks), which go on after the resume."""
    from tests.conftest import REPO

    ds_config = ds_test_config("zero3_offload")

    def overrides(ckpt):
        return [
            str(REPO / "configs" / "calculator_cpu.yaml"),
            *resume_overrides("tir_otb", model=tool_model_dir, data=calculator_data, ds_config=ds_config, ckpt=ckpt),
            "custom_reward_function.path=null",
            f"trainer.v1.trainer_mode={mode}",
            "trainer.v1.colocate_async.chunk_tokens=8",
        ]

    baseline = tmp_path / "baseline"
    code, output = run_worker("tir_otb", overrides(baseline / "ckpt"), baseline, port=free_port())
    assert code == 0, output[-4000:]
    calls = [
        e["metrics"]["tool/calls/calculator"] for e in logged_steps(baseline) if "tool/calls/calculator" in e["metrics"]
    ]
    assert len(calls) >= STEPS and sum(calls) > 0
    chain = tmp_path / "chain"
    resume_chain(
        "tir_otb",
        baseline / "ckpt" / f"global_step_{RESUME_AT}",
        [("update@4", 3)],
        out=chain,
        overrides=overrides(chain / "ckpt"),
        world=1,
        free_port=free_port,
    )
    assert assert_same_run(baseline, chain, first_step=RESUME_AT + 1) == STEPS - RESUME_AT + 1
    if mode == "colocate_async":
        in_flight = torch.load(
            baseline / "ckpt" / f"global_step_{RESUME_AT}" / "in_flight" / "rank_0.pt", weights_only=True
        )
        talks = [talk for talk in in_flight["conversations"] if talk is not None]
        assert any(talk["stop"] is None and len(talk["mask"]) for talk in talks)  # a turn cut by the step's end
