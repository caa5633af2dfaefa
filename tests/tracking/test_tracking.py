"""Console and MLflow tracking against a real sqlite MLflow store, read back with ``MlflowClient``;
secrets redacted; failures counted, never raised."""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest
import yaml

from dsrl.tracking import Tracker, flatten, is_secret_name, redact, redact_text, sanitize_metric_name
from tests.conftest import QUICKSTART, REPO

mlflow = pytest.importorskip("mlflow")

ENV_SECRET = "tok-9f8e7d6c5b4a3921"  # the value of MY_SERVICE_TOKEN
KEY_SECRET = "sk-planted-0123456789"  # data.apply_chat_template_kwargs.api_key


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mlflow_store")


@pytest.fixture
def uri(store_dir, monkeypatch):
    """One sqlite store for the module (creating one takes seconds); artifacts under it (cwd)."""
    uri = f"sqlite:///{store_dir / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(store_dir)  # MLflow puts a sqlite store's artifacts in ./mlruns
    return uri


@pytest.fixture
def client(uri):
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


def mlflow_tracker(project: str, run: str = "run1", **kwargs) -> Tracker:
    return Tracker(["mlflow"], project_name=project, experiment_name=run, total_steps=10, rank=0, **kwargs)


def only_run(client, project: str):
    [run] = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    return run


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def quickstart_params(*overrides: str) -> dict:
    from dsrl.config import load_config, to_dict

    return flatten(to_dict(load_config(QUICKSTART, list(overrides))))


def test_sanitize_and_flatten():
    assert sanitize_metric_name("val/pass@1(greedy)") == "val/pass_at_1_greedy_"
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {"a.b": 1, "a.c.d": "x", "e": None}


def test_the_console_backend_is_the_progress_console(capsys):
    tracker = Tracker(["console"], project_name="p", experiment_name="e", total_steps=10, rank=0, initial_step=2)
    tracker.log_metrics({"critic/score/mean": 0.25, "timing_s/step": 1.5, "other": 3.0}, step=3)
    out = capsys.readouterr().out
    assert "step  3/10 score=0.25" in out and "step_s=1.50" in out and "other" not in out
    assert tracker.console_facts()["last_step"] == 3


def test_only_rank_zero_logs(capsys, client):
    tracker = Tracker(["console", "mlflow"], project_name="rank1", experiment_name="e", total_steps=10, rank=1)
    tracker.log_params({"a": 1})
    tracker.log_metrics({"critic/score/mean": 0.25}, step=1)
    tracker.log_text("x", "x.txt")
    tracker.finish()
    assert capsys.readouterr().out == ""
    assert tracker.run_id is None and tracker.tracking_uri is None and tracker.mlflow_facts() is None
    assert client.get_experiment_by_name("rank1") is None  # no run, not even an experiment


