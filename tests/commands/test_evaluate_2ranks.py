"""``dsrl-eval`` on two CPU ranks under the real deepspeed launcher: the prompts sharded over the ranks (5 prompts in
chunks of 2, so one rank generates for a filler) and gathered on rank 0 give the one-process report, greedy."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.eval_runs import PROMPTS, check_report, common, run_eval

pytestmark = pytest.mark.dist


def test_two_ranks_report_what_one_process_does(
    tiny_model_dir, arithmetic_data, deepspeed_cpu_ops, free_port, tmp_path
):
    # --num-responses: --n would be taken by the launcher for its own --num_gpus
    args = [str(tiny_model_dir), *common(arithmetic_data), "--batch-size", "2", "--num-responses", "1", "--no-mlflow"]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    reports = {}
    for name, prefix in (("one", []), ("two", launcher)):
        result = run_eval([*args, "--out", str(tmp_path / f"{name}.json")], "sqlite:///unused.db", launcher=prefix)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    one, two = (reports[name]["models"][0] for name in ("one", "two"))
    assert len(two["prompts"]) == PROMPTS
    assert two["prompts"] == one["prompts"] and two["metrics"] == one["metrics"]
    assert reports["two"]["settings"] == reports["one"]["settings"]
    check_report(reports["two"], 1, lambda response: response["score"] >= 1.0)
