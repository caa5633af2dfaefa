"""Ulysses sequence parallelism on two CPU ranks under the real ``deepspeed`` launcher: the same actors (every
``loss_agg_mode``, prompt deduplication with the fused head, LoRA, an on-policy update that records its old
log-probs), reference and critic with ``ulysses_sequence_parallel_size=2`` as with 1
(``tests/helpers/sequence_parallel_worker.py``): per-token log-probs, entropy and values within 1e-6, the updated
parameters within 1e-6, the metrics within 1e-5."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parents[1] / "helpers" / "sequence_parallel_worker.py"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deepspeed_cpu_ops, tiny_model_dir, ds_test_config, free_port):
    """Each rank's report with SP 1 and 2."""
    actor, ref = ds_test_config("zero3_offload", optimizer={"eps": 1.0}), ds_test_config("zero3_offload_inference")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "2"}
    reports = {}
    for sp in (1, 2):
        out = tmp_path_factory.mktemp(f"sp{sp}")
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port"]
        command += [str(free_port()), str(WORKER), "--out", str(out), "--model", str(tiny_model_dir)]
        command += ["--ds-config", actor, "--ref-ds-config", ref, "--sp", str(sp)]
        result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        reports[sp] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return reports


def test_two_sequence_parallel_ranks_score_and_train_as_data_parallel_ones(runs):
    assert [r["ulysses_attentions"] for r in runs[2]] != [0, 0]  # ALST's attention ran
    assert [r["ulysses_attentions"] for r in runs[1]] == [0, 0]
    for one, two in zip(runs[1], runs[2], strict=True):
        torch.testing.assert_close(two["ref"], one["ref"], atol=1e-6, rtol=0)
        cases = [case for case in one if isinstance(one[case], dict) and case != "critic"]
        assert len(cases) == 7
        for case in cases:
            for key in ("old_log_probs", "entropy"):
                torch.testing.assert_close(two[case]["before"][key], one[case]["before"][key], atol=1e-6, rtol=0)
            torch.testing.assert_close(two[case]["after"], one[case]["after"], atol=2e-6, rtol=0)
            if one[case]["recorded"] is not None:  # the on-policy update's own rows, also another member's turn
                assert one[case]["recorded"].keys() == two[case]["recorded"].keys() == {"old_log_probs", "entropy"}
                for key, value in one[case]["recorded"].items():
                    torch.testing.assert_close(two[case]["recorded"][key], value, atol=1e-6, rtol=0)
            assert (one[case]["after"] - one[case]["before"]["old_log_probs"]).abs().max() > 1e-3  # it trained
            metrics = one[case]["metrics"]
            assert metrics.keys() == two[case]["metrics"].keys()
            for key, value in metrics.items():
                assert math.isclose(two[case]["metrics"][key], value, rel_tol=1e-5, abs_tol=1e-6), (case, key)
            if "params" in one[case]:
                worst = max((two[case]["params"][k] - p).abs().max().item() for k, p in one[case]["params"].items())
                assert worst < 1e-6, (case, worst)


def test_a_sequence_parallel_critic_values_and_trains_as_a_data_parallel_one(runs):
    for one, two in zip(runs[1], runs[2], strict=True):
        one, two = one["critic"], two["critic"]
        assert one["ulysses_attentions"] == 0 and two["ulysses_attentions"] > 0  # the critic's own forwards split
        assert (one["before"] != 0).any()
        torch.testing.assert_close(two["before"], one["before"], atol=1e-6, rtol=0)
        torch.testing.assert_close(two["after"], one["after"], atol=2e-6, rtol=0)
        assert (one["after"] - one["before"]).abs().max() > 1e-3  # it trained
        assert one["metrics"].keys() == two["metrics"].keys()
        assert 0 < one["metrics"]["critic/vf_clipfrac"] < 1  # both sides of the clipped value loss ran
        for key, value in one["metrics"].items():
            assert math.isclose(two["metrics"][key], value, rel_tol=1e-5, abs_tol=1e-6), key
        if "params" in one:
            worst = max((two["params"][k] - p).abs().max().item() for k, p in one["params"].items())
            assert worst < 1e-6, worst
