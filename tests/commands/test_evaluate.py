"""``dsrl-eval`` end to end on the tiny model and the arithmetic prompts, as a process of its own: the report's
numbers against its own per-prompt rows and against validation's metrics, the MLflow run it logs, and an A/B of one
model against itself under greedy decoding (a difference of exactly 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.eval_runs import PROMPTS, check_report, common, run_eval

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sampled(tiny_model_dir, arithmetic_data, tmp_path_factory):
    """Two sampled responses per prompt, scored by the digits reward (so scores vary), correct from one digit on."""
    out = tmp_path_factory.mktemp("eval")
    store = f"sqlite:///{out / 'mlflow.db'}"
    result = run_eval(
        [
            str(tiny_model_dir),
            *common(arithmetic_data),
            "--n",
            "2",
            "--temperature",
            "1.0",
            "--reward-file",
            f"{arithmetic_data / 'digits_reward.py'}:compute_score",
            "--correct-threshold",
            "0.25",
            "--out",
            str(out / "report.json"),
        ],
        store,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads((out / "report.json").read_text()), store, result.stdout + result.stderr, out


def test_the_report_agrees_with_its_rows(sampled):
    report, _, console, _ = sampled
    check_report(report, 2, lambda response: response["score"] >= 0.25)
    responses = [r for p in report["models"][0]["prompts"] for r in p["responses"]]
    assert all(r["digits"] / 4 == r["score"] for r in responses)  # the reward file's extra, and its score
    assert len({r["score"] for r in responses}) > 1  # scores that vary: the checks above can fail
    assert set(report["models"][0]["timing_s"]) == {"timing_s/load", "timing_s/gen", "timing_s/reward"}
    assert report["settings"]["actor_rollout_ref.rollout.val_kwargs.n"] == 2
    assert "arithmetic: 5 prompts, reward mean@2" in console


def test_the_mlflow_run_holds_params_metrics_and_the_generations(sampled, tmp_path):
    import mlflow

    report, store, _, out = sampled
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    [run] = client.search_runs([client.get_experiment_by_name("dsrl").experiment_id])
    assert run.info.run_id == report["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["dsrl.kind"] == "eval"
    assert run.data.params["actor_rollout_ref.rollout.val_kwargs.n"] == "2"
    assert run.data.metrics["eval/score"] == pytest.approx(report["models"][0]["score"])
    assert "eval/arithmetic/pass_at_2" in run.data.metrics  # MLflow's name for pass@2
    downloaded = client.download_artifacts(run.info.run_id, "generations/eval.json", str(tmp_path))
    table = json.loads(Path(downloaded).read_text())
    responses = [r["response"] for p in report["models"][0]["prompts"] for r in p["responses"]]
    assert [row[table["columns"].index("response")] for row in table["data"]] == responses
    assert (out / "reward_workers_rank0.log").exists()  # the reward workers' output, beside the report


def test_a_model_against_itself_greedy_differs_by_zero(tiny_model_dir, arithmetic_data, tmp_path):
    result = run_eval(
        [
            str(tiny_model_dir),
            str(tiny_model_dir),
            *common(arithmetic_data),
            "--no-mlflow",
            "--out",
            str(tmp_path / "ab.json"),
        ],
        "sqlite:///unused.db",
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads((tmp_path / "ab.json").read_text())
    a, b = report["models"]
    assert [r["response"] for p in a["prompts"] for r in p["responses"]] == [
        r["response"] for p in b["prompts"] for r in p["responses"]
    ]
    comparison = report["comparison"]
    assert (comparison["difference"], comparison["ci_low"], comparison["ci_high"]) == (0.0, 0.0, 0.0)
    assert [p["difference"] for p in comparison["per_prompt"]] == [0.0] * PROMPTS
    assert "percentile interval of a paired bootstrap" in comparison["interval"]
    assert "mlflow_run_id" not in report and not (REPO / "unused.db").exists()


def test_a_missing_model_exits_2_naming_the_key(arithmetic_data, tmp_path):
    result = run_eval(
        [str(tmp_path / "no-model"), "--data", str(arithmetic_data / "test.parquet"), "--no-mlflow"],
        "sqlite:///unused.db",
        timeout=60,
    )
    assert result.returncode == 2
    assert f"actor_rollout_ref.model.path={tmp_path / 'no-model'}: no such model directory" in result.stderr


def test_a_reward_model_scores_the_responses(tiny_model_dir, tiny_reward_model_dir, arithmetic_data, tmp_path):
    """With ``reward_model.enable`` and no reward function, the reward model's score is each response's, as in the
    trainer's validation; it is the reward extra ``reward_model_score`` too."""
    result = run_eval(
        [
            str(tiny_model_dir),
            *common(arithmetic_data),
            "reward_model.enable=true",
            f"reward_model.model.path={tiny_reward_model_dir}",
            "--no-mlflow",
            "--out",
            str(tmp_path / "report.json"),
        ],
        "sqlite:///unused.db",
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (model,) = json.loads((tmp_path / "report.json").read_text())["models"]
    responses = [r for p in model["prompts"] for r in p["responses"]]
    assert len(responses) == PROMPTS and all(r["score"] == r["reward_model_score"] for r in responses)
    assert len({r["score"] for r in responses}) > 1  # the model's scores, not a constant
    mean = sum(r["score"] for r in responses) / len(responses)
    assert model["metrics"]["val-aux/arithmetic/reward_model_score/mean@1"] == pytest.approx(mean, abs=1e-6)
