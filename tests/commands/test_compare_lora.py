"""scripts/compare_lora.py's full and LoRA arms at one step each, on the untrained tiny model: every column is
filled, and LoRA's trainable parameters and checkpointed actor state are the smaller ones."""

from __future__ import annotations

import runpy

import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # a measurement script's plumbing; LoRA's training runs are tests/trainer/test_trainer.py's
def test_the_full_and_lora_arms_fill_the_table(
    tiny_model_dir, arithmetic_data, deepspeed_cpu_ops, monkeypatch, tmp_path
):
    for name in LAUNCHER_VARIABLES:  # an in-process world's, if any:
        monkeypatch.delenv(name, raising=False)  # each arm is a run of its own, as from a shell
    script = runpy.run_path(str(REPO / "scripts" / "compare_lora.py"))
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        f"data.val_files={arithmetic_data / 'test.parquet'}",
        "data.val_max_samples=8",
    ]
    full, lora = (script["run_arm"](name, 1, overrides, tmp_path) for name in ("full", "lora"))
    for row in (full, lora):
        assert 0.0 <= row["val before"] <= 1.0 and 0.0 <= row["val after"] <= 1.0
        assert row["peak RSS MiB"] > 100 and row["step s"] > 0
        assert 0 < row["actor/ds MiB"] < row["checkpoint MiB"]
    assert (full["trainable"], lora["trainable"]) == ("801K", "78K")  # 4 layers x 7 linear layers x 8 x (in + out)
    assert lora["actor/ds MiB"] < full["actor/ds MiB"] / 2
    assert "| full |" in script["markdown_table"]([full, lora])
