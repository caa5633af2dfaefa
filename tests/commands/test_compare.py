"""dsrl-compare end to end: real training runs of one step each (the untrained tiny model, a reward paying for
digits so that gradients are not zero), then the report checked against the MLflow store the runs wrote: each
run's numbers are its logged metrics, each summary their mean and t-interval over seeds. Two configs x 2 seeds, as
the issue asks of CI: --quick's code path with one step instead of 20 (each run a process of its own, two at a
time into one MLflow store)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from scipy.stats import t

from dsrl.commands.compare import main

pytestmark = pytest.mark.e2e

SEEDS, STEPS = (1, 2), 1


@pytest.fixture(scope="module")
def compared(tiny_model_dir, arithmetic_data, deepspeed_cpu_ops, tmp_path_factory):
    """(the report's folder, the configs compared)."""
    configs = ("grpo", "opo")
    out = tmp_path_factory.mktemp("compare")
    argv = [
        *configs,
        "--task",
        "cpu",
        "--steps",
        str(STEPS),
        "--jobs",
        "2",
        "--seeds",
        ",".join(map(str, SEEDS)),
        "--out",
        str(out),
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        f"data.val_files={arithmetic_data / 'test.parquet'}",
        f"custom_reward_function.path={arithmetic_data / 'digits_reward.py'}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # 16 rows a step: 4 micro-batches
        "data.val_max_samples=8",
    ]
    assert main(argv) == 0
    return out, configs


def logged(client, experiment_id: str, name: str) -> tuple[object, dict[str, dict[int, float]]]:
    (run,) = client.search_runs([experiment_id], filter_string=f"tags.mlflow.runName = '{name}'")
    keys = [
        "val-core/arithmetic/reward/mean_at_1",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_var",
        "actor/grad_var_relative",
    ]
    return run, {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in keys}


def test_the_report_holds_what_the_runs_logged_to_mlflow(compared):
    from mlflow import MlflowClient

    compared, configs = compared
    report = json.loads((compared / "report.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{compared / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dsrl-compare")
    assert report["tracking_uri"] == f"sqlite:///{compared / 'mlflow.db'}" and set(report["configs"]) == set(configs)
    assert report["jobs"] == 2 and len(client.search_runs([experiment.experiment_id])) == len(configs) * len(SEEDS)
    for config in configs:
        entry = report["configs"][config]
        # GRPO's recipe has a KL loss (0.001, low_var_kl): it measures the KL; OPO gets one of weight 0 to measure it
        kl_loss = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.0"]
        assert entry["added_overrides"] == ([] if config == "grpo" else kl_loss)
        assert entry["kl_loss_type"] == "low_var_kl"
        per_seed = {}
        for seed in SEEDS:
            run, metrics = logged(client, experiment.experiment_id, f"{config}-seed{seed}")
            assert run.info.status == "FINISHED" and entry["runs"][str(seed)]["run_id"] == run.info.run_id
            assert run.data.params["actor_rollout_ref.actor.measure_grad_variance"] == "True"
            assert sorted(metrics["val-core/arithmetic/reward/mean_at_1"]) == [0, STEPS]  # before training, and after
            grad_var = metrics["actor/grad_var"][STEPS]
            assert grad_var > 0 and metrics["actor/grad_var_relative"][STEPS] > 0
            assert metrics["actor/kl_loss"][STEPS] == pytest.approx(
                0.0, abs=1e-6
            )  # the first step's policy is the initial one
            expected = {
                "final_score": metrics["val-core/arithmetic/reward/mean_at_1"][STEPS],
                "kl_to_initial": metrics["actor/kl_loss"][STEPS],
                "entropy": metrics["actor/entropy"][STEPS],
                "grad_var": grad_var,
                "grad_var_relative": metrics["actor/grad_var_relative"][STEPS],
            }
            for key, value in expected.items():
                assert entry["runs"][str(seed)][key] == pytest.approx(value, rel=1e-12), (config, seed, key)
            per_seed[seed] = expected
        for key in ("final_score", "entropy", "grad_var"):
            values = [per_seed[seed][key] for seed in SEEDS]
            half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
            assert entry["summary"][key]["mean"] == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert entry["summary"][key]["ci95_half_width"] == pytest.approx(half, rel=1e-9, abs=1e-15)


def test_the_markdown_report_and_the_plot_are_written(compared):
    compared, configs = compared
    markdown = (compared / "report.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith(tuple(f"| {config} |" for config in configs))]
    assert len(rows) == len(configs) and "95% Student-t" in markdown
    assert (compared / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (compared / "runs").glob("*.log")) == [
        f"{config}-seed{seed}.log" for config in configs for seed in SEEDS
    ]
