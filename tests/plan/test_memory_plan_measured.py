"""The memory plan against the memory a CPU run really takes: bench/memory_plan.py measures each phase of two
quickstart steps (scripts/quickstart.sh's config, one rank, ZeRO-3 with CPU offload) and the plan of that config
(``dsrl-train --plan`` with DS_ACCELERATOR=cpu) must be within TOLERANCE of each phase's measured peak."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# The plan leaves out what it cannot know from the shapes (allocator slack, Python objects, DeepSpeed's small
# buffers): some tens of MiB, a quarter to a third of the tiny model's phases (README "dsrl-train --plan"; the 97 M
# and 135 M models' phases are within 10% but take minutes). Packed with one copy of each prompt (the CPU overlay
# since issue 39) the update's plan is ~116 MiB, and the same config measured 163 and 190 MiB in two runs: the
# absolute allowance covers those tens of MiB where the phase is that small.
TOLERANCE = 0.35
ALLOWANCE_MIB = 80


def test_the_quickstart_plan_is_within_tolerance_of_each_measured_phase(tiny_model_dir, arithmetic_data, tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "memory_plan.py"), "measure", "--cases", "quickstart", "--json", str(out),
         "--model", str(tiny_model_dir), "--data", str(arithmetic_data)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert [row["phase"] for row in rows] == ["rollout", "update_actor"]  # on-policy GRPO folds old_log_prob
    for row in rows:
        assert row["measured_mib"] > 0
        assert abs(row["error"]) <= TOLERANCE or abs(row["error"]) * row["measured_mib"] <= ALLOWANCE_MIB, row
