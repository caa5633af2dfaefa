"""Experiment tracking: a console line per step and, when configured, MLflow.

Only rank 0 logs. A tracking failure never stops training: it is counted, warned about once per
kind, and reported as ``tracking/failures`` on the console.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from typing import Any

# Metrics shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "critic/vf_loss",
    "response_length/mean",
    "training/rollout_probs_diff_mean",
    "timing_s/step",
    "tracking/failures",
)
_MLFLOW_FORBIDDEN = re.compile(r"[^A-Za-z0-9_\-./ ]")


def sanitize_metric_name(name: str) -> str:
    """MLflow accepts only letters, digits, ``_ - . /`` and space: ``val/pass@1`` -> ``val/pass_at_1``."""
    return _MLFLOW_FORBIDDEN.sub("_", name.replace("@", "_at_"))


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class ConsoleBackend:
    def __init__(self, total_steps: int):
        self.total_steps = total_steps

    def log_params(self, params: dict[str, Any]) -> None:
        pass  # the resolved config is printed once at start-up by scripts/train.py

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        keys = [k for k in CONSOLE_KEYS if k in metrics]
        keys[1:1] = sorted(k for k in metrics if k.startswith("val-core/") and k.rpartition("/")[2].startswith("mean@"))
        shown = [f"{k}={metrics[k]:.4g}" for k in keys]
        width = len(str(self.total_steps))
        print(f"[dsrl] step {step:>{width}}/{self.total_steps} " + " ".join(shown), flush=True)

    def finish(self) -> None:
        pass


class MLflowBackend:
    """One MLflow run: experiment = trainer.project_name, run name = trainer.experiment_name; a
    resumed training run continues its MLflow run (``run_id``)."""

    def __init__(self, project_name: str, experiment_name: str, run_id: str | None = None):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
        if run_id is not None:
            self.run = mlflow.start_run(run_id=run_id)
        else:
            mlflow.set_experiment(project_name)
            self.run = mlflow.start_run(run_name=experiment_name)

    def log_params(self, params: dict[str, Any]) -> None:
        self.mlflow.log_params({sanitize_metric_name(k): v for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        finite = {sanitize_metric_name(k): v for k, v in metrics.items() if math.isfinite(v)}
        self.mlflow.log_metrics(finite, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class Tracker:
    """Fans out params and metrics to the configured backends on rank 0; inert on other ranks."""

    def __init__(
        self,
        loggers: list[str],
        *,
        project_name: str,
        experiment_name: str,
        total_steps: int,
        rank: int,
        run_id: str | None = None,
    ):
        self.backends: list[Any] = []
        self.failures = 0
        if rank != 0:
            return
        for name in loggers:
            if name == "console":
                self.backends.append(ConsoleBackend(total_steps))
            elif name == "mlflow":
                backend = self._guarded("start", lambda: MLflowBackend(project_name, experiment_name, run_id))
                if backend is not None:
                    self.backends.append(backend)

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (rank 0, when MLflow is on and started), else None."""
        runs = [backend.run.info.run_id for backend in self.backends if isinstance(backend, MLflowBackend)]
        return runs[0] if runs else None

    def _guarded(self, what: str, call):
        try:
            return call()
        except Exception as error:  # tracking must never stop training
            self.failures += 1
            warnings.warn(f"tracking: {what} failed ({type(error).__name__}: {error}); training continues")
            return None

    def log_params(self, params: dict[str, Any]) -> None:
        for backend in self.backends:
            self._guarded(f"{type(backend).__name__}.log_params", lambda: backend.log_params(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.failures:
            metrics = {**metrics, "tracking/failures": float(self.failures)}
        for backend in self.backends:
            self._guarded(f"{type(backend).__name__}.log_metrics", lambda: backend.log_metrics(metrics, step))

    def finish(self) -> None:
        for backend in self.backends:
            self._guarded(f"{type(backend).__name__}.finish", backend.finish)
        sys.stdout.flush()
