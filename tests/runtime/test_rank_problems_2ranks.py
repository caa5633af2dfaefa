"""A problem only one rank sees reaches the console (issue 20, part 4): two CPU ranks under the real
``deepspeed`` launcher, whose rank 1 alone meets a missing data file and a module that fails to import (found
when the config is checked), or a malformed row (found when the prompts load). Rank 0 reports every rank's
problems once, those of one rank marked with the rank and its host, and every rank exits 2: no bare
"exits with return code = 2".

Each rank's data file is ``train_<LOCAL_RANK>.parquet`` (an interpolation of the variable the launcher sets),
so the ranks of one machine see different files, as the nodes of a cluster may.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import QUICKSTART

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]


def launch(overrides, tiny_model_dir, free_port, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "3"}
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(REPO / "scripts" / "train.py"),
        *QUICKSTART,
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.val_files=null",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[console]",
        *overrides,
    ]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=480)


def test_what_one_rank_finds_in_its_config_is_reported_with_its_rank_and_host(
    tiny_model_dir, arithmetic_data, free_port, deepspeed_cpu_ops, tmp_path
):
    shutil.copy(arithmetic_data / "train.parquet", tmp_path / "train_0.parquet")  # rank 1's file is missing
    (tmp_path / "module_0.py").write_text("")
    (tmp_path / "module_1.py").write_text("raise ImportError('only on rank 1')\n")
    result = launch(
        [
            "data.train_files=" + str(tmp_path / "train_${oc.env:LOCAL_RANK}.parquet"),
            "algorithm.import_modules=['" + str(tmp_path / "module_${oc.env:LOCAL_RANK}.py") + "']",
        ],
        tiny_model_dir,
        free_port,
        tmp_path,
    )
    assert result.returncode == 2, (result.stdout + result.stderr)[-4000:]
    where = f"[rank 1 on {socket.gethostname()}]"
    report = result.stderr[result.stderr.index("dsrl: ") :]
    assert "2 problem(s) in the configuration or the cluster:" in report.splitlines()[0]
    assert f"data.train_files={tmp_path / 'train_1.parquet'}: file does not exist" in report
    assert f"import failed: ImportError: only on rank 1 at {tmp_path / 'module_1.py'}:1" in report
    assert report.count(where) == 2 and report.count("dsrl: ") == 1  # once, by rank 0


def test_what_one_rank_finds_in_its_files_when_they_load_is_reported_with_its_rank_and_host(
    tiny_model_dir, arithmetic_data, free_port, deepspeed_cpu_ops, tmp_path
):
    rows = pq.read_table(arithmetic_data / "train.parquet").to_pylist()
    shutil.copy(arithmetic_data / "train.parquet", tmp_path / "train_0.parquet")
    rows[5]["prompt"][0]["role"] = "human"  # a row the header checks cannot see
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train_1.parquet")
    result = launch(
        [
            "data.train_files=" + str(tmp_path / "train_${oc.env:LOCAL_RANK}.parquet"),
            "trainer.resume_allow_config_change=true",
        ],
        tiny_model_dir,
        free_port,
        tmp_path,
    )
    assert result.returncode == 2, (result.stdout + result.stderr)[-4000:]
    report = result.stderr[result.stderr.index("dsrl: ") :]
    assert "1 problem(s) in the files the configuration names:" in report.splitlines()[0]
    assert f"{tmp_path / 'train_1.parquet'} row 5: 'prompt' holds a message with role 'human'" in report
    assert f"[rank 1 on {socket.gethostname()}]" in report
    assert "start-up summary" not in result.stdout  # no model was loaded
