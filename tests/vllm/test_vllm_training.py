"""Training with ``actor_rollout_ref.rollout.name=vllm`` end to end: one process, and two CPU ranks
under the deepspeed launcher with tensor parallel 1 (two engines) and 2 (one engine over both)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, RANK_LOCAL
from tests.helpers.rollout import vllm_logprob_gap

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "helpers" / "train_worker.py"
# fp32 vLLM against the fp32 ZeRO-3 actor after every push (the tied output head included).
FP32_ATOL = 1e-4


@pytest.fixture(scope="module")
def overrides(arithmetic_data, tiny_model_dir, ds_test_config, deepspeed_cpu_ops, tmp_path_factory):
    data = arithmetic_data
    return [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"custom_reward_function.path={data / 'digits_reward.py'}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
        "algorithm.rollout_correction.rollout_is=token",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps per step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=3",
        "trainer.test_freq=3",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path_factory.mktemp('checkpoints')}",
        "trainer.resume_mode=disable",  # every test trains from scratch in the same directory
    ]


def run(command, port, returncode=0):
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "DEEPSPEED_TIMEOUT": "5",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "MASTER_PORT": str(port),
    }
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == returncode, (result.stdout + result.stderr)[-5000:]
    return result


def check_run(report):
    assert report["rollout"] == "VLLMRollout"
    assert [entry["step"] for entry in report["logged"]] == [0, 1, 2, 3]
    for entry in report["logged"]:
        bad = {k: v for k, v in entry["metrics"].items() if not math.isfinite(v)}
        assert not bad, (entry["step"], bad)
    for entry in report["logged"][1:]:
        metrics = entry["metrics"]
        for key in (
            "timing_s/update_weights",
            "timing_s/gen",
            "timing_s/wake",
            "timing_s/sleep",
            "rollout_corr/is_ratio_mean",
            "rollout_corr/masked_fraction",
            "actor/pg_loss",
        ):
            assert key in metrics, key
        # Each step pushes the weights of the previous step's update: vLLM scores like the actor.
        assert metrics["training/rollout_probs_diff_max"] < FP32_ATOL, metrics["training/rollout_probs_diff_max"]
        assert abs(metrics["rollout_corr/is_ratio_mean"] - 1) < FP32_ATOL
        assert metrics["actor/grad_norm"] > 0
    assert "val-core/arithmetic/reward/mean@1" in report["logged"][3]["metrics"]


def test_three_steps_in_one_process(overrides, tmp_path, free_port):
    run([sys.executable, str(WORKER), "--out", str(tmp_path), *QUICKSTART, *overrides], free_port())
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert (report["world"], report["tp"]) == (1, 1)
    check_run(report)
    # The trained model as exported loads in vLLM, which scores like transformers on the same files.
    assert vllm_logprob_gap(report["model_dir"], free_port()) < FP32_ATOL


def test_a_mixture_of_experts_trains_on_vllm(overrides, moe_model_dir, tmp_path, free_port):
    """The tiny Qwen3-MoE: every push carries the checkpoint's per-expert tensors, which vLLM's Qwen3-MoE loader
    fuses again (and the CPU build's expert kernel packs again, ``_repack_cpu_experts``), and after each one vLLM
    scores like the actor within the dense model's bound (1.5e-8 measured; without the repack 1.4e-3); the exported
    model loads in vLLM and scores like transformers."""
    moe = f"actor_rollout_ref.model.path={moe_model_dir}"
    run([sys.executable, str(WORKER), "--out", str(tmp_path), *QUICKSTART, *overrides, moe], free_port())
    report = json.loads((tmp_path / "rank0.json").read_text())
    check_run(report)
    assert report["logged"][1]["metrics"]["actor/moe/load_imbalance"] >= 1
    assert vllm_logprob_gap(report["model_dir"], free_port()) < FP32_ATOL


@pytest.mark.parametrize("tp", [1, 2])
def test_two_ranks_under_the_launcher(overrides, tmp_path, free_port, tp):
    port = free_port()
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port)]
    run(
        [
            *launcher,
            str(WORKER),
            "--out",
            str(tmp_path),
            *QUICKSTART,
            *overrides,
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        ],
        port,
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world"], r["tp"]) for r in reports] == [(2, tp), (2, tp)]
    for report in reports:
        check_run(report)
    # Every generate call (3 steps, then validation) of a tensor-parallel group starts from the same generators.
    states = [report["generator_states"] for report in reports]
    assert len(states[0]) == len(states[1]) >= 4
    assert (states[0] == states[1]) == (tp == 2)  # two engines of their own draw from their own seeds
    for entry0, entry1 in zip(reports[0]["logged"], reports[1]["logged"], strict=True):
        shared0 = {k: v for k, v in entry0["metrics"].items() if not k.startswith(RANK_LOCAL)}
        shared1 = {k: v for k, v in entry1["metrics"].items() if not k.startswith(RANK_LOCAL)}
        assert shared0 == shared1  # all-reduced: every rank logs the same numbers


def test_partial_rollout_on_a_tensor_parallel_engine(overrides, tmp_path, free_port):
    """colocate_async on two ranks sharing one engine (TP 2): vLLM steps its requests in chunks and aborts the rest;
    both ranks take every stop alike (the same off-policy metrics, chunks included), carried responses go on under
    the next weights, and the tokens each step's weights sampled score like the actor."""
    port = free_port()
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port)]
    partial = ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.chunk_tokens=4"]
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    run([*launcher, str(WORKER), "--out", str(tmp_path), *QUICKSTART, *overrides, tp, *partial], port)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    steps = [[e["metrics"] for e in report["logged"] if "actor/grad_norm" in e["metrics"]] for report in reports]
    assert len(steps[0]) == 3 and [report["tp"] for report in reports] == [2, 2]
    off_policy = [[{k: v for k, v in m.items() if k.startswith("training/off_policy/")} for m in s] for s in steps]
    assert off_policy[0] == off_policy[1]
    assert all(m["training/off_policy/groups_carried"] > 0 for m in steps[0][1:])
    assert max(m["training/off_policy/trajectory_spans/max"] for m in steps[0]) >= 2
    for m in steps[0]:
        if m["training/rollout_probs_diff_valid"]:
            assert m["training/rollout_probs_diff_max"] < FP32_ATOL, m["training/rollout_probs_diff_max"]


