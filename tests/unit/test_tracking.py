"""Console and MLflow tracking (a real sqlite MLflow store); failures never stop training."""

from __future__ import annotations

import pytest

from dsrl.tracking import Tracker, flatten, sanitize_metric_name


def test_sanitize_and_flatten():
    assert sanitize_metric_name("val/pass@1(greedy)") == "val/pass_at_1_greedy_"
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {"a.b": 1, "a.c.d": "x", "e": None}


def test_console_line_shows_step_and_key_metrics(capsys):
    tracker = Tracker(["console"], project_name="p", experiment_name="e", total_steps=10, rank=0)
    tracker.log_metrics({"critic/score/mean": 0.25, "timing_s/step": 1.5, "other": 3.0}, step=3)
    out = capsys.readouterr().out
    assert "step  3/10" in out and "critic/score/mean=0.25" in out and "timing_s/step=1.5" in out
    assert "other" not in out


def test_only_rank_zero_logs(capsys):
    tracker = Tracker(["console"], project_name="p", experiment_name="e", total_steps=10, rank=1)
    tracker.log_metrics({"critic/score/mean": 0.25}, step=1)
    assert capsys.readouterr().out == ""


def test_mlflow_run_holds_params_and_sanitised_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = Tracker(["mlflow"], project_name="proj", experiment_name="run1", total_steps=2, rank=0)
    tracker.log_params({"algorithm.adv_estimator": "grpo", "data.train_batch_size": 8})
    tracker.log_metrics({"val/pass@1": 0.5, "actor/pg_loss": 0.1, "bad": float("nan")}, step=1)
    tracker.finish()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "run1"
    assert run.data.params == {"algorithm.adv_estimator": "grpo", "data.train_batch_size": "8"}
    assert run.data.metrics == {"val/pass_at_1": 0.5, "actor/pg_loss": 0.1}  # NaN dropped, '@' sanitised
    assert tracker.failures == 0


def test_a_tracking_failure_is_counted_not_raised(tmp_path, monkeypatch, capsys):
    tracker = Tracker(["console"], project_name="p", experiment_name="e", total_steps=1, rank=0)

    def broken(metrics, step):
        raise OSError("disk full")

    tracker.backends.insert(0, type("Broken", (), {"log_metrics": staticmethod(broken)})())
    with pytest.warns(UserWarning, match="disk full"):
        tracker.log_metrics({"critic/score/mean": 1.0}, step=1)
    assert tracker.failures == 1
    with pytest.warns(UserWarning, match="disk full"):
        tracker.log_metrics({"critic/score/mean": 1.0}, step=2)
    assert "step 2/1 critic/score/mean=1 tracking/failures=1" in capsys.readouterr().out.splitlines()[-1]
    assert tracker.failures == 2


def test_a_resumed_run_continues_its_mlflow_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    first = Tracker(["mlflow"], project_name="proj", experiment_name="run1", total_steps=4, rank=0)
    first.log_metrics({"actor/pg_loss": 0.1}, step=1)
    run_id = first.run_id
    first.finish()
    resumed = Tracker(["console", "mlflow"], project_name="proj", experiment_name="run1", total_steps=4, rank=0,
                      run_id=run_id)
    assert resumed.run_id == run_id
    resumed.log_metrics({"actor/pg_loss": 0.2}, step=2)
    resumed.finish()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [(1, 0.1), (2, 0.2)]
    assert Tracker(["console"], project_name="p", experiment_name="e", total_steps=1, rank=0).run_id is None
