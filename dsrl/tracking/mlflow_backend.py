"""One MLflow run, written from a background thread so that logging never blocks a training step.

* Tracking URI: ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``. Experiment = project name,
  run name = experiment name. An existing run is continued when given a ``run_id`` (from a
  checkpoint) or, failing that, ``MLFLOW_RUN_ID``.
* Calls go through :class:`mlflow.MlflowClient` (no fluent global state), one worker thread and a
  bounded queue; queued metrics are merged into ``log_batch`` calls within MLflow's limits. A failed
  call is tried once more after a short pause (only once while the previous call failed too), then
  given up and reported to the owner (``report(kind, error, dropped_metric_values)``).
* Metric names map one-to-one onto names MLflow accepts (:class:`MetricNames`): one it refused would
  fail its whole batch, two that sanitise alike would merge into one curve.
* Every tag, param and artifact is redacted (:mod:`dsrl.runtime.redaction`).
* MLflow's system metrics monitor (CPU, memory, disk, network; GPU when pynvml is importable) runs
  unless ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING`` is set false; ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``
  sets its period.

``mlflow`` is imported only when a backend is created (rank 0 with the ``mlflow`` logger).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import queue
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsrl.runtime.redaction import redact, redact_text

DEFAULT_DB = "mlflow.db"
QUEUE_SIZE = 1000  # pending calls (one per log_* call); beyond that a call is dropped, not waited for
ATTEMPTS = 2
BACKOFF_S = 0.5
DRAIN_TIMEOUT_S = 30.0  # finish() waits this long for queued calls ...
UPLOAD_TIMEOUT_S = 600.0  # ... or this long while a model directory upload is queued or running
TRUNCATED = "...[truncated by dsrl]"
STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow's HTTP client retries 7 times with exponential backoff and waits 120 s per request by
# default: minutes per call against a dead server. Set lower unless the user set them.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

Report = Callable[[str, BaseException, int], None]


_MLFLOW_FORBIDDEN = re.compile(r"[^A-Za-z0-9_\-./ ]")


def sanitize_metric_name(name: str) -> str:
    """MLflow accepts only letters, digits, ``_ - . /`` and space: ``val/pass@1`` -> ``val/pass_at_1``. It stores a
    name as a path too and refuses one that reads as another path (``a//b``, ``a/``, ``./a``, ``..a``): empty, ``.``
    and ``..`` segments become ``_``, and a leading ``..`` gets a ``_`` before it."""
    name = _MLFLOW_FORBIDDEN.sub("_", name.replace("@", "_at_"))
    name = "/".join("_" if part in ("", ".", "..") else part for part in name.split("/"))
    return f"_{name}" if name.startswith("..") else name


class MetricNames:
    """The MLflow name of each metric name, one-to-one and within MLflow's length ``limit``.

    ``sanitize_metric_name``, except where that is longer than ``limit`` or already the MLflow name of another
    metric (``a@b`` and ``a_at_b``, ``x(1)`` and ``x_1_``): then it is cut to fit a suffix ``-`` and 8 hex digits of
    the SHA-1 of the metric's own name (all 40 should another name hold that already), and a warning, once per
    name, says what it became. The first metric to arrive keeps the sanitised name.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._mlflow_name: dict[str, str] = {}
        self._metric: dict[str, str] = {}  # MLflow name -> the metric name it stands for

    def __call__(self, name: str) -> str:
        if name in self._mlflow_name:
            return self._mlflow_name[name]
        base = mlflow_name = sanitize_metric_name(name)
        if len(base) > self.limit or base in self._metric:
            digest = hashlib.sha1(name.encode()).hexdigest()
            for size in (8, len(digest)):
                mlflow_name = f"{base[: self.limit - size - 1]}-{digest[:size]}"
                if mlflow_name not in self._metric:
                    break
            why = (
                f"longer than MLflow's limit of {self.limit} characters"
                if len(base) > self.limit
                else f"{base} is the MLflow name of the metric {self._metric[base]}"
            )
            warnings.warn(f"tracking: the metric {name} is logged to MLflow as {mlflow_name} ({why})", stacklevel=3)
        self._mlflow_name[name] = mlflow_name
        self._metric[mlflow_name] = name
        return mlflow_name


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(DEFAULT_DB)}"


def _truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - len(TRUNCATED)] + TRUNCATED


