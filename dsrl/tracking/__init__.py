"""Experiment tracking: the console (``dsrl.tracking.console.ProgressConsole``) and, when configured, MLflow.

Only rank 0 logs; on other ranks the :class:`Tracker` is inert and never imports mlflow. A tracking
failure never stops training: it is counted (``failures``; lost metric values in ``dropped``),
warned about once per kind, and shown as ``tracking/failures`` / ``tracking/dropped`` on the next
step's metrics. Secrets are redacted from everything MLflow receives (:mod:`dsrl.runtime.redaction`).
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
from typing import Any

from dsrl.runtime.redaction import is_secret_name, redact, redact_text
from dsrl.tracking.console import ProgressConsole
from dsrl.tracking.mlflow_backend import STATUSES, MLflowBackend, default_tracking_uri, sanitize_metric_name

__all__ = ["MLflowBackend", "Tracker", "flatten", "is_secret_name", "redact", "redact_text", "sanitize_metric_name"]


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


class Tracker:
    """Fans out params, metrics and artifacts to the configured backends on rank 0; inert elsewhere.

    ``failures`` counts failed tracking calls, ``dropped`` the metric values that never reached
    MLflow (failed sends, a full queue, calls left unsent at ``finish``). NaN/inf metric values are
    left out of MLflow (MLflow cannot plot them) and not counted; the console still shows them.
    """

    def __init__(
        self,
        loggers: list[str],
        *,
        project_name: str,
        experiment_name: str,
        total_steps: int,
        rank: int,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        initial_step: int = 0,
    ):
        self.backends: list[Any] = []
        self.failures = 0
        self.dropped = 0
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._mlflow: MLflowBackend | None = None
        self._finished = False
        self._mlflow_wanted = rank == 0 and "mlflow" in loggers
        if rank != 0:
            return
        for name in loggers:
            if name == "console":
                self.backends.append(ProgressConsole(total_steps, initial_step=initial_step))
            elif name == "mlflow":
                self._mlflow = self._guarded(
                    "start", lambda: MLflowBackend(project_name, experiment_name, run_id, tags, report=self._report)
                )
                if self._mlflow is not None:
                    self.backends.append(self._mlflow)
                    atexit.register(self._finish_at_exit)

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (rank 0, when MLflow is on and started), else None."""
        return self._mlflow.run_id if self._mlflow is not None else None

    @property
    def tracking_uri(self) -> str | None:
        """The MLflow tracking URI in use (passwords masked), else None."""
        return redact_text(self._mlflow.tracking_uri) if self._mlflow is not None else None

    def mlflow_facts(self) -> dict[str, Any] | None:
        """For the console summaries: None when MLflow is not a logger here, else ``tracking_uri``,
        ``experiment_id`` and ``run_id`` (None when MLflow failed to start)."""
        if not self._mlflow_wanted:
            return None
        backend = self._mlflow
        return {
            "tracking_uri": redact_text(backend.tracking_uri if backend else default_tracking_uri()),
            "experiment_id": backend.experiment_id if backend else None,
            "run_id": backend.run_id if backend else None,
        }

    def console_facts(self) -> dict[str, Any]:
        """What the console backend saw (its ``facts()``), for the final summary; {} without one."""
        for backend in self.backends:
            if callable(getattr(backend, "facts", None)):
                return backend.facts()
        return {}

    def _report(self, kind: str, error: BaseException, dropped: int = 0) -> None:
        """Count a failure (and the metric values it lost); warn the first time for each kind."""
        with self._lock:
            self.failures += 1
            self.dropped += dropped
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            lost = f"; {dropped} metric values dropped" if dropped else ""
            warnings.warn(
                redact_text(
                    f"tracking: {kind} failed ({type(error).__name__}: {error}){lost}; training continues "
                    f"(further {kind} failures are only counted: tracking/failures, tracking/dropped)"
                ),
                stacklevel=2,
            )

    def _guarded(self, what: str, call):
        try:
            return call()
        except Exception as error:  # tracking must never stop training
            self._report(what, error)
            return None

    def _each(self, method: str, *args, **kwargs) -> None:
        for backend in self.backends:
            if hasattr(backend, method):
                self._guarded(
                    f"{type(backend).__name__}.{method}",
                    lambda backend=backend: getattr(backend, method)(*args, **kwargs),
                )

    def log_params(self, params: dict[str, Any]) -> None:
        """Flattened config keys; redacted, sent in batches of MLflow's per-request limit."""
        self._each("log_params", params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.failures:
            metrics = {**metrics, "tracking/failures": float(self.failures)}
        if self.dropped:
            metrics = {**metrics, "tracking/dropped": float(self.dropped)}
        self._each("log_metrics", metrics, step)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._each("log_text", text, artifact_file)

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        """JSON or YAML by the file's suffix."""
        self._each("log_dict", obj, artifact_file)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        """Rows of dicts (prompt, response, score, ...) as an MLflow table artifact (``.json``)."""
        self._each("log_table", rows, artifact_file)

    def log_model_dir(self, path, *, upload: bool, adapter_dir=None) -> None:
        """Tag ``dsrl.model_dir`` = the directory (and ``dsrl.adapter_dir`` = ``adapter_dir``, a LoRA actor's
        exported adapter, when given); with ``upload``, its files as artifacts under ``model/``."""
        self._each("log_model_dir", path, upload=upload, adapter_dir=adapter_dir)

    def finish(self, status: str = "FINISHED") -> None:
        """Drain pending calls (bounded wait), stop system metrics, end the run as FINISHED, FAILED or
        KILLED. Idempotent."""
        if status not in STATUSES:
            raise ValueError(f"tracking: status must be one of {', '.join(STATUSES)}, not {status!r}")
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._finish_at_exit)
        for backend in self.backends:
            if isinstance(backend, MLflowBackend):
                self._guarded("MLflowBackend.finish", lambda backend=backend: backend.finish(status))
            else:
                self._guarded(f"{type(backend).__name__}.finish", backend.finish)
        sys.stdout.flush()

    def _finish_at_exit(self) -> None:
        """A process that exits without ``finish()`` did not complete: send what is queued, mark FAILED."""
        self.finish("FAILED")
