"""What the dsrl-eval tests share (the main tests, the 2-rank tier and the vLLM tier): ``dsrl-eval`` run as this
checkout runs it, in a process of its own, and the checks of its report against its own rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsrl.commands.evaluate import pass_at_k, pass_sizes
from dsrl.runtime.launch import LAUNCHER_VARIABLES
from dsrl.trainer.metrics import validation_metrics
from tests.conftest import REPO

PROMPTS = 5


def run_eval(args: list[str], store: str, *, launcher=(), timeout: int = 300) -> subprocess.CompletedProcess:
    """``dsrl-eval args`` as this checkout runs it (``python -m dsrl.commands.evaluate``, the installed command's
    function), in a process of its own (under ``launcher``, e.g. the deepspeed runner's arguments before
    ``--module``)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "MLFLOW_TRACKING_URI": store,
            "DEEPSPEED_TIMEOUT": "3",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
    )
    command = (
        [*launcher, "--module", "dsrl.commands.evaluate"]
        if launcher
        else [sys.executable, "-m", "dsrl.commands.evaluate"]
    )
    return subprocess.run([*command, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def check_report(report: dict, n: int, correct) -> None:
    """The report's numbers against its own rows: each prompt's mean@n, correct count and pass@k, the data source's
    averages of them, and every validation metric as ``validation_metrics`` of the rows (``correct(response)``:
    whether a response counts for pass@k)."""
    [model] = report["models"]
    prompts, metrics = model["prompts"], model["metrics"]
    assert [p["index"] for p in prompts] == list(range(PROMPTS))
    for prompt in prompts:
        scores = [r["score"] for r in prompt["responses"]]
        assert len(scores) == n
        assert prompt[f"mean@{n}"] == pytest.approx(sum(scores) / n)
        assert prompt["correct"] == sum(map(correct, prompt["responses"]))
        assert prompt["pass"] == {f"pass@{k}": pytest.approx(pass_at_k(n, prompt["correct"], k)) for k in pass_sizes(n)}
    for k in pass_sizes(n):
        average = sum(p["pass"][f"pass@{k}"] for p in prompts) / PROMPTS
        assert metrics[f"eval/arithmetic/pass@{k}"] == pytest.approx(average)
    average = sum(p[f"mean@{n}"] for p in prompts) / PROMPTS
    assert metrics[f"val-core/arithmetic/reward/mean@{n}"] == pytest.approx(average)
    assert model["score"] == metrics["eval/score"] == metrics[f"val-core/arithmetic/reward/mean@{n}"]
    rows = [(p["index"], r) for p in prompts for r in p["responses"]]
    extras = sorted(set(rows[0][1]) - {"response", "score"})
    expected = validation_metrics(
        ["arithmetic"] * len(rows),
        [index for index, _ in rows],
        {"reward": [r["score"] for _, r in rows], **{name: [r[name] for _, r in rows] for name in extras}},
    )
    validation = {k: v for k, v in metrics.items() if k.startswith(("val-core/", "val-aux/arithmetic/"))}
    assert validation == pytest.approx(expected)


def common(arithmetic_data) -> list[str]:
    return ["--data", str(arithmetic_data / "test.parquet"), "--config", "cpu", "--max-samples", str(PROMPTS)]
