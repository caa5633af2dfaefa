"""``algorithm.rollout_mismatch``: the streak of training steps whose rollout-vs-actor probability gap is above
the bound (hand-computed sequences: resets, steps without the metric, nan, patience, off), the message that
stops the run, and the keys' defaults, rules and documentation. The trainer's side:
tests/trainer/test_rollout_mismatch_stops_run.py."""

from __future__ import annotations

import math

import pytest

from dsrl import config as C
from dsrl.checkpoint import save as ckpt
from dsrl.config import load_config
from dsrl.tracking.console import ProgressConsole
from dsrl.trainer.stops import STREAK, RolloutMismatch
from tests.conftest import QUICKSTART, config_problems, stub_file_overrides


def gate(*overrides: str) -> RolloutMismatch:
    return RolloutMismatch(load_config(None, ["actor_rollout_ref.rollout.name=hf", *overrides]))


def step_metrics(mean: float, valid: bool = True, top: float | None = None) -> dict[str, float]:
    """What ``dsrl.trainer.metrics.rollout_logprob_metrics`` gives: nan gaps when no rank has a response token."""
    if not valid:
        mean = top = math.nan
    return {
        "training/rollout_probs_diff_valid": float(valid),
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_max": 2 * mean if top is None else top,
    }


def run(mismatch: RolloutMismatch, steps: list[dict[str, float]]) -> tuple[list[int], int | None]:
    """The streak after each step, and the step whose record returned a message (None if none did)."""
    streaks, stopped = [], None
    for step, metrics in enumerate(steps, 1):
        message = mismatch.record(metrics, step)
        streaks.append(metrics.get(STREAK))
        if message is not None:
            stopped = step
            break
    return streaks, stopped


# ---------------------------------------------------------------- the streak


def test_the_defaults_stop_after_three_steps_in_a_row_above_0_05():
    streaks, stopped = run(gate(), [step_metrics(v) for v in (0.01, 0.06, 0.05, 0.2, 0.3, 0.051, 0.9)])
    # 0.05 is at the bound, not above it: it resets; 0.2, 0.3, 0.051 are the three in a row.
    assert streaks == [0, 1, 0, 1, 2, 3] and stopped == 6


def test_a_step_within_the_bound_resets_the_streak():
    streaks, stopped = run(
        gate("algorithm.rollout_mismatch.patience=2"), [step_metrics(v) for v in (0.1, 0.01, 0.1, 0.01, 0.1, 0.1)]
    )
    assert streaks == [1, 0, 1, 0, 1, 2] and stopped == 6


def test_steps_without_the_metric_neither_count_nor_reset():
    steps = [
        step_metrics(0.1),
        step_metrics(0, valid=False),
        step_metrics(0.1),
        step_metrics(0, valid=False),
        step_metrics(0.1),
    ]
    streaks, stopped = run(gate(), steps)
    assert streaks == [1, 1, 2, 2, 3] and stopped == 5
    # A step whose metrics lack the check altogether counts as one without it.
    mismatch = gate("algorithm.rollout_mismatch.patience=1")
    assert mismatch.record({}, 1) is None and mismatch.streak == []


def test_a_nan_gap_on_a_valid_step_counts_as_above_the_bound():
    streaks, stopped = run(gate(), [step_metrics(math.nan), step_metrics(0.1), step_metrics(math.nan)])
    assert streaks == [1, 2, 3] and stopped == 3


def test_patience_1_stops_at_the_first_step_above_the_bound():
    streaks, stopped = run(
        gate("algorithm.rollout_mismatch.patience=1", "algorithm.rollout_mismatch.max_probs_diff=1e-4"),
        [step_metrics(v) for v in (1e-7, 1e-4, 2e-4, 1e-7)],
    )
    assert streaks == [0, 0, 1] and stopped == 3


def test_null_turns_it_off_and_adds_no_metric():
    mismatch = gate("algorithm.rollout_mismatch.max_probs_diff=null")
    for step in range(1, 11):
        metrics = step_metrics(1.0)
        assert mismatch.record(metrics, step) is None
        assert STREAK not in metrics


def test_the_message_names_the_steps_their_gaps_the_keys_and_the_causes():
    mismatch = gate("algorithm.rollout_mismatch.max_probs_diff=0.001", "algorithm.rollout_mismatch.patience=2")
    assert mismatch.record(step_metrics(0.5), 6) is None
    assert mismatch.record(step_metrics(0.0009, top=0.75), 7) is None  # a reset
    assert mismatch.record(step_metrics(0.00123, top=0.5), 8) is None
    message = mismatch.record(step_metrics(0.0456, top=0.987), 9)
    assert mismatch.record(step_metrics(0.0), 10) is None  # a reset
    assert message == (
        "step 9: the rollout's token probabilities left the actor's in 2 steps in a row "
        "(training/rollout_probs_diff_mean above algorithm.rollout_mismatch.max_probs_diff=0.001, patience=2; "
        "step 8: 0.00123 (max 0.5), step 9: 0.0456 (max 0.987)): the rollout is not sampling from the policy being "
        "trained. Likely causes: stale rollout weights: a weight push that failed or was skipped (look for "
        "update_weights in the log); a dtype mismatch between rollout and actor (here the rollout runs in "
        "bfloat16, the actor in bfloat16: actor_rollout_ref.model.dtype, which the transformers rollout follows); a "
        "padded vocabulary: output-layer rows beyond the tokenizer's vocabulary that one side masks and the other "
        "does not. Fix it, then run again (trainer.resume_mode=auto resumes from the last checkpoint); "
        "algorithm.rollout_mismatch.max_probs_diff=null trains on regardless"
    )


