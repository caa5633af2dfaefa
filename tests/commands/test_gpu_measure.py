"""bench/gpu_measure.sh --smoke on CPU: the steps of the GPU sitting (the LoRA case's included) run end to end at
tiny sizes, the table and its JSON carry every step's rows with finite numbers, and the timeouts fit the budget."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "bench" / "gpu_measure.sh"
STEPS = (
    "toolchain",
    "gpu_check",
    "gpu_check_lora",
    "grad_accum_dtype_zero3",
    "grad_accum_dtype_zero3_offload",
)
GRAD_ACCUM_ROWS = (
    "gradient rel L2 error",
    "gradient 1 - cosine",
    "bf16 accumulation update",
    "fp32 accumulation update",
    "bf16 accumulation buffer",
    "fp32 accumulation buffer",
)
# Rows each measuring step must report (a name fragment), besides its exit code and seconds.
EXPECTED = {
    "gpu_check": ("actor update throughput", "trainer memory release", "weight push", "prob diff max"),
    "gpu_check_lora": tuple(
        f"{row} ({mode} pushes)"
        for mode in ("merged", "adapter")
        for row in (
            "trainer memory release",
            "actor states offloaded",
            "prob diff mean",
            "prob diff max",
            "KL to the reference",
        )
    ),
    "grad_accum_dtype_zero3": GRAD_ACCUM_ROWS,
    "grad_accum_dtype_zero3_offload": GRAD_ACCUM_ROWS,
}
# Rows that only a CUDA device fills: n/a (None) in the smoke.
DEVICE_ONLY = ("MFU", "on device", "memory freed by sleep", "peak memory", "min free device memory")


def test_the_step_timeouts_fit_the_budget_with_the_table_reserve():
    # The sitting must leave time for a rerun inside a lent GPU's 15 minutes; a step's timeout beyond what is left
    # is cut, so one that outgrew the budget would end a later step early instead of failing here.
    text = SCRIPT.read_text()
    budget = int(re.search(r'BUDGET_S="\$\{BUDGET_S:-\$\(\((\d+) \* SLACK\)\)\}"', text).group(1))
    reserve = int(re.search(r"local left=\$\(\(BUDGET_S - (\d+) - SECONDS\)\)", text).group(1))
    timeouts = dict(re.findall(r"^step (\S+) (\d+) ", text, flags=re.MULTILINE))
    assert tuple(timeouts) == STEPS
    assert budget <= 330 and sum(map(int, timeouts.values())) + reserve <= budget, (budget, reserve, timeouts)


# a rehearsal of the GPU sitting (~2 min, more on a loaded machine): run it before one; gpu_check's smokes stay in
# the default run
@pytest.mark.slow
def test_smoke_writes_every_step_with_finite_numbers(tmp_path, deepspeed_cpu_ops):
    # Without the process group settings an in-process test left behind (its port is taken): each step's
    # process picks a free port of its own.
    left = ("WHEELS", "PEAK_TFLOPS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
    env = {key: value for key, value in os.environ.items() if key not in left}
    env.update(OUT=str(tmp_path), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["bash", str(SCRIPT), "--smoke"],
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
    # The LoRA case ran the GPU path's offload and reload on zero3 (the full check's offload config has nothing
    # to offload), and each push mode's rollout agreed with the actor (float32).
    lora = {row["name"]: row["value"] for row in steps["gpu_check_lora"]["metrics"]}
    for mode in ("merged", "adapter"):
        assert lora[f"actor states offloaded ({mode} pushes)"] > 0
        assert lora[f"prob diff max ({mode} pushes)"] < 1e-4
    for config in ("zero3", "zero3_offload"):
        step = steps[f"grad_accum_dtype_{config}"]
        assert f"] cpu; {config} (" in step["header"]  # the --config each step was given
        # The smoke's accumulation buffers are what the keys asked for: bf16 takes half of fp32's bytes.
        buffers = {row["name"]: row for row in step["metrics"] if "buffer" in row["name"]}
        assert "(bfloat16)" in buffers["bf16 accumulation buffer"]["unit"]
        assert "(float32)" in buffers["fp32 accumulation buffer"]["unit"]
        assert buffers["fp32 accumulation buffer"]["value"] == 2 * buffers["bf16 accumulation buffer"]["value"]