def _plain(value: Any) -> Any:
    """JSON/YAML-safe copy: dicts, lists and scalars kept, anything else (paths, numpy) as str or float."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)


@contextmanager
def _sqlite_store_lock(uri: str) -> Iterator[None]:
    """Within ``with``: this process alone opens the sqlite store at ``uri`` (other URIs: no lock). MLflow creates a
    new store's tables on first use; two runs doing it at once race, and the loser's tracking fails ("table
    latest_metrics already exists"). An ``flock`` on ``<db>.lock`` beside the file serialises them."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file drops the lock


class MLflowBackend:
    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        *,
        report: Report,
    ):
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        self._limits = validation
        self.report = report
        self.tracking_uri = default_tracking_uri()
        self._existing_params: dict[str, str] = {}
        self._metric_names = MetricNames(validation.MAX_ENTITY_KEY_LENGTH)
        project_name, experiment_name = redact_text(project_name), redact_text(experiment_name)
        tags = tags or {}
        attach = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        with _sqlite_store_lock(self.tracking_uri):
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            run = self._attach(attach, tags) if attach else None
            self.attached = run is not None
            if run is None:
                run = self._create(project_name, experiment_name, tags)
        self.run_id: str = run.info.run_id
        self.experiment_id: str = run.info.experiment_id

        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._cond = threading.Condition()
        self._pending = 0  # calls queued or being sent
        self._uploads = 0  # model directory uploads among them
        self._failing = False
        self._closed = False
        self._abandoned = False
        self._worker = threading.Thread(target=self._work, name="dsrl-mlflow", daemon=True)
        self._worker.start()
        self._monitor = None
        self._start_system_metrics()

    # ---- run --------------------------------------------------------------------------------

    def _attach(self, run_id: str, tags: dict[str, str]):
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
            if run.info.lifecycle_stage == "deleted":
                raise MlflowException(f"run {run_id} is deleted", error_code="RESOURCE_DOES_NOT_EXIST")
        except MlflowException as error:
            if error.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise  # the store is unreachable: no MLflow
            self.report(
                "attach", MlflowException(f"cannot continue run {run_id} ({error.message}); starting a new run"), 0
            )
            return None
        self.client.update_run(run_id, status="RUNNING")
        if tags:
            self.client.log_batch(run_id, tags=[self._RunTag(k, v) for k, v in self._tags(tags).items()])
        self._existing_params = dict(run.data.params)
        return run

    def _create(self, project_name: str, experiment_name: str, tags: dict[str, str]):
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(project_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(project_name)
            except MlflowException:  # created meanwhile by another process
                experiment = self.client.get_experiment_by_name(project_name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        tags = {"mlflow.runName": experiment_name, **tags}
        try:
            from mlflow.tracking.context.registry import resolve_tags

            tags = resolve_tags(tags)  # mlflow.user, mlflow.source.name/type, mlflow.source.git.commit
        except Exception:
            pass
        return self.client.create_run(experiment_id, tags=self._tags(tags), run_name=experiment_name)

    def _tags(self, tags: dict[str, Any]) -> dict[str, str]:
        """``tags`` as MLflow gets them: redacted (a repository URL's password too), values cut to MLflow's limit."""
        return {str(k): _truncate(str(v), self._limits.MAX_TAG_VAL_LENGTH) for k, v in redact(tags).items()}

    def _start_system_metrics(self) -> None:
        from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING as enabled

        if enabled.defined and not enabled.get():
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(
                self.run_id, resume_logging=self.attached, tracking_uri=self.tracking_uri
            )
            self._monitor.start()
        except Exception as error:  # psutil missing, ...
            self._monitor = None
            self.report("system_metrics", error, 0)

    # ---- queue ------------------------------------------------------------------------------

    def _submit(self, kind: str, payload: Any, n_metrics: int = 0, upload: bool = False) -> None:
        if self._closed:
            self.report(kind, RuntimeError("called after finish()"), n_metrics)
            return
        with self._cond:
            self._pending += 1
            self._uploads += upload
        try:
            self._queue.put_nowait((kind, payload, n_metrics, upload))
        except queue.Full:
            self._done(1, upload)
            self.report(
                "queue", RuntimeError(f"{QUEUE_SIZE} calls queued: the MLflow store does not keep up"), n_metrics
            )

    def _done(self, count: int, uploads: int = 0) -> None:
        with self._cond:
            self._pending -= count
            self._uploads -= uploads
            self._cond.notify_all()

    def _work(self) -> None:
        carried = None
        while True:
            item = carried if carried is not None else self._queue.get()
            carried = None
            if item is None:
                return
            kind, payload, n_metrics, upload = item
            if self._abandoned:
                self._done(1, upload)
                continue
            if kind != "log_metrics":
                self._send(kind, payload, n_metrics)
                self._done(1, upload)
                continue
            metrics, merged = list(payload), 1
            while len(metrics) < self._limits.MAX_METRICS_PER_BATCH:
                try:
                    following = self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is None or following[0] != "log_metrics":
                    carried = following
                    break
                metrics += following[1]
                merged += 1
            size = self._limits.MAX_METRICS_PER_BATCH
            for start in range(0, len(metrics), size):
                chunk = metrics[start : start + size]
                self._send(kind, lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk), len(chunk))
            self._done(merged)

    def _send(self, kind: str, call: Callable[[], Any], n_metrics: int) -> None:
        attempts = 1 if self._failing else ATTEMPTS
        for attempt in range(attempts):
            try:
                call()
                self._failing = False
                return
            except Exception as exc:
                error = exc
            if attempt + 1 < attempts:
                time.sleep(BACKOFF_S)
        self._failing = True
        self.report(kind, error, n_metrics)

    # ---- logging (called on the training thread; never blocks on MLflow) ---------------------

    def log_params(self, params: dict[str, Any]) -> None:
        values = {}
        for key, value in redact(params).items():
            key = sanitize_metric_name(str(key))[: self._limits.MAX_ENTITY_KEY_LENGTH]
            values[key] = _truncate(str(value), self._limits.MAX_PARAM_VAL_LENGTH)
        changed = sorted(k for k, v in values.items() if self._existing_params.get(k, v) != v)
        if changed:  # MLflow refuses to change a param; not a failure
            warnings.warn(
                f"tracking: {len(changed)} params differ from those of the continued MLflow run, which "
                "keeps its values: " + ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else ""),
                stacklevel=2,
            )
        new = [self._Param(k, v) for k, v in values.items() if k not in self._existing_params]
        size = self._limits.MAX_PARAMS_TAGS_PER_BATCH
        for start in range(0, len(new), size):
            chunk = new[start : start + size]
            self._submit("log_params", lambda chunk=chunk: self.client.log_batch(self.run_id, params=chunk))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                batch.append(self._Metric(self._metric_names(key), value, now, int(step)))
        if batch:
            self._submit("log_metrics", batch, len(batch))

    def log_text(self, text: str, artifact_file: str) -> None:
        text = redact_text(text)
        self._submit("log_text", lambda: self.client.log_text(self.run_id, text, artifact_file))

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        obj = _plain(redact(obj))
        self._submit("log_dict", lambda: self.client.log_dict(self.run_id, obj, artifact_file))

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        rows = [_plain(redact(row)) for row in rows]
        columns: dict[str, list] = {}
        for row in rows:
            for key in row:
                columns.setdefault(key, [])
        for row in rows:
            for key, values in columns.items():
                values.append(row.get(key))
        self._submit("log_table", lambda: self.client.log_table(self.run_id, columns, artifact_file))

    def log_model_dir(self, path, *, upload: bool, adapter_dir=None) -> None:
        local = os.path.abspath(os.fspath(path))
        tags = {"dsrl.model_dir": local, **({"dsrl.adapter_dir": os.path.abspath(adapter_dir)} if adapter_dir else {})}
        for key, value in self._tags(tags).items():
            self._submit("log_model_dir", lambda key=key, value=value: self.client.set_tag(self.run_id, key, value))
        if upload:
            if not Path(local).is_dir():
                self.report("log_model_dir", FileNotFoundError(f"no model directory {local}"), 0)
                return
            self._submit("upload_model", lambda: self.client.log_artifacts(self.run_id, local, "model"), upload=True)

    # ---- end ---------------------------------------------------------------------------------

    def finish(self, status: str = "FINISHED") -> None:
        """Drain the queue (bounded wait), stop system metrics, end the run with ``status``."""
        if self._closed:
            return
        self._closed = True
        start = time.monotonic()
        with self._cond:
            while self._pending:
                limit = UPLOAD_TIMEOUT_S if self._uploads else DRAIN_TIMEOUT_S
                left = start + limit - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            left_over = self._pending
        if left_over:
            self._abandoned = True
            lost = 0
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    lost += item[2]
                    self._done(1, item[3])
            self.report(
                "finish",
                TimeoutError(f"{left_over} tracking calls not sent within {time.monotonic() - start:.0f} s"),
                lost,
            )
        try:
            self._queue.put_nowait(None)  # stops the worker
        except queue.Full:
            pass
        if self._monitor is not None:
            try:
                self._monitor.finish()
            except Exception as error:
                self.report("system_metrics", error, 0)
        self.client.set_terminated(self.run_id, status=status)
        if not left_over:
            self._worker.join(timeout=5)