@pytest.mark.parametrize(
    "overrides, sleep_named, dtypes",
    [
        (["actor_rollout_ref.rollout.name=vllm"], True, ("bfloat16", "bfloat16")),
        (
            ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.sleep_level=1"],
            False,
            ("bfloat16", "bfloat16"),
        ),
        (
            ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enable_sleep_mode=false"],
            False,
            ("bfloat16", "bfloat16"),
        ),
        (
            [
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.dtype=bfloat16",
                "actor_rollout_ref.model.dtype=float32",
            ],
            True,
            ("bfloat16", "float32"),
        ),
        (
            ["actor_rollout_ref.model.dtype=float32"],
            False,
            ("float32", "float32"),
        ),  # hf: the rollout runs in the model's
    ],
)
def test_the_causes_follow_the_rollout_engine_and_its_precision(overrides, sleep_named, dtypes):
    mismatch = gate("algorithm.rollout_mismatch.patience=1", *overrides)
    message = mismatch.record(step_metrics(0.3), 1)
    assert ("vLLM woken from sleep level 2 without a full push" in message) == sleep_named
    vllm = "actor_rollout_ref.rollout.name=vllm" in overrides
    keys = (
        "actor_rollout_ref.rollout.dtype, actor_rollout_ref.model.dtype"
        if vllm
        else "actor_rollout_ref.model.dtype, which the transformers rollout follows"
    )
    assert f"here the rollout runs in {dtypes[0]}, the actor in {dtypes[1]}: {keys})" in message
    assert "stale rollout weights" in message and "padded vocabulary" in message


def test_the_console_shows_the_streak_while_it_is_not_zero():
    import io

    stream = io.StringIO()
    progress = ProgressConsole(3, stream=stream, tty=False)
    for step, streak in enumerate((0, 2, 0), 1):
        progress.log_metrics({"critic/score/mean": 0.0, STREAK: float(streak)}, step=step)
    lines = stream.getvalue().splitlines()
    assert "rollout_mismatch" not in lines[0] + lines[2]
    assert "score=0 rollout_mismatch=2 eta" in lines[1]


# ---------------------------------------------------------------- the keys


@pytest.fixture
def files(tmp_path):
    return stub_file_overrides(tmp_path)


def test_defaults_0_05_and_3_and_null_turns_it_off(files):
    cfg, _ = C.load_and_validate(QUICKSTART, files, 1)
    assert cfg.algorithm.rollout_mismatch.max_probs_diff == 0.05
    assert cfg.algorithm.rollout_mismatch.patience == 3
    assert "training/rollout_probs_diff_mean" in C.SCHEMA["algorithm.rollout_mismatch.max_probs_diff"].help
    assert "null = never" in C.SCHEMA["algorithm.rollout_mismatch.max_probs_diff"].help
    cfg, _ = C.load_and_validate(QUICKSTART, files + ["algorithm.rollout_mismatch.max_probs_diff=null"], 1)
    assert cfg.algorithm.rollout_mismatch.max_probs_diff is None


@pytest.mark.parametrize(
    "override, start, rule, fix",
    [
        ("max_probs_diff=0", "max_probs_diff=0.0:", "must be in (0, 1), or null for never", "set it to 0.05"),
        ("max_probs_diff=-0.1", "max_probs_diff=-0.1:", "must be in (0, 1)", "set it to 0.05"),
        ("max_probs_diff=1", "max_probs_diff=1.0:", "the mean |p_rollout - p_actor| is at most 1", "set it to 0.05"),
        ("max_probs_diff=inf", "max_probs_diff=inf:", "must be finite", "0.05"),
        ("patience=0", "patience=0:", "must be >= 1", "set it to 3"),
        ("patience=-2", "patience=-2:", "must be >= 1", "set it to 3"),
    ],
)
def test_values_out_of_range_are_refused_with_the_rule_and_the_fix(files, override, start, rule, fix):
    [violation] = config_problems(QUICKSTART, files + [f"algorithm.rollout_mismatch.{override}"])
    assert violation.startswith(f"algorithm.rollout_mismatch.{start}"), violation
    assert rule in violation and fix in violation


def test_a_patience_that_is_not_a_whole_number_is_refused(files):
    [violation] = config_problems(QUICKSTART, files + ["algorithm.rollout_mismatch.patience=1.5"])
    assert violation.startswith("algorithm.rollout_mismatch.patience=1.5"), violation


def test_show_keys_lists_both_keys_with_their_defaults():
    from dsrl.config.reference import describe_keys

    lines = describe_keys("algorithm.rollout_mismatch")
    assert lines[0].startswith("# algorithm.rollout_mismatch: ")
    assert lines[1].startswith("algorithm.rollout_mismatch.max_probs_diff: float | null = 0.05  # stop the run when")
    assert lines[2].startswith("algorithm.rollout_mismatch.patience: int = 3  # training steps in a row")
    assert len(lines) == 3


def test_changing_the_gate_does_not_block_a_resume():
    saved = ckpt.state_config(load_config(None, []), world_size=1)
    now = ckpt.state_config(
        load_config(None, ["algorithm.rollout_mismatch.max_probs_diff=null", "algorithm.rollout_mismatch.patience=9"]),
        world_size=1,
    )
    assert ckpt.config_differences(saved, now) == []
