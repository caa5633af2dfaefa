"""Two CPU ranks under the real ``deepspeed`` launcher: ZeRO-3 + offload actor, rollout copies, sync.

The worker (``tests/helpers/engines_2ranks_worker.py``) writes one JSON per rank; the same script run as a world
of one on the whole batch gives the parameters a 2-rank update must reproduce: that pins down the
loss normalisation by global counts and the compensation of DeepSpeed's gradient averaging.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parents[1] / "helpers" / "engines_2ranks_worker.py"
REPO = Path(__file__).resolve().parents[2]


def run(command: list[str], env: dict[str, str], out: Path) -> None:
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=420, check=False)
    (out / "log.txt").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


def launch(
    tmp_path_factory, tiny_model_dir, ds_test_config, free_port, *extra: str, alone: bool = True
) -> tuple[Path, Path | None]:
    """The worker on 2 ranks, then (``alone``) alone on the whole batch: the two output folders."""
    ds_config = ds_test_config("zero3_offload", optimizer={"eps": 1.0})
    args = ["--model", str(tiny_model_dir), "--ds-config", ds_config, *extra]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "2"}
    two = tmp_path_factory.mktemp("two_ranks")
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    run([*launcher, str(WORKER), "--out", str(two), *args], env, two)
    if not alone:
        return two, None
    one = tmp_path_factory.mktemp("one_rank")
    alone = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    run([sys.executable, str(WORKER), "--out", str(one), *args], {**env, **alone}, one)
    return two, one


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deepspeed_cpu_ops, tiny_model_dir, ds_test_config, free_port):
    return launch(tmp_path_factory, tiny_model_dir, ds_test_config, free_port)


def test_ranks_agree_and_rollout_copies_score_like_the_actor(runs):
    two, _ = runs
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in reports] == [2, 2]
    assert reports[0]["metrics"] == reports[1]["metrics"]  # all-reduced: bit-identical on both ranks
    assert reports[0]["metrics"]["actor/grad_norm"] > 0
    assert all(math.isfinite(v) for v in reports[0]["metrics"].values())
    assert reports[0]["param_sum"] == reports[1]["param_sum"]  # the gathered model is the same everywhere
    for report in reports:
        assert report["logprob_diff_before_update"] < 1e-5
        assert report["logprob_diff_after_update"] < 1e-5
        assert report["actor_change_on_first_samples"] > 1e-3


def test_two_ranks_train_exactly_like_one_rank_on_the_whole_batch(runs):
    two, one = runs
    params_two = torch.load(two / "params_world2.pt")
    params_one = torch.load(one / "params_world1.pt")
    assert params_two.keys() == params_one.keys()
    worst = max((params_two[k] - params_one[k]).abs().max().item() for k in params_one)
    assert worst < 1e-6, worst
    metrics_two = json.loads((two / "rank0.json").read_text())["metrics"]
    metrics_one = json.loads((one / "rank0.json").read_text())["metrics"]
    assert metrics_two.keys() == metrics_one.keys()
    for key, value in metrics_one.items():
        assert math.isclose(metrics_two[key], value, rel_tol=1e-5, abs_tol=1e-6), key


def test_a_lora_update_on_two_ranks_equals_one_rank_on_the_whole_batch(
    tmp_path_factory, deepspeed_cpu_ops, tiny_model_dir, ds_test_config, free_port
):
    """LoRA adapters (rank 4): the ranks agree (DeepSpeed broadcasts rank 0's initial adapters), the merged
    weights reach the rollout copies, and 2 ranks train the adapters as 1 rank does."""
    two, one = launch(tmp_path_factory, tiny_model_dir, ds_test_config, free_port, "--lora-rank", "4")
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["metrics"] == reports[1]["metrics"] and reports[0]["param_sum"] == reports[1]["param_sum"]
    for report in reports:
        assert report["logprob_diff_before_update"] < 1e-5 and report["logprob_diff_after_update"] < 1e-5
        assert report["actor_change_on_first_samples"] > 1e-3
    params_two, params_one = torch.load(two / "params_world2.pt"), torch.load(one / "params_world1.pt")
    assert params_two.keys() == params_one.keys() and any(".lora_B." in k for k in params_one)
    worst = max((params_two[k] - params_one[k]).abs().max().item() for k in params_one)
    assert worst < 1e-6, worst


def test_a_fused_head_update_on_two_ranks_equals_one_unfused_rank(
    runs, tmp_path_factory, tiny_model_dir, ds_test_config, free_port
):
    """The fused head 2 positions a chunk: the ranks' micro-batches need different numbers of chunks, each of
    which gathers the ZeRO-3 output layer, so the count must be agreed; the update is the unfused one-rank one."""
    two, _ = launch(tmp_path_factory, tiny_model_dir, ds_test_config, free_port, "--fused-head-chunk", "2", alone=False)
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["metrics"] == reports[1]["metrics"]
    for report in reports:
        assert report["logprob_diff_before_update"] < 1e-5 and report["logprob_diff_after_update"] < 1e-5
    params_two, params_one = torch.load(two / "params_world2.pt"), torch.load(runs[1] / "params_world1.pt")
    worst = max((params_two[k] - params_one[k]).abs().max().item() for k in params_one)
    assert worst < 1e-6, worst


def test_a_mixture_of_experts_trains_on_two_ranks_as_on_one_and_reaches_the_rollout_under_its_checkpoint_names(
    tmp_path_factory, deepspeed_cpu_ops, moe_model_dir, ds_test_config, free_port
):
    """A tiny Qwen3-MoE (8 experts, top 2) on ZeRO-3 with offload, every tensor partitioned: the ranks route their
    own rows to different experts, the push (checkpoint names, one tensor per expert) leaves the rollout copies
    scoring like the actor, and 2 ranks train as 1 rank on the whole batch."""
    two, one = launch(tmp_path_factory, moe_model_dir, ds_test_config, free_port)
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["metrics"] == reports[1]["metrics"] and reports[0]["param_sum"] == reports[1]["param_sum"]
    counts = [report["expert_counts"] for report in reports]
    assert len(counts[0]) == 4 and counts[0].keys() == counts[1].keys()  # a router per layer
    assert counts[0] != counts[1]
    for report in reports:
        assert report["logprob_diff_before_update"] < 1e-5 and report["logprob_diff_after_update"] < 1e-5
        assert report["actor_change_on_first_samples"] > 1e-3
    params_two, params_one = torch.load(two / "params_world2.pt"), torch.load(one / "params_world1.pt")
    assert params_two.keys() == params_one.keys() and any(k.endswith("mlp.experts.gate_up_proj") for k in params_one)
    worst = max((params_two[k] - params_one[k]).abs().max().item() for k in params_one)
    assert worst < 1e-6, worst
