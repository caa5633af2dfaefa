"""scripts/train.py on inputs that pass validation but fail to load (issue 13, part 3): the problem is one line in
the form of a config error, exit code 2, no traceback, before any model loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import QUICKSTART

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def train(overrides, free_port, tmp_path):
    env = {**os.environ, "WORLD_SIZE": "1", "MASTER_PORT": str(free_port())}
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            *QUICKSTART,
            *overrides,
            f"trainer.default_local_dir={tmp_path / 'out'}",
            "trainer.logger=[console]",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def assert_refused(result, line):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    header, *problems = result.stderr.strip().splitlines()[-2:]
    assert header.endswith("1 problem(s) in the files the configuration names:"), result.stderr[-3000:]
    assert problems[0].startswith(f"  {line}"), problems
    assert "start-up summary" not in result.stdout  # nothing was built


def test_a_bad_row_and_a_tokenizer_larger_than_the_model_stop_before_any_model_loads(
    tiny_model_dir, arithmetic_data, free_port, tmp_path
):
    rows = pq.read_table(arithmetic_data / "train.parquet").to_pylist()[:8]
    rows[5]["prompt"][0]["role"] = "human"  # ShareGPT's name for the user
    bad = tmp_path / "sharegpt.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad)
    data = [
        f"data.train_files={bad}",
        f"data.val_files={arithmetic_data / 'test.parquet'}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
    ]
    assert_refused(train(data, free_port, tmp_path), f"{bad} row 5: 'prompt' holds a message with role 'human'")

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"vocab_size": 64}))
    data = [
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        f"data.val_files={arithmetic_data / 'test.parquet'}",
        f"actor_rollout_ref.model.path={model}",
    ]
    assert_refused(
        train(data, free_port, tmp_path),
        f"actor_rollout_ref.model.path={model}: the tokenizer has 100 tokens, more than the model's vocab_size=64",
    )