def test_other_ranks_never_import_mlflow(uri):
    code = (
        "import sys\n"
        "from dsrl.tracking import Tracker\n"
        "t = Tracker(['console', 'mlflow'], project_name='p', experiment_name='e', total_steps=1, rank=1)\n"
        "t.log_metrics({'a': 1.0}, step=1); t.finish()\n"
        "assert 'mlflow' not in sys.modules, 'mlflow imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_run_name_experiment_and_tags(client):
    tracker = mlflow_tracker("tags", "grpo-run", tags={"dsrl.version": "0.1.0", "dsrl.world_size": "2"})
    run_id = tracker.run_id
    facts = tracker.mlflow_facts()
    tracker.finish()
    run = only_run(client, "tags")
    assert run.info.run_id == run_id and run.info.run_name == "grpo-run"
    assert facts == {"tracking_uri": tracker.tracking_uri, "experiment_id": run.info.experiment_id, "run_id": run_id}
    assert tracker.tracking_uri == client.tracking_uri
    tags = run.data.tags
    assert tags["dsrl.version"] == "0.1.0" and tags["dsrl.world_size"] == "2"
    assert tags["mlflow.runName"] == "grpo-run" and tags["mlflow.source.type"] == "LOCAL" and "mlflow.user" in tags


def test_the_whole_config_lands_as_params_and_a_long_value_is_truncated(client, monkeypatch):
    params = quickstart_params()
    assert len(params) > 100  # more than MLflow takes in one request
    params["custom.long_value"] = "x" * 7000
    tracker = mlflow_tracker("params")
    sizes, log_batch = [], tracker._mlflow.client.log_batch

    def spy(run_id, metrics=(), params=(), tags=()):
        sizes.append(len(params))
        return log_batch(run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(tracker._mlflow.client, "log_batch", spy)
    tracker.log_params(params)
    tracker.finish()
    assert sizes == [100] * (len(params) // 100) + [len(params) % 100]  # MLflow's limit per request
    stored = only_run(client, "params").data.params
    assert set(stored) == {sanitize_metric_name(k) for k in params}
    long = stored.pop("custom.long_value")
    assert len(long) == 6000 and long.startswith("xxx") and long.endswith("[truncated by dsrl]")
    assert stored == {k: str(v) for k, v in params.items() if k != "custom.long_value"}  # nothing else redacted
    assert tracker.failures == 0 and tracker.dropped == 0


def test_secret_names():
    for name in (
        "data.apply_chat_template_kwargs.api_key",
        "HF_TOKEN",
        "MY_SERVICE_TOKEN",
        "apiKey",
        "db.passwd",
        "x.Password",
        "client-secret",
        "AWS_SECRET_ACCESS_KEY",
        "gcp.credentials",
        "basic_auth",
    ):
        assert is_secret_name(name), name
    for name in (
        "tokenizer.pad_token",
        "eos_token",
        "actor.ppo_max_token_len_per_gpu",
        "max_num_batched_tokens",
        "data.prompt_key",
        "author",
        "TOKENIZERS_PARALLELISM",
        "SSH_AUTH_SOCK",
    ):
        assert not is_secret_name(name), name
    # no key of a shipped recipe looks like a secret
    assert [k for k in quickstart_params() if is_secret_name(k)] == []


def test_redact_keeps_the_shape(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", ENV_SECRET)
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to redact
    tree = {"a": {"api_key": "k", "auth": {"user": "u"}, "n": [1, f"x{ENV_SECRET}y", "abc"]}, "b": ENV_SECRET, "c": 3}
    assert redact(tree) == {"a": {"api_key": "***", "auth": {"user": "u"}, "n": [1, "***", "abc"]}, "b": "***", "c": 3}
    flat = flatten(tree)
    assert redact(flat) == flatten(redact(tree))
    text = (
        f"api_key: {KEY_SECRET}\nheader: Bearer {ENV_SECRET}\npad_token: <pad>\n"
        f'{{"hf_token": "{KEY_SECRET}"}} data.apply_chat_template_kwargs.api_key={KEY_SECRET}\n'
        "uri: https://user:hunter2pass@example.com/x\n"
    )
    assert redact_text(text) == (
        "api_key: '***'\nheader: Bearer ***\npad_token: <pad>\n"
        '{"hf_token": "***"} data.apply_chat_template_kwargs.api_key=***\n'
        "uri: https://user:***@example.com/x\n"
    )


def test_planted_secrets_appear_nowhere(client, store_dir, monkeypatch, tmp_path):
    from dsrl.config import load_config, to_dict, to_yaml

    monkeypatch.setenv("MY_SERVICE_TOKEN", ENV_SECRET)
    overrides = [
        f"+data.apply_chat_template_kwargs.api_key={KEY_SECRET}",
        f"+data.apply_chat_template_kwargs.service={ENV_SECRET}",  # equal to the env secret
        f"+data.apply_chat_template_kwargs.header=Bearer {ENV_SECRET}",  # containing it
    ]
    cfg = load_config(QUICKSTART, overrides)
    params = flatten(to_dict(cfg))
    assert KEY_SECRET in str(params) and ENV_SECRET in str(params)  # planted
    tracker = mlflow_tracker("secrets", tags={"note": f"from {ENV_SECRET}"})
    tracker.log_params(params)
    tracker.log_text(to_yaml(cfg), "config/resolved.yaml")
    tracker.log_dict(to_dict(cfg), "config/resolved.json")
    tracker.log_dict(to_dict(cfg), "config/as_dict.yaml")
    tracker.log_table([{"prompt": "p", "response": f"key {ENV_SECRET}", "score": 1.0}], "generations/val_step_1.json")
    tracker.finish()
    assert tracker.failures == 0
    run = only_run(client, "secrets")
    stored = run.data.params
    assert stored["data.apply_chat_template_kwargs.api_key"] == "***"
    assert stored["data.apply_chat_template_kwargs.service"] == "***"
    assert stored["data.apply_chat_template_kwargs.header"] == "***"
    assert stored["data.train_batch_size"] == str(params["data.train_batch_size"])  # the rest is kept
    assert run.data.tags["note"] == "***"
    client.download_artifacts(run.info.run_id, "", str(tmp_path))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {"resolved.yaml", "resolved.json", "as_dict.yaml", "val_step_1.json"}
    resolved = json.loads((tmp_path / "config" / "resolved.json").read_text())
    assert resolved["data"]["apply_chat_template_kwargs"]["api_key"] == "***"
    assert resolved["data"]["train_batch_size"] == params["data.train_batch_size"]
    for name, header in (("resolved.yaml", "Bearer ***"), ("as_dict.yaml", "***")):  # text: the secret masked
        kwargs = yaml.safe_load((tmp_path / "config" / name).read_text())["data"]["apply_chat_template_kwargs"]
        assert kwargs == {"api_key": "***", "service": "***", "header": header}  # still YAML
    for blob in [*(p.read_bytes() for p in files), *(p.read_bytes() for p in store_dir.glob("mlflow.db*"))]:
        assert KEY_SECRET.encode() not in blob and ENV_SECRET.encode() not in blob
    shown = redact_text(to_yaml(cfg))
    assert KEY_SECRET not in shown and ENV_SECRET not in shown and "api_key: '***'" in shown


def test_metric_histories_with_sanitised_names(client):
    tracker = Tracker(["console", "mlflow"], project_name="metrics", experiment_name="e", total_steps=5, rank=0)
    for step in range(1, 6):
        tracker.log_metrics(
            {"val/pass@1": step / 10, "actor/pg_loss": -step, "bad": math.nan, "worse": math.inf}, step=step
        )
    tracker.finish()
    run = only_run(client, "metrics")
    assert history(client, run.info.run_id, "val/pass_at_1") == [(s, s / 10) for s in range(1, 6)]
    assert history(client, run.info.run_id, "actor/pg_loss") == [(s, -s) for s in range(1, 6)]
    assert not {"bad", "worse", "val/pass@1"} & set(run.data.metrics)  # non-finite left out, names sanitised
    assert run.info.status == "FINISHED" and tracker.failures == 0 and tracker.dropped == 0


def test_a_table_artifact_reads_back(client):
    rows = [
        {"prompt": "1+1=", "response": "2", "score": 1.0, "data_source": "arith", "extras": {"digits": 1}},
        {"prompt": "2+2=", "response": "five", "score": 0.0, "data_source": "arith", "extras": {"digits": 0}},
    ]
    tracker = mlflow_tracker("table")
    tracker.log_table(rows, "generations/val_step_3.json")
    tracker.finish()
    run = only_run(client, "table")
    table = client.load_table(run.info.experiment_id, "generations/val_step_3.json", run_ids=[run.info.run_id])
    assert table[["prompt", "response", "score", "data_source"]].values.tolist() == [
        ["1+1=", "2", 1.0, "arith"],
        ["2+2=", "five", 0.0, "arith"],
    ]
    assert list(table["extras"]) == [{"digits": 1}, {"digits": 0}]


def test_the_model_dir_is_tagged_and_uploaded(client, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tracker = mlflow_tracker("model")
    tracker.log_model_dir(model, upload=True)
    tracker.finish()
    run = only_run(client, "model")
    assert run.data.tags["dsrl.model_dir"] == str(model)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/config.json"]


def test_a_secret_in_a_path_reaches_no_tag(client, store_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("MY_API_TOKEN", ENV_SECRET)  # e.g. trainer.default_local_dir=/runs/${oc.env:MY_API_TOKEN}
    model = tmp_path / ENV_SECRET / "huggingface"
    tracker = mlflow_tracker("path-secrets", tags={"dsrl.model": f"/models/{ENV_SECRET}", "dsrl.algorithm": "grpo"})
    tracker.log_model_dir(model, upload=False)  # a tag set late, at the end of the run
    tracker.finish()
    tags = only_run(client, "path-secrets").data.tags
    assert tags["dsrl.model"] == "***" and tags["dsrl.model_dir"] == "***" and tags["dsrl.algorithm"] == "grpo"
    assert all(ENV_SECRET not in value for value in tags.values())
    for blob in (p.read_bytes() for p in store_dir.glob("mlflow.db*")):
        assert ENV_SECRET.encode() not in blob


def test_a_metric_name_over_mlflows_limit_loses_no_metric_of_its_batch(client):
    limit = mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
    long = "reward/" + "very_long_extra_" * 20 + "/mean"  # e.g. an extra a reward function returns
    assert len(long) > limit
    tracker = mlflow_tracker("long-name")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            tracker.log_metrics({"actor/pg_loss": -step, long: step / 4, "critic/score/mean": step / 2}, step=step)
        tracker.finish()
    run = only_run(client, "long-name")
    [cut] = [name for name in run.data.metrics if name.startswith("reward/")]
    assert len(cut) == limit and cut.startswith(long[: limit - 9]) and re.fullmatch(r"-[0-9a-f]{8}", cut[-9:])
    assert history(client, run.info.run_id, cut) == [(1, 0.25), (2, 0.5)]
    assert history(client, run.info.run_id, "actor/pg_loss") == [(1, -1), (2, -2)]
    assert history(client, run.info.run_id, "critic/score/mean") == [(1, 0.5), (2, 1.0)]
    said = [str(w.message) for w in caught if "logged to MLflow as" in str(w.message)]
    assert said == [
        f"tracking: the metric {long} is logged to MLflow as {cut} (longer than MLflow's limit of {limit} characters)"
    ]
    assert tracker.failures == 0 and tracker.dropped == 0


def test_metric_names_that_sanitise_alike_stay_two_curves(client):
    tracker = mlflow_tracker("collisions")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            tracker.log_metrics(
                {"val/a@b": step, "val/a_at_b": 10 * step, "x(1)": -step, "x_1_": -10 * step}, step=step
            )
        tracker.finish()
    run = only_run(client, "collisions")
    [a_at_b, x_1] = sorted(name for name in run.data.metrics if "-" in name)
    assert set(run.data.metrics) == {"val/a_at_b", "x_1_", a_at_b, x_1}
    assert re.fullmatch(r"val/a_at_b-[0-9a-f]{8}", a_at_b) and re.fullmatch(r"x_1_-[0-9a-f]{8}", x_1)
    assert history(client, run.info.run_id, "val/a_at_b") == [(1, 1), (2, 2)]  # the first to arrive keeps the name
    assert history(client, run.info.run_id, a_at_b) == [(1, 10), (2, 20)]
    assert history(client, run.info.run_id, "x_1_") == [(1, -1), (2, -2)]
    assert history(client, run.info.run_id, x_1) == [(1, -10), (2, -20)]
    said = sorted(str(w.message) for w in caught if "logged to MLflow as" in str(w.message))  # once per name
    assert said == [
        f"tracking: the metric val/a_at_b is logged to MLflow as {a_at_b} (val/a_at_b is the MLflow name "
        "of the metric val/a@b)",
        f"tracking: the metric x_1_ is logged to MLflow as {x_1} (x_1_ is the MLflow name of the metric x(1))",
    ]


def test_metric_names_mlflow_would_read_as_other_paths_arrive(client):
    names = {
        "reward/a//mean": "reward/a/_/mean",
        "/lead": "_/lead",
        "trail/": "trail/_",
        "./here": "_/here",
        "..up": "_..up",
        "a/../b": "a/_/b",
    }
    assert {name: sanitize_metric_name(name) for name in names} == names
    tracker = mlflow_tracker("paths")
    tracker.log_metrics({name: 1.0 for name in names}, step=1)
    tracker.finish()
    assert set(only_run(client, "paths").data.metrics) == set(names.values())
    assert tracker.failures == 0


def test_a_suffixed_name_taken_already_takes_the_whole_digest():
    from dsrl.tracking.mlflow_backend import MetricNames

    names = MetricNames(limit=250)
    digest = hashlib.sha1(b"a@b").hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [names("a_at_b"), names(f"a_at_b-{digest[:8]}"), names("a@b")] == [
            "a_at_b",
            f"a_at_b-{digest[:8]}",
            f"a_at_b-{digest}",
        ]
    assert names("a@b") == f"a_at_b-{digest}"  # the same name every step


def test_mlflow_run_id_from_the_environment_and_from_a_checkpoint_continue_the_run(client, monkeypatch):
    first = mlflow_tracker("attach")
    first.log_metrics({"actor/pg_loss": 0.1}, step=1)
    first.finish("KILLED")
    other = mlflow_tracker("attach", "other")
    other.finish()
    monkeypatch.setenv("MLFLOW_RUN_ID", first.run_id)
    by_env = mlflow_tracker("attach", "ignored")
    assert by_env.run_id == first.run_id
    by_env.log_metrics({"actor/pg_loss": 0.2}, step=2)
    by_env.finish()
    by_checkpoint = mlflow_tracker("attach", run_id=first.run_id)  # takes precedence over MLFLOW_RUN_ID ...
    by_checkpoint.log_metrics({"actor/pg_loss": 0.3}, step=3)
    by_checkpoint.finish()
    by_argument = mlflow_tracker("attach", run_id=other.run_id)  # ... when they differ
    assert by_argument.run_id == other.run_id
    by_argument.finish()
    assert history(client, first.run_id, "actor/pg_loss") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run1"
    assert len(client.search_runs([run.info.experiment_id])) == 2


def test_an_unknown_run_id_starts_a_new_run(client):
    with pytest.warns(UserWarning, match="cannot continue run 0123456789abcdef"):
        tracker = mlflow_tracker("unknown", run_id="0123456789abcdef0123456789abcdef")
    assert tracker.run_id is not None and tracker.run_id != "0123456789abcdef0123456789abcdef"
    tracker.finish()
    with pytest.warns(UserWarning, match="cannot continue run not-a-run-id"):
        malformed = mlflow_tracker("unknown", run_id="not-a-run-id")
    assert malformed.run_id is not None
    malformed.finish()
    assert len(client.search_runs([client.get_experiment_by_name("unknown").experiment_id])) == 2


@pytest.mark.parametrize("status", ["FINISHED", "FAILED", "KILLED"])
def test_finish_sets_the_run_status(client, status):
    tracker = mlflow_tracker(f"status-{status}")
    tracker.finish(status)
    tracker.finish("FINISHED")  # idempotent
    run = only_run(client, f"status-{status}")
    assert run.info.status == status and run.info.end_time is not None


def test_an_unknown_status_is_refused(client):
    tracker = mlflow_tracker("bad-status")
    with pytest.raises(ValueError, match="FINISHED, FAILED, KILLED"):
        tracker.finish("DONE")
    tracker.finish()


def test_system_metrics_are_logged(client, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    tracker = mlflow_tracker("system")
    time.sleep(3)
    tracker.finish()
    run = only_run(client, "system")
    metrics = set(run.data.metrics)
    assert {
        "system/cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
        "system/system_memory_usage_percentage",
    } <= metrics
    assert len(client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")) >= 2
    monitors = [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor" and t.is_alive()]
    assert monitors == []  # stopped at finish


def test_a_tracking_failure_is_counted_not_raised(capsys):
    tracker = Tracker(["console"], project_name="p", experiment_name="e", total_steps=1, rank=0)

    def broken(metrics, step):
        raise OSError("disk full")

    tracker.backends.insert(0, type("Broken", (), {"log_metrics": staticmethod(broken)})())
    with pytest.warns(UserWarning, match="disk full"):
        tracker.log_metrics({"critic/score/mean": 1.0}, step=1)
    assert tracker.failures == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per kind: a second warning would raise here
        tracker.log_metrics({"critic/score/mean": 1.0}, step=2)
    assert "score=1 tracking_failures=1" in capsys.readouterr().out.splitlines()[-1]
    assert tracker.failures == 2


def test_failed_sends_are_retried_then_dropped_and_counted(client, monkeypatch):
    monkeypatch.setattr("dsrl.tracking.mlflow_backend.BACKOFF_S", 0.01)
    tracker = mlflow_tracker("dropped")
    calls = []

    def flaky(run_id, metrics=(), params=(), tags=()):
        calls.append(len(metrics))
        raise ConnectionError("store away")

    monkeypatch.setattr(tracker._mlflow.client, "log_batch", flaky)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.log_metrics({"a": 1.0, "b": 2.0}, step=1)
        tracker.finish()
    assert calls == [2, 2]  # two attempts, then dropped
    assert tracker.dropped == 2 and tracker.failures >= 1
    assert len([w for w in caught if "log_metrics failed" in str(w.message)]) == 1
    seen, failures = [], tracker.failures
    tracker.backends = [type("Seen", (), {"log_metrics": staticmethod(lambda m, step: seen.append(m))})()]
    tracker.log_metrics({"a": 3.0}, step=2)
    assert seen == [{"a": 3.0, "tracking/dropped": 2.0, "tracking/failures": float(failures)}]


def test_training_goes_on_when_mlflow_cannot_start(monkeypatch, tmp_path, free_port, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.warns(UserWarning, match="tracking: start failed") as caught:
        tracker = Tracker(["console", "mlflow"], project_name="p", experiment_name="e", total_steps=2, rank=0)
    assert time.monotonic() - started < 20  # MLflow's own retries are capped
    assert len([w for w in caught if "tracking:" in str(w.message)]) == 1
    assert tracker.run_id is None and tracker.tracking_uri is None and tracker.failures == 1
    assert tracker.mlflow_facts()["run_id"] is None
    tracker.log_metrics({"critic/score/mean": 0.5}, step=1)
    tracker.log_text("x", "x.txt")
    tracker.finish("FAILED")
    assert "step 1/2 score=0.5 tracking_failures=1" in capsys.readouterr().out
