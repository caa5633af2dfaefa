"""scripts/gpu_check.py on CPU: ``--smoke`` runs the GPU check's code end to end (tiny Qwen2, ZeRO-3
with CPU offload, transformers rollout), and a missing dependency stops it before dsrl is imported."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
# No device in these runs: nothing to measure, and no known peak for an MFU.
DEVICE_ONLY = ("actor update MFU (6N)", "memory freed by sleep", "peak memory allocated", "min free device memory")
PROB_DIFFS = ("prob diff mean", "prob diff max")


def run_smoke(out, **env) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PEAK_TFLOPS"}
    environment.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUT=str(out), **env)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )


def shadowing(tmp_path, *modules) -> str:
    """A PYTHONPATH on which importing any of ``modules`` fails, as where they are not installed."""
    shadow = tmp_path / "shadow"
    for module in modules:
        (shadow / module).mkdir(parents=True)
        (shadow / module / "__init__.py").write_text(f"raise ImportError('{module} hidden by the test')\n")
    return os.pathsep.join([str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])])


def test_smoke_check_reports_every_cpu_metric(tmp_path, free_port, deepspeed_cpu_ops):
    # The GPU machine has torch and transformers, and gets deepspeed and a few small packages as wheels:
    # nothing of the training stack's data and tracking side may be needed.
    pythonpath = shadowing(tmp_path, "pyarrow", "mlflow", "datasets")
    result = run_smoke(tmp_path, MASTER_PORT=str(free_port()), PYTHONPATH=pythonpath)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "transformers rollout" in report["header"]
    assert report["header"] in result.stdout
    values = {row["name"]: row["value"] for row in report["metrics"]}
    for name in DEVICE_ONLY:
        assert values[name] is None, name
    for name, value in values.items():
        if name in DEVICE_ONLY:
            continue
        assert math.isfinite(value), (name, value)
        assert value >= 0 if name in PROB_DIFFS else value > 0, (name, value)
    # float32 on both sides measures ~1e-5. A push that left the rollout at the saved weights (which the
    # warm-up update has moved) measures ~0.08, random vocabulary-padding rows ~0.95.
    assert values["prob diff max"] < 1e-4


def test_missing_deepspeed_exits_2_naming_it_and_wheels(tmp_path):
    result = run_smoke(tmp_path, PYTHONPATH=shadowing(tmp_path, "deepspeed"))

    assert result.returncode == 2, result.stdout[-4000:] + result.stderr[-4000:]
    message = [line for line in result.stderr.splitlines() if line.startswith("[gpu_check]")]
    assert len(message) == 1 and "missing deepspeed" in message[0] and "WHEELS=" in message[0], result.stderr
    assert not (tmp_path / "gpu_check.json").exists()
