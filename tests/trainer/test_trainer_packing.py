"""``use_remove_padding`` in a whole run (a recipe under the CPU overlay, the tiny model, ZeRO-3 + CPU offload, two
steps): every metric of the packed run (with ``use_prefix_grouper``: one copy of each prompt) equals the padded run's
to float rounding, and the final weights too; ``perf/padding_ratio`` and ``perf/dedup_ratio`` say what was saved."""

from __future__ import annotations

import pytest

from tests.conftest import RANK_LOCAL
from tests.helpers.trainer import trainer_for

pytestmark = pytest.mark.e2e


def layout(packed: bool, dedup: bool = False) -> tuple[str, ...]:
    """Overrides that set the forwards' layout whatever the CPU overlay sets (never shared_prompt_forward)."""
    return (
        f"actor_rollout_ref.model.use_remove_padding={packed}",
        f"critic.model.use_remove_padding={packed}",
        f"actor_rollout_ref.actor.use_prefix_grouper={dedup}",
        "actor_rollout_ref.model.shared_prompt_forward=false",
    )


PADDED, PACKED, DEDUP = layout(False), layout(True), layout(True, dedup=True)
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")


def logged_run(name, tiny_model_dir, data, ds_test_config, out, *overrides):
    from dsrl.engines.weight_sync import iter_full_parameters

    trainer = trainer_for(name, tiny_model_dir, data, ds_test_config, out, "trainer.test_freq=-1", *overrides)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append(metrics)
    trainer.fit()
    logged = [metrics for metrics in logged if not all(key.startswith("val-") for key in metrics)]
    return logged, {key: tensor.clone() for key, tensor in iter_full_parameters(trainer.actor.module)}


@pytest.mark.parametrize(
    "name, extra, packing",
    [
        pytest.param("grpo", (), DEDUP, id="grpo-dedup"),
        pytest.param("ppo", (), PACKED, marks=pytest.mark.slow, id="ppo"),
        pytest.param("grpo", LORA, DEDUP, marks=pytest.mark.slow, id="grpo-lora-dedup"),
    ],
)
def test_a_packed_run_logs_and_trains_as_the_padded_run(
    name, extra, packing, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    critic = (f"critic.model.path={tiny_model_dir}",) if name == "ppo" else ()
    runs = {
        arm: logged_run(
            name,
            tiny_model_dir,
            arithmetic_data,
            ds_test_config,
            tmp_path / arm,
            *critic,
            *extra,
            *arm_layout,
        )
        for arm, arm_layout in (("padded", PADDED), ("packed", packing))
    }
    assert_same_runs(runs)
    (padded, _), (packed, _) = runs["padded"], runs["packed"]
    for before, after in zip(padded, packed, strict=True):
        assert after["perf/micro_batches/actor_update"] >= 1
        assert (after["perf/dedup_ratio"] > 0) == (packing == DEDUP)  # a prompt runs once for its n responses
        assert before["perf/dedup_ratio"] == 0


@pytest.mark.slow
def test_a_packed_multi_turn_run_logs_and_trains_as_the_padded_run(
    tool_model_dir, calculator_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """Tool outputs are in the response's context but not trained on: packed rows keep them as tokens."""
    from tests.trainer.test_trainer_multi_turn import TURNS_REWARD, multi_turn_overrides

    reward = tmp_path / "turns_reward.py"
    reward.write_text(TURNS_REWARD)
    overrides = multi_turn_overrides(tool_model_dir, calculator_data, reward)
    runs = {
        arm: logged_run(
            "grpo", tool_model_dir, calculator_data, ds_test_config, tmp_path / arm, *overrides, *arm_layout
        )
        for arm, arm_layout in (("padded", PADDED), ("packed", DEDUP))
    }
    assert sum(metrics["multi_turn/calls_per_response/mean"] for metrics in runs["padded"][0]) > 0
    assert_same_runs(runs)


def assert_same_runs(runs: dict) -> None:
    """The padded and packed runs logged the same steps with the same metrics (all but the rank-local timings) to
    float rounding, and their final weights differ by float rounding."""
    (padded, padded_params), (packed, packed_params) = runs["padded"], runs["packed"]
    assert len(padded) == len(packed) == 2
    assert_same_logs(padded, packed)
    worst = max((packed_params[key] - padded_params[key]).abs().max().item() for key in padded_params)
    assert worst < 1e-5, worst


def assert_same_logs(padded: list[dict], packed: list[dict]) -> None:
    """Step by step, the same metrics (all but the rank-local ones) to float rounding."""
    for step, (expected, got) in enumerate(zip(padded, packed, strict=True), 1):
        kept = {key for key in expected if not key.startswith(RANK_LOCAL)}
        assert kept == {key for key in got if not key.startswith(RANK_LOCAL)}
        different = {
            key: (expected[key], got[key])
            for key in kept
            if got[key] != pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True)
        }
        assert not different, (step, different)
