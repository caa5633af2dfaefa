"""The quickstart config on two CPU ranks under the real ``deepspeed`` launcher (ZeRO-3 + offload).

Each rank runs its own share of the prompts; every logged metric except the rank-local timings
must be the same number on both ranks (they are all-reduced), and ``scripts/train.py`` itself must
run under the launcher.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, RANK_LOCAL

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "helpers" / "train_worker.py"


@pytest.fixture(scope="module")
def setup(arithmetic_data, tiny_model_dir, ds_test_config, deepspeed_cpu_ops, free_port, tmp_path_factory):
    data = arithmetic_data
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"custom_reward_function.path={data / 'digits_reward.py'}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps per step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        f"trainer.default_local_dir={tmp_path_factory.mktemp('checkpoints')}",
        "trainer.resume_mode=disable",  # both tests train from scratch in the same directory
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "3"}

    def launcher():
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]

    return overrides, env, launcher


def run(command, env):
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=480, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


def test_ranks_log_the_same_metrics(setup, tmp_path):
    overrides, env, launcher = setup
    run([*launcher(), str(WORKER), "--out", str(tmp_path), *QUICKSTART, *overrides], env)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in reports] == [2, 2]
    steps = [[entry["step"] for entry in r["logged"]] for r in reports]
    assert steps == [[0, 1, 2], [0, 1, 2]]
    for entry0, entry1 in zip(reports[0]["logged"], reports[1]["logged"], strict=True):
        shared0 = {k: v for k, v in entry0["metrics"].items() if not k.startswith(RANK_LOCAL)}
        shared1 = {k: v for k, v in entry1["metrics"].items() if not k.startswith(RANK_LOCAL)}
        assert shared0 == shared1
        assert all(math.isfinite(v) for v in entry0["metrics"].values())
    step1 = reports[0]["logged"][1]["metrics"]
    assert step1["actor/grad_norm"] > 0
    assert step1["training/rollout_probs_diff_mean"] < 1e-4
    # balance_batch moved rows: the tokens per rank are no further apart than before
    assert (
        step1["global_seqlen/balanced_max"] - step1["global_seqlen/balanced_min"] <= step1["global_seqlen/minmax_diff"]
    )


@pytest.mark.slow
def test_packed_ranks_log_and_train_as_padded_ones(setup, tmp_path):
    """The quickstart on two ranks packs with one copy of each prompt (the CPU overlay's); padded, every metric
    but the rank-local ones and the forwards' own ``perf/*`` is the same to float rounding."""
    from tests.trainer.test_trainer_packing import PADDED, assert_same_logs

    overrides, env, launcher = setup
    logged = {}
    for arm, layout in (("packed", ()), ("padded", PADDED)):
        (tmp_path / arm).mkdir()
        run([*launcher(), str(WORKER), "--out", str(tmp_path / arm), *QUICKSTART, *overrides, *layout], env)
        logged[arm] = json.loads((tmp_path / arm / "rank0.json").read_text())["logged"]
    dedup = {arm: entries[1]["metrics"]["perf/dedup_ratio"] for arm, entries in logged.items()}
    assert dedup["packed"] > 0 and dedup["padded"] == 0
    assert [e["step"] for e in logged["packed"]] == [e["step"] for e in logged["padded"]] == [0, 1, 2]
    assert_same_logs(*([e["metrics"] for e in logged[arm]] for arm in ("padded", "packed")))


@pytest.mark.slow
def test_sequence_parallel_ranks_log_and_train_as_data_parallel_ones(setup, tmp_path):
    """The quickstart on two ranks with actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 (the actor, its
    old log-probs and the reference on shards of the packed rows, both ranks' rows in turn) logs what it logs
    with 1, every metric but the rank-local ones and the forwards' own perf/* to float rounding; both with the
    fused log-prob head (a shard may predict no response token: its rank still runs the head's chunks)."""
    from tests.trainer.test_trainer_packing import assert_same_logs

    overrides, env, launcher = setup
    logged = {}
    for sp in (1, 2):
        (tmp_path / f"sp{sp}").mkdir()
        sequence_parallel = f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"
        run(
            [*launcher(), str(WORKER), "--out", str(tmp_path / f"sp{sp}"), *QUICKSTART, *overrides, sequence_parallel],
            env,
        )
        logged[sp] = json.loads((tmp_path / f"sp{sp}" / "rank0.json").read_text())["logged"]
    assert [e["step"] for e in logged[1]] == [e["step"] for e in logged[2]] == [0, 1, 2]
    assert_same_logs(*([e["metrics"] for e in logged[sp]] for sp in (1, 2)))


@pytest.mark.slow
def test_a_mixture_of_experts_logs_the_same_curve_under_every_zero_setup(
    setup, moe_model_dir, ds_test_config, tmp_path
):
    """The quickstart on two ranks with the tiny Qwen3-MoE, each rank routing its own rows, under ZeRO-2, ZeRO-3
    and ZeRO-3 with offload (every tensor partitioned): the same metrics to float rounding, as a dense model's."""
    from tests.trainer.test_trainer_packing import assert_same_logs

    overrides, env, launcher = setup
    logged = {}
    for zero in ("zero2", "zero3", "zero3_offload"):
        (tmp_path / zero).mkdir()
        moe = [
            f"actor_rollout_ref.model.path={moe_model_dir}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config(zero)}",
        ]
        run([*launcher(), str(WORKER), "--out", str(tmp_path / zero), *QUICKSTART, *overrides, *moe], env)
        logged[zero] = [e["metrics"] for e in json.loads((tmp_path / zero / "rank0.json").read_text())["logged"]]
    assert logged["zero2"][1]["actor/moe/load_imbalance"] >= 1
    for zero in ("zero3", "zero3_offload"):
        assert_same_logs(logged["zero2"], logged[zero])


@pytest.mark.parametrize("mode", ["R3", pytest.param("R2", marks=pytest.mark.slow)])
def test_routing_replay_runs_on_two_ranks(setup, moe_model_dir, ds_test_config, tmp_path, mode):
    """The quickstart with the tiny Qwen3-MoE on two ranks under ZeRO-3 with activation checkpointing, replaying
    the routes (R3: the rollout's, moved between the ranks with their rows by the batch balance; R2: the old-log-prob
    pass's). Float32 and the same weights: the old-log-prob pass's routers (R3) and the first step's reference agree
    with nearly every recorded choice, the update's (two optimizer steps) with most; every rank logs the same."""
    overrides, env, launcher = setup
    replay = [
        f"actor_rollout_ref.model.path={moe_model_dir}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3')}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"actor_rollout_ref.actor.router_replay.mode={mode}",
        f"actor_rollout_ref.rollout.enable_rollout_routing_replay={mode == 'R3'}",
        "actor_rollout_ref.actor.use_kl_loss=true",  # a reference, which replays them too
    ]
    run([*launcher(), str(WORKER), "--out", str(tmp_path), *QUICKSTART, *overrides, *replay], env)
    logged = [json.loads((tmp_path / f"rank{r}.json").read_text())["logged"] for r in (0, 1)]
    steps = [e["metrics"] for e in logged[0] if "training/global_step" in e["metrics"]]
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["moe/route_agreement/actor_update"] > 0.5
        assert metrics["moe/route_agreement/ref"] > 0.5
        if mode == "R3":
            assert metrics["moe/route_agreement/old_log_prob"] > 0.99
        else:  # recorded there
            assert "moe/route_agreement/old_log_prob" not in metrics
    assert steps[0]["moe/route_agreement/ref"] > 0.99  # the first step's reference is the policy that sampled
    for entry0, entry1 in zip(*logged, strict=True):
        shared0 = {k: v for k, v in entry0["metrics"].items() if not k.startswith(RANK_LOCAL)}
        assert shared0 == {k: v for k, v in entry1["metrics"].items() if not k.startswith(RANK_LOCAL)}


@pytest.mark.slow  # one rank's gate is tests/trainer/test_rollout_mismatch_stops_run.py; the stop is all-reduced
def test_a_broken_push_stops_both_ranks_at_the_same_step(setup, tmp_path):
    """``algorithm.rollout_mismatch`` reads all-reduced metrics, so every rank counts the same streak and stops
    at the same step: each rank's rollout keeps its start-up weights (``--skip-push``), step 1 is healthy, steps 2
    and 3 are off by more than 1e-4, and with patience 2 both ranks stop at step 3, rank 0 reporting it once."""
    overrides, env, launcher = setup
    result = subprocess.run(
        [
            *launcher(),
            str(WORKER),
            "--out",
            str(tmp_path),
            "--skip-push",
            *QUICKSTART,
            *overrides,
            "trainer.total_training_steps=3",
            "algorithm.rollout_mismatch.max_probs_diff=1e-4",
            "algorithm.rollout_mismatch.patience=2",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [[entry["step"] for entry in r["logged"]] for r in reports] == [[0, 1, 2], [0, 1, 2]]
    streaks = [[entry["metrics"]["training/rollout_mismatch_streak"] for entry in r["logged"][1:]] for r in reports]
    assert streaks == [[0, 1], [0, 1]]
    gaps = [[entry["metrics"]["training/rollout_probs_diff_mean"] for entry in r["logged"][1:]] for r in reports]
    assert gaps[0] == gaps[1] and gaps[0][0] < 1e-4 < gaps[0][1]
    assert output.count("dsrl: step 3: the rollout's token probabilities left the actor's in 2 steps in a row") == 1


def test_train_script_runs_under_the_launcher(setup):
    overrides, env, launcher = setup
    command = launcher()
    port = command[command.index("--master_port") + 1]
    stdout = run([*command, str(REPO / "scripts" / "train.py"), *QUICKSTART, *overrides], env)
    # DeepSpeed's shared-memory all-reduce buffers of the run (66 MiB a rank) are not left in /dev/shm
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    # the launcher pipes stdout: plain lines, not a progress bar; rank 0 alone logs them
    assert re.search(r"^\[dsrl r0 \d\d:\d\d:\d\d\] step 2/2 score=", stdout, re.M)
    assert "[dsrl r1 " not in stdout
    # the ranks' host, from the preflight
    assert re.search(
        r"^\[dsrl r0 [\d:]+\] start-up summary\n  world: +2 rank\(s\) on 1 node\(s\): \S+ ranks 0-1, cpu", stdout, re.M
    )
    summary = stdout[stdout.index("final summary") :]
    assert re.search(r"status: +finished", summary) and re.search(r"steps: +2/2", summary)
    assert re.search(r"validation score: +best [\d.]+ \(step \d\), last [\d.]+ \(step 2\)", summary)
    assert re.search(r"model: +\S+/huggingface", summary)


GROUND_TRUTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth)
"""


def test_validation_with_fewer_prompts_than_chunks_on_some_ranks(setup, arithmetic_data, tmp_path):
    """3 validation prompts on 2 ranks, one per chunk: rank 0 holds 2, rank 1 holds 1 (and a filler it does
    not score). Every rank makes the same calls; the mean counts each prompt once. The reward is the ground
    truth itself (0, 0, 3), so the mean is 1.0; the filler (a copy of the first prompt, 0) would make it 0.75."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(arithmetic_data / "test.parquet").to_pylist()[:3]
    for row, truth in zip(rows, ("0", "0", "3"), strict=True):
        row["reward_model"]["ground_truth"] = truth
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val3.parquet")
    (tmp_path / "truth_reward.py").write_text(GROUND_TRUTH_REWARD)
    overrides, env, launcher = setup
    run(
        [
            *launcher(),
            str(WORKER),
            "--out",
            str(tmp_path),
            *QUICKSTART,
            *overrides,
            f"data.val_files={tmp_path / 'val3.parquet'}",
            "data.val_batch_size=1",
            f"custom_reward_function.path={tmp_path / 'truth_reward.py'}",
            "trainer.total_training_steps=1",
            "trainer.test_freq=1",
        ],
        env,
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert [entry["step"] for entry in report["logged"]] == [0, 1]
        for entry in report["logged"]:
            assert entry["metrics"]["val-core/arithmetic/reward/mean@1"] == 1.0


def test_dynamic_sampling_ranks_agree_on_rounds_and_kept_groups(setup, tmp_path):
    """algorithm.filter_groups on two ranks: each generates its shard of every round, one collective per round
    gives both the same verdicts, so both run the same rounds and train on the same global batch of
    train_batch_size groups (every all-reduced metric equal on both ranks)."""
    from tests.helpers.trainer import FILTERING, PARITY_REWARD

    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    overrides, env, launcher = setup
    run(
        [
            *launcher(),
            str(WORKER),
            "--out",
            str(tmp_path),
            *QUICKSTART,
            *overrides,
            f"custom_reward_function.path={tmp_path / 'parity_reward.py'}",
            *FILTERING,
        ],
        env,
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for entry0, entry1 in zip(reports[0]["logged"], reports[1]["logged"], strict=True):
        shared0 = {k: v for k, v in entry0["metrics"].items() if not k.startswith(RANK_LOCAL)}
        shared1 = {k: v for k, v in entry1["metrics"].items() if not k.startswith(RANK_LOCAL)}
        assert shared0 == shared1
    steps = [entry["metrics"] for entry in reports[0]["logged"] if "train/num_gen_batches" in entry["metrics"]]
    assert len(steps) == 2 and sum(m["train/num_gen_batches"] for m in steps) > 2
    for metrics in steps:
        assert metrics["dynamic_sampling/groups_kept"] == 8 and metrics["actor/grad_norm"] > 0


def test_multi_turn_ranks_each_run_their_own_turns(setup, tool_model_dir, calculator_data, tmp_path):
    """Tool calls on two ranks: each rank's conversations take their own turns (the loop has no collective), and
    the all-reduced metrics agree."""
    overrides, env, launcher = setup
    data = calculator_data
    run(
        [
            *launcher(),
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
        env,
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(report["multi_turn"] for report in reports)
    steps = [[e["metrics"] for e in report["logged"] if "actor/grad_norm" in e["metrics"]] for report in reports]
    assert len(steps[0]) == len(steps[1]) == 2
    for metrics0, metrics1 in zip(*steps, strict=True):
        assert metrics0["tool/calls/calculator"] > 0
        shared = lambda m: {k: v for k, v in m.items() if not k.startswith(RANK_LOCAL)}  # noqa: E731
        assert shared(metrics0) == shared(metrics1)
    # The first turn of a step generates for all of a rank's prompts, each later one for the conversations
    # still going: 2 steps and a validation of 4 prompts a rank, each with as many turns as its rows needed.
    for report in reports:
        first_turns = [rows for rows in report["engine_calls"] if rows == 4]
        assert len(first_turns) >= 3 and len(report["engine_calls"]) > len(first_turns)