def test_a_push_that_never_reaches_vllm_stops_the_run(overrides, tmp_path, free_port):
    """The weight push made a no-op (``--skip-push``): vLLM keeps its start-up weights while the actor trains.
    Step 1 samples from the weights the actor still holds (within fp32 numerics, as above); steps 2 and 3 are two
    steps in a row off by more than FP32_ATOL, so ``algorithm.rollout_mismatch`` stops the run at step 3, exit 1."""
    # Sleep mode off, as on CPU, also on a GPU: there a level-2 sleep without a push fails generate before any gap.
    result = run(
        [
            sys.executable,
            str(WORKER),
            "--out",
            str(tmp_path),
            "--skip-push",
            *QUICKSTART,
            *overrides,
            "actor_rollout_ref.rollout.enable_sleep_mode=false",
            f"algorithm.rollout_mismatch.max_probs_diff={FP32_ATOL}",
            "algorithm.rollout_mismatch.patience=2",
        ],
        free_port(),
        returncode=1,
    )
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["rollout"] == "VLLMRollout"
    assert [entry["step"] for entry in report["logged"]] == [0, 1, 2]  # validation, then steps 1 and 2; 3 stopped
    step1, step2 = (entry["metrics"] for entry in report["logged"][1:])
    assert step1["training/rollout_probs_diff_mean"] < FP32_ATOL < step2["training/rollout_probs_diff_mean"]
    assert (step1["training/rollout_mismatch_streak"], step2["training/rollout_mismatch_streak"]) == (0, 1)
    assert "dsrl: step 3: the rollout's token probabilities left the actor's in 2 steps in a row" in result.stderr
    assert "stale rollout weights: a weight push that failed or was skipped" in result.stderr


def test_multi_turn_with_tools_on_vllm(overrides, tool_model_dir, calculator_data, tmp_path, free_port):
    """The tool loop around the vLLM engine: each turn one generate call with each conversation's own token cap;
    the actor's log-probs on the model's tokens, read with the tool outputs in the context, are vLLM's."""
    data = calculator_data
    run(
        [
            sys.executable,
            str(WORKER),
            "--out",
            str(tmp_path),
            *QUICKSTART,
            str(REPO / "configs" / "calculator_cpu.yaml"),
            *overrides,
            f"actor_rollout_ref.model.path={tool_model_dir}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            "custom_reward_function.path=null",
        ],
        free_port(),
    )
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["rollout"] == "VLLMRollout" and report["multi_turn"]
    steps = [e["metrics"] for e in report["logged"] if "actor/grad_norm" in e["metrics"]]
    assert len(steps) == 3
    for metrics in steps:
        assert metrics["tool/calls/calculator"] > 0 and metrics["multi_turn/turns_per_response/max"] >= 2
        assert metrics["training/rollout_probs_diff_max"] < FP32_ATOL, metrics["training/rollout_probs_diff_max"]
    assert len(report["engine_calls"]) > 4  # later turns: calls of their own


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapters"])
def test_lora_pushes(overrides, tmp_path, free_port, merge):
    """LoRA with either push (actor_rollout_ref.model.lora.merge): the merged weights streamed as for full
    fine-tuning, or the adapters alone over the base weights vLLM read at start-up (sleep level 1: level 2 would
    drop those). After each step's update vLLM scores as the actor does, within fp32 numerics."""
    result = run(
        [
            sys.executable,
            str(WORKER),
            "--out",
            str(tmp_path),
            *QUICKSTART,
            *overrides,
            "actor_rollout_ref.model.lora_rank=8",
            f"actor_rollout_ref.model.lora.merge={str(merge).lower()}",
            "actor_rollout_ref.rollout.sleep_level=1",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        ],
        free_port(),
    )
    # vLLM logs the LoRA kernels it picks when built with LoRA (enable_lora): adapter pushes only.
    assert ("Using PunicaWrapper" in result.stdout + result.stderr) == (not merge)
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["rollout"] == "VLLMRollout"
    assert [entry["step"] for entry in report["logged"]] == [1, 2]
    for entry in report["logged"]:
        metrics = entry["metrics"]
        assert metrics["actor/grad_norm"] > 0 and "timing_s/update_weights" in metrics
        # Step 2 samples from the adapters of step 1's update, pushed (without the push, --skip-push: 8e-4 off).
        assert metrics["training/rollout_probs_diff_max"] < FP32_ATOL, metrics["training/rollout_probs_diff_max"]
