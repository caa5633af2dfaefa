"""The Tracker against a real ``mlflow server`` (REST API, proxied artifacts): what it logs reads back,
and a server that dies mid-run costs neither the training loop's time nor an exception."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest

from dsrl.tracking import Tracker

pytestmark = pytest.mark.e2e

mlflow = pytest.importorskip("mlflow")
if shutil.which("mlflow") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mlflow")):
    pytest.skip("the mlflow command (full mlflow, with its server) is not installed", allow_module_level=True)


class Server:
    def __init__(self, root, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(root / "server.log", "wb")
        command = [os.path.join(os.path.dirname(sys.executable), "mlflow")]
        if not os.path.exists(command[0]):
            command = [shutil.which("mlflow")]
        self.process = subprocess.Popen(
            [
                *command,
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'server.db'}",
                "--serve-artifacts",
                "--artifacts-destination",
                str(root / "artifacts"),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=root,
        )

    def wait_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.process.returncode}): see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"mlflow server not healthy after {timeout} s: see {self.log.name}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the server and its workers
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture
def server(tmp_path, free_port, monkeypatch):
    """A fresh ``mlflow server`` (sqlite store, artifacts served through it); MLFLOW_TRACKING_URI points at it."""
    server = Server(tmp_path, free_port())
    try:
        server.wait_healthy()
    except BaseException:
        server.kill()
        raise
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    yield server
    server.kill()


def test_params_metrics_table_and_artifacts_reach_the_server(server, tmp_path):
    tracker = Tracker(
        ["console", "mlflow"],
        project_name="served",
        experiment_name="run",
        total_steps=3,
        rank=0,
        tags={"dsrl.algorithm": "grpo"},
    )
    assert tracker.tracking_uri == server.url
    params = {f"group{i % 3}.key_{i}": i for i in range(150)}  # two requests
    tracker.log_params(params)
    for step in range(1, 4):
        tracker.log_metrics({"critic/score/mean": step / 4, "val/pass@1": step / 8}, step=step)
    tracker.log_table(
        [{"prompt": "1+1=", "response": "2", "score": 1.0, "data_source": "arith"}], "generations/val_step_3.json"
    )
    tracker.log_text("data:\n  train_batch_size: 8\n", "config/resolved.yaml")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tracker.log_model_dir(model, upload=True)
    tracker.finish()
    assert tracker.failures == 0 and tracker.dropped == 0

    client = mlflow.tracking.MlflowClient(tracking_uri=server.url)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params == {k: str(v) for k, v in params.items()}
    assert run.data.tags["dsrl.algorithm"] == "grpo" and run.data.tags["dsrl.model_dir"] == str(model)
    history = client.get_metric_history(tracker.run_id, "val/pass_at_1")
    assert [(m.step, m.value) for m in history] == [(1, 0.125), (2, 0.25), (3, 0.375)]
    table = client.load_table(run.info.experiment_id, "generations/val_step_3.json", run_ids=[tracker.run_id])
    assert table[["prompt", "score", "data_source"]].values.tolist() == [["1+1=", 1.0, "arith"]]
    raw = client.download_artifacts(tracker.run_id, "generations/val_step_3.json", str(tmp_path / "down"))
    assert json.load(open(raw)) == {
        "columns": ["prompt", "response", "score", "data_source"],
        "data": [["1+1=", "2", 1.0, "arith"]],
    }  # pandas reads "2" back as 2
    text = client.download_artifacts(tracker.run_id, "config/resolved.yaml", str(tmp_path / "down"))
    assert open(text).read() == "data:\n  train_batch_size: 8\n"
    assert [a.path for a in client.list_artifacts(tracker.run_id, "model")] == ["model/config.json"]


def test_a_dead_server_costs_no_step_time_and_the_drop_is_counted(server):
    tracker = Tracker(["mlflow"], project_name="dying", experiment_name="run", total_steps=10, rank=0)
    client = mlflow.tracking.MlflowClient(tracking_uri=server.url)
    for step in range(1, 4):
        tracker.log_metrics({"actor/pg_loss": float(step), "critic/score/mean": 0.5}, step=step)
    deadline = time.monotonic() + 30
    while len(client.get_metric_history(tracker.run_id, "actor/pg_loss")) < 3:
        assert time.monotonic() < deadline, "the first steps never reached the server"
        time.sleep(0.2)
    server.kill()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slowest = 0.0
        for step in range(4, 11):
            started = time.monotonic()
            tracker.log_metrics({"actor/pg_loss": float(step), "critic/score/mean": 0.5}, step=step)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.3)  # a training step
        started = time.monotonic()
        tracker.finish()
        finish_s = time.monotonic() - started
    assert slowest < 1.0, f"log_metrics blocked for {slowest:.2f} s"
    assert finish_s < 45, f"finish took {finish_s:.1f} s"
    assert tracker.dropped >= 2 * 7  # every value of steps 4-10 (plus the tracking/* counts sent with them)
    assert tracker.failures >= 1
    dropped_warnings = [w for w in caught if "log_metrics failed" in str(w.message)]
    assert len(dropped_warnings) == 1, [str(w.message) for w in caught]
    assert "metric values dropped" in str(dropped_warnings[0].message)
