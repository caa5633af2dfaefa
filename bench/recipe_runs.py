"""Training runs of a recipe's CPU command for the learning benches (bench/distillation.py, bench/reward_model.py):
each in a child process on one thread, tracked into one MLflow store, its metrics read back by step."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(
    recipe: list[str], name: str, overrides: list[str], *, steps: int, experiment: str, out: Path, runs
) -> tuple[str, int, float]:
    """``scripts/train.py`` on ``recipe`` (config files, left to right) and ``overrides`` for ``steps`` steps in a
    child process, tracked as run ``name`` of ``experiment`` into ``out``/mlflow.db, its output in
    ``out``/runs/``name``.log: (name, exit code, wall seconds). ``runs``: the ``ChildRuns`` it registers with."""
    from dsrl.commands.tiny_runs import run_logged

    command = [
        sys.executable, "scripts/train.py", *recipe, *overrides,
        f"trainer.total_training_steps={steps}", "trainer.logger=[console,mlflow]",
        f"trainer.project_name={experiment}", f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={out / 'runs' / name}",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    begin = time.perf_counter()
    code, _ = run_logged(command, out / "runs" / f"{name}.log", cwd=ROOT, env=env, runs=runs)
    return name, code, time.perf_counter() - begin


def history(client, run_id: str, key: str) -> dict[int, float]:
    """A dsrl metric of one run by step (``key`` as dsrl names it; MLflow stores it under ``compare.mlflow_name``)."""
    from dsrl.commands import compare

    return {m.step: m.value for m in client.get_metric_history(run_id, compare.mlflow_name(key))}
