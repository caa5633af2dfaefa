"""scripts/compare_tools.py's arms at the smallest size: each trains a step and reports every column. The untrained
tiny model stands in for the tool model (same tokenizer and chat template): it never writes a call, so this checks
the comparison's plumbing, not that tools help."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_every_arm_trains_and_fills_the_table(
    tiny_model_dir, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    script = runpy.run_path(str(REPO / "scripts" / "compare_tools.py"))
    data = tmp_path / "calculator"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "prepare_data.py"),
            "--task",
            "calculator",
            "--out",
            str(data),
            "--train-size",
            "8",
            "--test-size",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    args = script["parse_args"](
        [
            "--steps",
            "1",
            "--batch",
            "1",
            "--n",
            "4",
            "--val-size",
            "2",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "data.max_response_length=24",
            "actor_rollout_ref.rollout.val_kwargs.n=1",
        ]
    )
    results = {}
    for i, name in enumerate(args.arms):
        files, overrides = script["arm_overrides"](args, name)
        results[name] = script["run_arm"](files, overrides, tmp_path / str(i))
    for r in results.values():
        assert r["steps"] == 1 and 0 < r["gen_tokens"] <= r["resp_tokens"] <= 4 * 24
        assert all(0.0 <= v <= 1.0 for v in (*r["val_acc"], *r["val_calls"]))
    lines = script["format_table"](results)
    assert [line.split()[0] for line in lines[2:]] == ["grpo-tools", "tir-otb-tools", "grpo-no-tools"]
