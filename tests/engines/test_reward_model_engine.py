"""The reward-model engine on a tiny ``Qwen3ForSequenceClassification``: its scores equal a single-process transformers
forward of each sequence alone (fp32, within 1e-5), under ZeRO-3 with and without parameter offload, by row count and
by token budget, on one rank in-process and on two ranks under the real launcher (the ranks score different numbers of
rows); a causal LM is refused with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrl.engines.reward_model import micro_batches
from tests.helpers.reward_model_worker import sequences

WORKER = Path(__file__).parents[1] / "helpers" / "reward_model_worker.py"
REPO = Path(__file__).resolve().parents[2]


def transformers_scores(model_dir: Path, rows: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.tensor([model(input_ids=torch.tensor([row])).logits[0, 0].item() for row in rows])


def test_micro_batches_sort_by_length_and_keep_the_budget():
    lengths = [5, 1, 9, 3, 4, 2]
    assert micro_batches(lengths, micro_batch_size=4, max_token_len=None) == [[1, 5, 3, 4], [0, 2]]
    parts = micro_batches(lengths, micro_batch_size=1, max_token_len=12)
    assert sorted(i for part in parts for i in part) == list(range(6))
    assert all(len(part) * max(lengths[i] for i in part) <= 12 or len(part) == 1 for part in parts)
    assert parts == [[1, 5, 3], [4, 0], [2]]  # lengths 1, 2, 3 | 4, 5 | 9: a fourth row of 4 would make 16 > 12
    assert micro_batches([20], micro_batch_size=1, max_token_len=12) == [[0]]  # a row longer than the budget alone


@pytest.mark.e2e
@pytest.mark.parametrize("offload", ["cpu", "none"], ids=["zero3_offload", "zero3"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "budget"])
def test_scores_equal_a_transformers_forward(
    world_of_one, make_cfg, ds_test_config, tiny_reward_model_dir, offload, dynamic
):
    from dsrl.engines import RewardModelEngine

    ds = ds_test_config("zero3_offload_inference", offload_param={"device": offload})
    cfg = make_cfg(
        "reward_model.enable=true",
        f"reward_model.model.path={tiny_reward_model_dir}",
        f"reward_model.deepspeed_config={ds}",
        "reward_model.micro_batch_size_per_gpu=3",
        f"reward_model.use_dynamic_bsz={dynamic}",
        "reward_model.forward_max_token_len_per_gpu=50",
    )
    engine = RewardModelEngine(cfg)
    rows = sequences(0) + sequences(1)
    got = engine.score(rows)
    want = transformers_scores(tiny_reward_model_dir, rows)
    assert got.dtype == torch.float32 and got.shape == (len(rows),)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got, want)
    assert want.std() > 1e-3  # the rows score differently: a shuffled order would fail
    assert engine.score([]).shape == (0,)  # a rank with no rows still runs the agreed forwards
    tally = engine.tallies["reward_model"]
    assert tally.tokens == sum(len(row) for row in rows) and tally.micro_batches >= 3


@pytest.mark.e2e
def test_a_causal_lm_is_refused(world_of_one, make_cfg, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from dsrl.engines.reward_model import score_head_problem

    two_labels = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    problem = score_head_problem(two_labels, str(tiny_model_dir))
    assert problem is not None and "a score head with 2 labels" in problem and "Fix:" in problem


@pytest.mark.dist
@pytest.mark.parametrize(
    "dynamic", [pytest.param(False, marks=pytest.mark.slow), True], ids=["rows", "budget"]
)  # both give the ranks different numbers of micro-batches; one in the default run
def test_two_ranks_score_their_own_rows(
    tmp_path, deepspeed_cpu_ops, tiny_reward_model_dir, ds_test_config, free_port, dynamic
):
    ds = ds_test_config("zero3_offload_inference")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    extra = ["--dynamic"] if dynamic else []
    command = [*launcher, str(WORKER), "--out", str(tmp_path), "--model", str(tiny_reward_model_dir)]
    result = subprocess.run(
        [*command, "--ds-config", ds, *extra], env=env, cwd=REPO, capture_output=True, text=True, timeout=420
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["sequences"] == sequences(rank)
        want = transformers_scores(tiny_reward_model_dir, out["sequences"])
        assert torch.allclose(torch.tensor(out["scores"]), want, atol=1e-5, rtol=0)
