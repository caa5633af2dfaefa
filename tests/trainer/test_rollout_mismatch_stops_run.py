"""A run whose rollout keeps stale weights stops (``algorithm.rollout_mismatch``): ``dsrl-train`` in-process on
the tiny model with the transformers rollout's weight push made a no-op. Step 1 samples from the initial
weights, which the actor still holds; from step 2 the actor has trained and the rollout has not, so the
rollout-vs-actor gap leaves the bound and after ``patience`` such steps the run exits 1 with the gate's message,
the MLflow run FAILED and nothing saved. With the gate off the same run trains to the end. The streak's
logic: tests/trainer/test_rollout_mismatch.py."""

from __future__ import annotations

import re
from collections import deque

import pytest

from tests.conftest import recipe

pytestmark = pytest.mark.e2e

mlflow = pytest.importorskip("mlflow")

STEPS = 4
# Measured on this run: with the weights pushed, the fp32 rollout and actor differ by ~2e-9 (mean) each step;
# with the push broken, step 1 still ~2e-9 (both hold the initial weights), then ~8e-4, 1.2e-3, 1.7e-3 as the
# actor trains (the CPU overlay's lr 1e-4) away from the rollout's weights.
BOUND = 1e-5


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


@pytest.fixture
def stale_rollout(monkeypatch):
    """The transformers rollout's push reads the actor's parameters (a collective) and copies none of them."""
    from dsrl.rollout import HFRollout

    monkeypatch.setattr(HFRollout, "update_weights", lambda self, named_tensors: deque(named_tensors, maxlen=0))


def train(tiny_model_dir, data, ds_test_config, out, *overrides) -> int:
    """``dsrl-train grpo cpu`` on the tiny model and the digits reward, ``STEPS`` steps; its exit code."""
    from dsrl.commands.train import main

    return main(
        [
            *recipe("grpo"),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.parquet'}",
            "data.val_files=null",
            f"custom_reward_function.path={data / 'digits_reward.py'}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.logger=[console,mlflow]",
            f"trainer.default_local_dir={out}",
            "reward.num_workers=1",
            f"algorithm.rollout_mismatch.max_probs_diff={BOUND}",
            "algorithm.rollout_mismatch.patience=2",
            *overrides,
        ]
    )


def history(store, name: str) -> list[tuple[int, float]]:
    [run] = store.search_runs([store.get_experiment_by_name("dsrl").experiment_id])
    return [(m.step, m.value) for m in store.get_metric_history(run.info.run_id, name)]


def test_a_rollout_left_with_stale_weights_stops_the_run(
    store,
    stale_rollout,
    tiny_model_dir,
    arithmetic_data,
    ds_test_config,
    world_of_one,
    deepspeed_cpu_ops,
    tmp_path,
    capfd,
):
    out = tmp_path / "run"
    code = train(tiny_model_dir, arithmetic_data, ds_test_config, out)
    stdout, stderr = capfd.readouterr()
    assert code == 1, stderr[-3000:]
    [run] = store.search_runs([store.get_experiment_by_name("dsrl").experiment_id])
    assert run.info.status == "FAILED"
    # Step 1 is healthy; steps 2 and 3 are the streak; step 3 stops the run before it is logged.
    gaps = history(store, "training/rollout_probs_diff_mean")
    assert [step for step, _ in gaps] == [1, 2]
    assert gaps[0][1] < BOUND < gaps[1][1]
    assert history(store, "training/rollout_mismatch_streak") == [(1, 0.0), (2, 1.0)]
    message = re.search(r"dsrl: (step 3: the rollout's token probabilities .*)\n", stderr).group(1)
    assert message.startswith(
        "step 3: the rollout's token probabilities left the actor's in 2 steps in a row "
        f"(training/rollout_probs_diff_mean above algorithm.rollout_mismatch.max_probs_diff={BOUND:g}, patience=2; "
        f"step 2: {gaps[1][1]:.3g} (max "
    )
    assert re.search(
        r", step 3: [\d.e-]+ \(max [\d.e-]+\)\): the rollout is not sampling from the policy being trained", message
    )
    for cause in (
        "stale rollout weights: a weight push that failed or was skipped",
        "a dtype mismatch between rollout and actor (here the rollout runs in float32, the actor in float32",
        "a padded vocabulary",
    ):
        assert cause in message
    assert "sleep level 2" not in message  # the transformers rollout has no sleep mode
    assert message.endswith("algorithm.rollout_mismatch.max_probs_diff=null trains on regardless")
    # The console: the streak on step 2's line, the final summary's status; nothing saved, nothing exported.
    assert re.search(r"\] step 2/4 .* rollout_mismatch=1 ", stdout) and not re.search(r"\] step 3/4 ", stdout)
    assert re.search(r"status\W+failed", stdout + stderr) and re.search(r"steps\W+2/4", stdout + stderr)
    assert not list(out.glob("global_step_*")) and not (out / "huggingface").exists()


def test_with_the_gate_off_the_same_run_trains_to_the_end(
    store,
    stale_rollout,
    tiny_model_dir,
    arithmetic_data,
    ds_test_config,
    world_of_one,
    deepspeed_cpu_ops,
    tmp_path,
):
    code = train(
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "run",
        "algorithm.rollout_mismatch.max_probs_diff=null",
    )
    assert code == 0
    [run] = store.search_runs([store.get_experiment_by_name("dsrl").experiment_id])
    assert run.info.status == "FINISHED"
    gaps = history(store, "training/rollout_probs_diff_mean")
    assert [step for step, _ in gaps] == [1, 2, 3, 4] and all(gap > BOUND for _, gap in gaps[1:])
    assert history(store, "training/rollout_mismatch_streak") == []


def test_a_push_that_leaves_the_experts_stale_stops_the_run(
    store, moe_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, monkeypatch
):
    """A mixture of experts whose push writes every tensor but the experts' (``mlp.experts.<e>.*``, the checkpoint
    names a push converts the fused tensors to): the attention, norms and routers follow the actor, the experts keep
    their start-up weights, and the gate stops the run as it does for a wholly stale rollout."""
    from dsrl.rollout import HFRollout

    def all_but_the_experts(self, named_tensors):
        for name, tensor in named_tensors:
            if ".experts." not in name:
                self.pushed.write(name, tensor)

    monkeypatch.setattr(HFRollout, "update_weights", all_but_the_experts)
    code = train(moe_model_dir, arithmetic_data, ds_test_config, tmp_path / "run")
    assert code == 1
    gaps = history(store, "training/rollout_probs_diff_mean")
    assert [step for step, _ in gaps] == [1, 2] and gaps[0][1] < BOUND < gaps[1][1]
