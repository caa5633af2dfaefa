"""scripts/gpu_check.py on CPU: ``--smoke`` runs the GPU check's code end to end (tiny Qwen2, ZeRO-3
with CPU offload, transformers rollout), and ``--smoke --lora`` its LoRA case (ZeRO-3 with FusedAdam, the
actor's states offloaded and reloaded around every generation, merged and adapter pushes); a missing
dependency, or a FusedAdam that cannot build, stops it with exit 2 and one line before dsrl is imported."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "scripts" / "gpu_check.py"
# No device in these runs: nothing to measure, and no known peak for an MFU.
DEVICE_ONLY = (
    "actor update MFU (6N)",
    "actor states on device in generation",
    "actor states on device after reload",
    "memory freed by sleep",
    "peak memory allocated",
    "min free device memory",
)
PROB_DIFFS = ("prob diff mean", "prob diff max")


def run_smoke(out, *args, **env) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PEAK_TFLOPS"}
    environment.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUT=str(out), **env)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def shadowing(tmp_path, *modules) -> str:
    """A PYTHONPATH on which importing any of ``modules`` fails, as where they are not installed."""
    shadow = tmp_path / "shadow"
    for module in modules:
        (shadow / module).mkdir(parents=True)
        (shadow / module / "__init__.py").write_text(
            f"raise ModuleNotFoundError('{module} hidden by the test', name='{module}')\n"
        )
    return os.pathsep.join([str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])])


def test_smoke_check_reports_every_cpu_metric(tmp_path, free_port, deepspeed_cpu_ops):
    # The GPU machine has torch and gets the check's REQUIRED packages as wheels: nothing of the training
    # stack's data, tracking or reward side may be needed (pebble: the reward pool).
    pythonpath = shadowing(tmp_path, "pyarrow", "mlflow", "datasets", "pebble")
    result = run_smoke(tmp_path, MASTER_PORT=str(free_port()), PYTHONPATH=pythonpath)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "transformers rollout" in report["header"]
    assert "(DeepSpeedCPUAdam)" in report["header"] and "NOT measured" not in report["header"]
    assert report["header"] in result.stdout
    values = {row["name"]: row["value"] for row in report["metrics"]}
    for name in DEVICE_ONLY:
        assert values[name] is None, name
    # The offload config keeps the actor's states in host memory: nothing to offload (the LoRA case's zero3 has).
    assert values.pop("actor states offloaded") == 0
    for name, value in values.items():
        if name in DEVICE_ONLY:
            continue
        assert math.isfinite(value), (name, value)
        assert value >= 0 if name in PROB_DIFFS else value > 0, (name, value)
    # float32 on both sides measures ~1e-5. A push that left the rollout at the saved weights (which the
    # warm-up update has moved) measures ~0.08, random vocabulary-padding rows ~0.95.
    assert values["prob diff max"] < 1e-4


def test_lora_smoke_offloads_and_reloads_around_merged_and_adapter_pushes(tmp_path, free_port, deepspeed_cpu_ops):
    pythonpath = shadowing(tmp_path, "pyarrow", "mlflow", "datasets", "pebble")
    result = run_smoke(tmp_path, "--lora", "32", MASTER_PORT=str(free_port()), PYTHONPATH=pythonpath)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    report = json.loads((tmp_path / "gpu_check_lora.json").read_text())
    assert not (tmp_path / "gpu_check.json").exists()
    assert "actor zero3 (FusedAdam)" in report["header"] and "LoRA rank 32, alpha 32, all-linear" in report["header"]
    assert report["header"] in result.stdout
    values = {row["name"]: row["value"] for row in report["metrics"]}
    assert 0 < values["trained parameters"] < values["model parameters"]
    for mode in ("merged", "adapter"):
        rows = {name.removesuffix(f" ({mode} pushes)"): value for name, value in values.items() if f"({mode} " in name}
        assert "actor update MFU (6N)" not in rows  # 6N counts gradients of the frozen weights
        for name in DEVICE_ONLY:
            assert rows.pop(name, None) is None, (mode, name)
        for name, value in rows.items():
            assert value is not None and math.isfinite(value), (mode, name, value)
            assert value >= 0 if name in PROB_DIFFS else value > 0, (mode, name, value)
        # Both rounds offloaded the states (ZeRO-3's gradient bucket and partition, the adapters' Adam state) and
        # reloaded them: each round's update ran after its reload.
        assert rows["actor states offloaded"] > 0 and rows["actor update throughput"] > 0
        # float32: each push reproduces the actor's policy to rounding (the warm-up update has moved the adapters,
        # which the KL to the adapter-off reference shows).
        assert rows["prob diff max"] < 1e-4 and rows["KL to the reference"] > 0


@pytest.mark.parametrize(
    ("hidden", "named"),
    [("deepspeed", "deepspeed"), ("yaml", "pyyaml"), ("tokenizers", "tokenizers"), ("peft", "peft")],
)
def test_missing_package_exits_2_naming_it_and_wheels(tmp_path, hidden, named):
    result = run_smoke(tmp_path, PYTHONPATH=shadowing(tmp_path, hidden))

    assert result.returncode == 2, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stderr, result.stderr
    message = [line for line in result.stderr.splitlines() if line.startswith("[gpu_check]")]
    assert len(message) == 1 and message[0].startswith("[gpu_check] missing "), result.stderr
    assert f" {named}," in message[0] or f" {named}:" in message[0], message[0]
    assert "WHEELS=" in message[0], message[0]
    assert not (tmp_path / "gpu_check.json").exists()


def test_fused_adam_that_cannot_build_exits_2_unless_adamw(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        gpu_check, "op_problem", lambda builder: f"{builder}: MissingCUDAException: CUDA_HOME does not exist"
    )
    ran = []
    monkeypatch.setattr(gpu_check, "run", lambda size, optimizer, out, started, lora_rank: ran.append(optimizer))

    assert gpu_check.main([]) == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "FusedAdam" in message[0] and "CUDA_HOME" in message[0], message
    assert "--optimizer adamw" in message[0] and ran == []

    assert gpu_check.main(["--optimizer", "adamw"]) == 0
    assert ran == ["adamw"]
