"""``dsrl-eval`` end to end on the tiny model and the arithmetic prompts, as a process of its own: the report's
numbers against its own per-prompt rows and against validation's metrics, the MLflow run it logs, and an A/B of one
model against itself under greedy decoding (a difference of exactly 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.commands.evaluate import pass_at_k, pass_sizes
from dsrl.runtime.launch import LAUNCHER_VARIABLES
from dsrl.trainer.metrics import validation_metrics
from tests.conftest import REPO

PROMPTS = 5


def run_eval(args: list[str], store: str, *, launcher=(), timeout: int = 300) -> subprocess.CompletedProcess:
    """``dsrl-eval args`` as this checkout runs it (``python -m dsrl.commands.evaluate``, the installed command's function), in
    a process of its own (under ``launcher``, e.g. the deepspeed runner's arguments before ``--module``)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": store, "DEEPSPEED_TIMEOUT": "3",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    command = [*launcher, "--module", "dsrl.commands.evaluate"] if launcher else [sys.executable, "-m", "dsrl.commands.evaluate"]
    return subprocess.run([*command, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def check_report(report: dict, n: int, correct) -> None:
    """The report's numbers against its own rows: each prompt's mean@n, correct count and pass@k, the data source's
    averages of them, and every validation metric as ``validation_metrics`` of the rows (``correct(response)``:
    whether a response counts for pass@k)."""
    [model] = report["models"]
    prompts, metrics = model["prompts"], model["metrics"]
    assert [p["index"] for p in prompts] == list(range(PROMPTS))
    for prompt in prompts:
        scores = [r["score"] for r in prompt["responses"]]
        assert len(scores) == n
        assert prompt[f"mean@{n}"] == pytest.approx(sum(scores) / n)
        assert prompt["correct"] == sum(map(correct, prompt["responses"]))
        assert prompt["pass"] == {f"pass@{k}": pytest.approx(pass_at_k(n, prompt["correct"], k)) for k in pass_sizes(n)}
    for k in pass_sizes(n):
        average = sum(p["pass"][f"pass@{k}"] for p in prompts) / PROMPTS
        assert metrics[f"eval/arithmetic/pass@{k}"] == pytest.approx(average)
    average = sum(p[f"mean@{n}"] for p in prompts) / PROMPTS
    assert metrics[f"val-core/arithmetic/reward/mean@{n}"] == pytest.approx(average)
    assert model["score"] == metrics["eval/score"] == metrics[f"val-core/arithmetic/reward/mean@{n}"]
    rows = [(p["index"], r) for p in prompts for r in p["responses"]]
    extras = sorted(set(rows[0][1]) - {"response", "score"})
    expected = validation_metrics(
        ["arithmetic"] * len(rows), [index for index, _ in rows],
        {"reward": [r["score"] for _, r in rows], **{name: [r[name] for _, r in rows] for name in extras}},
    )
    validation = {k: v for k, v in metrics.items() if k.startswith(("val-core/", "val-aux/arithmetic/"))}
    assert validation == pytest.approx(expected)


def common(arithmetic_data) -> list[str]:
    return ["--data", str(arithmetic_data / "test.parquet"), "--config", "cpu", "--max-samples", str(PROMPTS)]


@pytest.fixture(scope="module")
def sampled(tiny_model_dir, arithmetic_data, tmp_path_factory):
    """Two sampled responses per prompt, scored by the digits reward (so scores vary), correct from one digit on."""
    out = tmp_path_factory.mktemp("eval")
    store = f"sqlite:///{out / 'mlflow.db'}"
    result = run_eval([str(tiny_model_dir), *common(arithmetic_data), "--n", "2", "--temperature", "1.0",
                       "--reward-file", f"{arithmetic_data / 'digits_reward.py'}:compute_score",
                       "--correct-threshold", "0.25", "--out", str(out / "report.json")], store)
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
    mlflow = pytest.importorskip("mlflow")  # the vLLM tier's environment, which imports this module, has none
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
    result = run_eval([str(tiny_model_dir), str(tiny_model_dir), *common(arithmetic_data),
                       "--no-mlflow", "--out", str(tmp_path / "ab.json")], "sqlite:///unused.db")
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
    result = run_eval([str(tmp_path / "no-model"), "--data", str(arithmetic_data / "test.parquet"), "--no-mlflow"],
                      "sqlite:///unused.db", timeout=60)
    assert result.returncode == 2
    assert f"actor_rollout_ref.model.path={tmp_path / 'no-model'}: no such model directory" in result.stderr
