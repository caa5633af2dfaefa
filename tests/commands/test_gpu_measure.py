"""bench/gpu_measure.sh --smoke on CPU: the five steps of the GPU sitting run end to end at tiny sizes, and
the table and its JSON carry every step's rows with finite numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

STEPS = ("toolchain", "gpu_check", "logits_head", "recipe_geometry", "grad_accum_dtype")
# Rows each measuring step must report (a name fragment), besides its exit code and seconds.
EXPECTED = {
    "gpu_check": ("actor update throughput", "weight push", "generation throughput", "prob diff max"),
    "logits_head": ("old.median_seconds", "new.median_seconds", "new.median_peak_gib"),
    "recipe_geometry": tuple(
        f"{case} {phase} {what}"
        for case in ("grpo", "opo", "otb")
        for phase in ("log-probs", "update")
        for what in ("s per micro-batch", "throughput")
    ),
    "grad_accum_dtype": (
        "gradient rel L2 error",
        "gradient 1 - cosine",
        "bf16 accumulation update",
        "fp32 accumulation update",
        "bf16 accumulation buffer",
        "fp32 accumulation buffer",
    ),
}
# Rows that only a CUDA device fills: n/a (None) in the smoke.
DEVICE_ONLY = ("MFU", "memory freed by sleep", "peak memory", "min free device memory")


# a rehearsal of the GPU sitting (90 s): run it before one; gpu_check's smoke stays in the default run
@pytest.mark.slow
def test_smoke_writes_every_step_with_finite_numbers(tmp_path, deepspeed_cpu_ops):
    # Without the process group settings an in-process test left behind (its port is taken): each step's
    # process picks a free port of its own.
    left = ("WHEELS", "PEAK_TFLOPS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
    env = {key: value for key, value in os.environ.items() if key not in left}
    env.update(OUT=str(tmp_path), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_measure.sh"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]

    report = json.loads((tmp_path / "gpu_measure.json").read_text())
    assert report["smoke"] and report["optimizer"] == "recipe"
    steps = {step["name"]: step for step in report["steps"]}
    assert tuple(steps) == STEPS
    assert all(step["rc"] == 0 for step in steps.values()), {name: step["rc"] for name, step in steps.items()}
    assert steps["toolchain"]["facts"]["missing packages"] == []
    assert steps["toolchain"]["facts"]["optimizer op problem"] is None
    table = (tmp_path / "gpu_measure.md").read_text()
    for name, fragments in EXPECTED.items():
        values = {row["name"]: row["value"] for row in steps[name]["metrics"]}
        for fragment in fragments:
            matches = [row for row in values if fragment in row]
            assert matches, (name, fragment, sorted(values))
            for row in matches:
                assert f"| {name} | {row} |" in table, (name, row)
        for row, value in values.items():
            if any(part in row for part in DEVICE_ONLY):
                assert value is None, (name, row, value)
            else:
                assert value is not None and math.isfinite(value), (name, row, value)
    # The smoke's accumulation buffers are what the keys asked for: bf16 takes half of fp32's bytes.
    buffers = {row["name"]: row for row in steps["grad_accum_dtype"]["metrics"] if "buffer" in row["name"]}
    assert "(bfloat16)" in buffers["bf16 accumulation buffer"]["unit"]
    assert "(float32)" in buffers["fp32 accumulation buffer"]["unit"]
    assert buffers["fp32 accumulation buffer"]["value"] == 2 * buffers["bf16 accumulation buffer"]["value"]
