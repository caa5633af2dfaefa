"""A training run lands in MLflow complete: params, tags, metric histories, system metrics,
generation tables, config artifacts, the model's location and the run's final status.

A real sqlite store per test (``MLFLOW_TRACKING_URI``), read back with ``MlflowClient``.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers.trainer import trainer_for

pytestmark = pytest.mark.e2e

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


def the_run(client, experiment="dsrl"):
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def artifact(client, run_id, path, tmp_path) -> str:
    with open(client.download_artifacts(run_id, path, str(tmp_path))) as f:
        return f.read()


def test_a_run_lands_complete(
    store, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, capsys
):
    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        "trainer.logger=[console,mlflow]",
        "trainer.log_val_generations=3",
        "trainer.log_samples_freq=1",
        "data.apply_chat_template_kwargs.api_key=sk-planted-secret-123",
    )
    trainer.fit()
    run = the_run(store)
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == trainer.cfg.trainer.experiment_name
    tags = run.data.tags
    assert tags["dsrl.algorithm"] == "grpo" and tags["dsrl.world_size"] == "1"
    assert tags["dsrl.model"] == str(tiny_model_dir) and tags["dsrl.model_dir"] == str(trainer.model_dir)
    params = run.data.params
    assert len(params) > 100 and params["algorithm.adv_estimator"] == "grpo"
    assert params["data.apply_chat_template_kwargs.api_key"] == "***"
    # metric histories: two training steps, validation before training and at the last step
    assert [m.step for m in store.get_metric_history(run_id, "critic/score/mean")] == [1, 2]
    assert [m.step for m in store.get_metric_history(run_id, "val-core/arithmetic/reward/mean_at_1")] == [0, 2]
    assert {"actor/entropy", "perf/throughput", "reward/digits/mean"} <= set(run.data.metrics)
    assert any(name.startswith("system/") for name in run.data.metrics)
    # artifacts: the resolved config (redacted), the filled DeepSpeed JSON, generation tables
    files = {a.path for a in store.list_artifacts(run_id, "config")}
    assert files == {"config/resolved.yaml", "config/deepspeed_actor.json", "config/deepspeed_reference.json"}
    resolved = artifact(store, run_id, "config/resolved.yaml", tmp_path)
    assert "sk-planted-secret-123" not in resolved
    assert yaml.safe_load(resolved)["data"]["apply_chat_template_kwargs"]["api_key"] == "***"
    ds = json.loads(artifact(store, run_id, "config/deepspeed_actor.json", tmp_path))
    assert ds["train_micro_batch_size_per_gpu"] == trainer.actor.ds_config["train_micro_batch_size_per_gpu"]
    tables = {a.path for a in store.list_artifacts(run_id, "generations")}
    assert tables == {
        "generations/val_step_0.json",
        "generations/val_step_2.json",
        "generations/train_step_1.json",
        "generations/train_step_2.json",
    }
    val = json.loads(artifact(store, run_id, "generations/val_step_0.json", tmp_path))
    assert val["columns"][:4] == ["prompt", "response", "score", "data_source"] and "digits" in val["columns"]
    assert len(val["data"]) == 3 and all(row[0] and row[3] == "arithmetic" for row in val["data"])
    train = json.loads(artifact(store, run_id, "generations/train_step_1.json", tmp_path))
    assert len(train["data"]) == 16  # LOGGED_SAMPLES of the step's 40 rollouts
    assert "sk-planted-secret-123" not in capsys.readouterr().out


def test_a_crash_ends_the_run_failed(
    store, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        "trainer.logger=[console,mlflow]",
        "trainer.val_before_train=false",
    )

    def broken(*args, **kwargs):
        raise RuntimeError("the update broke")

    trainer.actor.update = broken
    with pytest.raises(RuntimeError, match="the update broke"):
        trainer.fit()
    assert the_run(store).info.status == "FAILED"


def test_a_signal_ends_the_run_killed(
    store, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    import signal

    from dsrl.runtime.signals import RunSignals, TrainingInterrupted

    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        "trainer.logger=[console,mlflow]",
        "trainer.val_before_train=false",
    )
    signals = RunSignals()
    signals.signum = int(signal.SIGTERM)  # as if a rank got SIGTERM during the first step
    with pytest.raises(TrainingInterrupted):
        trainer.fit(signals)
    run = the_run(store)
    assert run.info.status == "KILLED"
    assert [m.step for m in store.get_metric_history(run.info.run_id, "critic/score/mean")] == [1]


@pytest.mark.parametrize(
    "phase, overrides", [("validate", []), ("validate", ["trainer.val_only=true"]), ("export", [])]
)
def test_a_signal_outside_the_loop_stops_at_once_and_ends_the_run_killed(
    phase, overrides, store, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """A real SIGTERM during the validation before training, a validation-only run, or the final export: nothing
    is left to finish, so the handler stops the run where it is, and the MLflow run ends KILLED (not RUNNING, not
    FAILED)."""
    import os
    import signal

    from dsrl.runtime.signals import Interrupted, TrainingInterrupted

    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        "trainer.logger=[console,mlflow]",
        "trainer.total_training_steps=1",
        *overrides,
    )
    method = {"validate": "validate", "export": "export_final_model"}[phase]
    original = getattr(trainer, method)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    setattr(trainer, method, signalled)
    with pytest.raises(Interrupted) as raised:
        trainer.fit()
    assert not isinstance(raised.value, TrainingInterrupted) and raised.value.phase == phase
    assert raised.value.exit_code == 143
    assert the_run(store).info.status == "KILLED"
    assert trainer.scorer._pool is None  # the reward workers stopped


def test_a_resumed_run_continues_its_mlflow_run(
    store, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    common = ["trainer.logger=[console,mlflow]", "trainer.val_before_train=false", "trainer.save_freq=1"]
    trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        *common,
        "trainer.total_training_steps=1",
    ).fit()
    first = the_run(store).info.run_id
    # each trainer_for writes its DeepSpeed JSON to a new path: the only setting that differs
    resumed = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        *common,
        "trainer.resume_allow_config_change=true",
    )
    assert resumed.global_step == 1 and resumed.tracker.run_id == first
    resumed.fit()
    run = the_run(store)  # still one run
    assert run.info.run_id == first and run.info.status == "FINISHED"
    assert [m.step for m in store.get_metric_history(first, "critic/score/mean")] == [1, 2]


def test_a_lora_run_logs_its_adapter_settings_and_where_its_adapter_is(
    store, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """A LoRA run's params hold the adapter as PEFT resolved it (all-linear expanded to module names) and its
    trainable parameter count; the exported adapter's folder is tagged, and named in the final summary."""
    from dsrl.engines.lora import trainable_parameter_count
    from dsrl.tracking.console import final_summary
    from dsrl.trainer.facts import final_facts

    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        "trainer.logger=[console,mlflow]",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=1",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=all-linear",
    )
    trainer.fit()
    params, tags = the_run(store).data.params, the_run(store).data.tags
    assert params["lora.rank"] == "4" and params["lora.alpha"] == "8"
    assert params["lora.target_modules"] == "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"
    assert params["lora.trainable"] == str(trainable_parameter_count(trainer.actor.module)) != "0"
    adapter = trainer.model_dir / "lora_adapter"
    assert tags["dsrl.adapter_dir"] == str(adapter) and (adapter / "adapter_model.safetensors").is_file()
    facts = final_facts(trainer, status="finished", wall_time_s=1.0)
    assert facts["adapter_dir"] == str(adapter) and str(adapter) in final_summary(facts)
