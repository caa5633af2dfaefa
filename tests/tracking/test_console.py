"""Console output: log lines (rank, time, rank filter, warnings once), the per-step progress (a line per
step off a terminal, a tqdm bar on one), and the start-up and final summaries."""

from __future__ import annotations

import io
import logging
import os
import re
import warnings

import pytest

from dsrl.tracking import console
from dsrl.tracking.console import (
    ProgressConsole,
    RankWarning,
    final_summary,
    format_count,
    logger,
    setup_logging,
    startup_summary,
)

PREFIX = r"\[dsrl r{rank} \d\d:\d\d:\d\d\] "
DSRL_FILE = os.path.join(os.path.dirname(console.__file__), "tracking.py")


@pytest.fixture(autouse=True)
def restore_logging():
    """Each test sets the dsrl logger up as it needs; the next one finds it as it was."""
    handlers, level, showwarning = list(logger.handlers), logger.level, warnings.showwarning
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    warnings.showwarning = showwarning
    console._active_bar = None


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


# ---- log lines --------------------------------------------------------------------------------------


def test_log_lines_carry_rank_and_time_and_only_dsrl_records_print(capsys):
    setup_logging(0)
    logger.info("resumed from x (step %d)", 4)
    logging.getLogger("dsrl.data.datasets").warning("dropped %d of %d prompts", 2, 4)  # a child logger
    logging.getLogger("other").warning("not ours")
    out = lines(capsys.readouterr().out)
    assert len(out) == 2
    assert re.fullmatch(PREFIX.format(rank=0) + r"resumed from x \(step 4\)", out[0])
    assert re.fullmatch(PREFIX.format(rank=0) + r"warning: dropped 2 of 4 prompts", out[1])


def test_records_still_reach_caplog(caplog):
    setup_logging(0)
    with caplog.at_level(logging.WARNING):
        logging.getLogger("dsrl.rewards.scorer").warning("reward: 1 of 2 calls failed")
    assert "reward: 1 of 2 calls failed" in caplog.text


def test_other_ranks_print_only_their_own_records(capsys):
    setup_logging(1)
    logger.info("the same on every rank")
    logger.warning("a shared warning")
    logger.info("rank 1: SIGTERM received", extra={"all_ranks": True})
    out = lines(capsys.readouterr().out)
    assert len(out) == 1 and re.fullmatch(PREFIX.format(rank=1) + "rank 1: SIGTERM received", out[0])


def test_setup_is_idempotent_and_takes_the_new_rank(capsys):
    setup_logging(0)
    setup_logging(2)
    logger.info("once", extra={"all_ranks": True})
    out = lines(capsys.readouterr().out)
    assert len(out) == 1 and out[0].startswith("[dsrl r2 ")
    assert sum(isinstance(h, console._ConsoleHandler) for h in logger.handlers) == 1


def test_an_injected_stream_gets_the_lines(capsys):
    stream = io.StringIO()
    setup_logging(0, stream=stream)
    logger.info("to the stream")
    assert capsys.readouterr().out == "" and stream.getvalue().endswith("] to the stream\n")


def test_warning_records_print_once(capsys):
    setup_logging(0)
    for _ in range(3):
        logger.warning("the tokenizer has no pad token")
    logger.warning("another warning")
    logger.info("info lines repeat")
    logger.info("info lines repeat")
    out = capsys.readouterr().out
    assert out.count("the tokenizer has no pad token") == 1
    assert out.count("another warning") == 1 and out.count("info lines repeat") == 2


def warn_from_dsrl(message: str, category=UserWarning) -> None:
    warnings.warn_explicit(message, category, filename=DSRL_FILE, lineno=1, module="dsrl.tracking")


def test_python_warnings_from_dsrl_print_once_per_category_and_text(capsys):
    setup_logging(0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # Python's own once-per-location filter out of the way
        setup_logging(0)
        for _ in range(3):
            warn_from_dsrl("tracking: start failed (OSError: disk full); training continues")
        warn_from_dsrl("tracking: start failed (OSError: disk full); training continues", RuntimeWarning)
    out = lines(capsys.readouterr().out)
    assert len(out) == 2
    assert re.fullmatch(
        PREFIX.format(rank=0) + r"warning: tracking: start failed \(OSError: disk full\); training continues", out[0]
    )
    assert out[1].endswith("training continues (RuntimeWarning)")


def test_python_warnings_print_on_rank_0_unless_rank_specific(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        setup_logging(1)
        warn_from_dsrl("the same on every rank")
        warn_from_dsrl("rank 1 has no GPU memory left", RankWarning)
    out = lines(capsys.readouterr().out)
    assert len(out) == 1 and re.fullmatch(
        PREFIX.format(rank=1) + r"warning: rank 1 has no GPU memory left \(RankWarning\)", out[0]
    )


def test_other_packages_warnings_are_shown_as_python_shows_them(capsys, monkeypatch):
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        setup_logging(0)
        monkeypatch.setattr(console._showwarning, "previous", lambda message, *args: shown.append(str(message)))
        warnings.warn_explicit("from torch", UserWarning, filename="/site-packages/torch/x.py", lineno=1)
    assert shown == ["from torch"] and capsys.readouterr().out == ""


def test_the_cli_sets_logging_up_with_the_rank_of_the_environment(monkeypatch, tmp_path, capsys):
    from dsrl.commands.train import main

    monkeypatch.setattr(
        os, "environ", {**os.environ, "RANK": "3", "WORLD_SIZE": "4"}
    )  # what the CLI fills in stays here
    assert main([str(tmp_path / "missing.yaml"), "--validate-only"]) == 2  # a bad config: exits before training
    [handler] = [h for h in logger.handlers if isinstance(h, console._ConsoleHandler)]
    assert handler.rank == 3


# ---- training progress: a line per step when stdout is not a terminal ------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


STEP = {
    "critic/score/mean": 0.25,
    "response_length/mean": 3.42,
    "actor/kl_loss": 0.0012,
    "timing_s/step": 1.5,
    "perf/throughput": 812.4,
    "perf/total_num_tokens": 1000,
    "reward/fail_exception": 0.0,
    "reward/fail_timeout": 0.0,
    "tracking/failures": 0.0,
    "actor/pg_loss": 0.7,
}
VAL = {"val-core/arith/acc/mean@1": 0.125, "val-core/arith/reward/mean@1": 0.25, "val-aux/arith/acc/std@1": 0.1}


def test_step_line_shows_dynamic_sampling_rounds_above_one():
    for rounds, shown in ((1, ""), (3, " rounds=3")):
        stream = io.StringIO()
        progress = ProgressConsole(10, stream=stream, clock=Clock())
        progress.log_metrics({**STEP, "train/num_gen_batches": rounds}, step=1)
        progress.finish()
        [line] = lines(stream.getvalue())
        assert f"tok/s=812{shown} eta" in line


def test_step_lines_off_a_terminal():
    stream, clock = io.StringIO(), Clock()  # StringIO.isatty() is False
    progress = ProgressConsole(10, stream=stream, clock=clock)
    clock.now = 100.0  # the validation before training took 100 s: not a step
    progress.log_metrics(VAL, step=0)
    clock.now = 102.0
    progress.log_metrics(STEP, step=1)
    clock.now = 106.0
    failing = {k: v for k, v in STEP.items() if k != "actor/kl_loss"}
    progress.log_metrics(
        {
            **failing,
            "actor/reward_kl_penalty": 0.5,
            "reward/fail_exception": 3.0,
            "tracking/failures": 1.0,
            "tracking/dropped": 2.0,
        },
        step=2,
    )
    clock.now = 130.0
    progress.log_metrics({**STEP, **VAL, "val-core/arith/acc/mean@1": 0.5}, step=10)
    progress.finish()
    out = lines(stream.getvalue())
    assert len(out) == 5
    assert re.fullmatch(
        PREFIX.format(rank=0)
        + r"validation at step 0: val-core/arith/acc/mean@1=0\.125 val-core/arith/reward/mean@1=0\.25",
        out[0],
    )
    assert re.fullmatch(
        PREFIX.format(rank=0) + r"step  1/10 score=0\.25 resp_len=3\.4 kl=0\.0012 step_s=1\.50 tok/s=812 eta 0:00:18",
        out[1],
    )  # mean 2 s per step x 9 steps left
    assert out[2].endswith(
        "] step  2/10 score=0.25 resp_len=3.4 kl=0.5 step_s=1.50 tok/s=812 reward_exceptions=3 tracking_failures=1 "
        "tracking_dropped=2 eta 0:00:24"
    )
    assert out[3].endswith("] step 10/10 score=0.25 resp_len=3.4 kl=0.0012 step_s=1.50 tok/s=812 eta 0:00:00")
    assert out[4].endswith("] validation at step 10: val-core/arith/acc/mean@1=0.5 val-core/arith/reward/mean@1=0.25")
    assert progress.facts() == {"validation": {0: 0.1875, 10: 0.375}, "tokens": 3000, "last_step": 10}


def test_a_resumed_run_counts_its_eta_from_its_own_steps():
    stream, clock = io.StringIO(), Clock()
    progress = ProgressConsole(2, initial_step=1, stream=stream, clock=clock)
    progress.log_metrics(VAL, step=1)  # the validation before training, at the resumed step
    clock.now = 5.0
    progress.log_metrics({"critic/score/mean": 1.0}, step=2)
    out = lines(stream.getvalue())
    assert out[0].endswith("] validation at step 1: val-core/arith/acc/mean@1=0.125 val-core/arith/reward/mean@1=0.25")
    assert out[1].endswith("] step 2/2 score=1 eta 0:00:00")  # what tests/trainer/test_trainer_2ranks.py greps
    assert len(out) == 2


# ---- training progress: a tqdm bar on a terminal ----------------------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_with_log_lines_above_it():
    stream = FakeTerminal()
    setup_logging(0, stream=stream)
    progress = ProgressConsole(10, initial_step=2, stream=stream)
    assert progress.bar is not None and "2/10" in stream.getvalue()  # resumed: starts at its step
    progress.log_metrics(VAL, step=2)
    progress.log_metrics({**STEP, "reward/fail_timeout": 2.0}, step=3)
    logger.info("checkpoint saved to x")
    progress.finish()
    out = stream.getvalue()
    assert "3/10" in out and ("step/s" in out or "s/step" in out)
    assert "score=0.25 resp_len=3.4 kl=0.0012 step_s=1.50 tok/s=812 reward_timeouts=2" in out
    assert re.search(PREFIX.format(rank=0) + r"validation at step 2: val-core/arith/acc/mean@1=0\.125", out)
    assert re.search(PREFIX.format(rank=0) + "checkpoint saved to x\n", out)
    assert not re.search(r"\] step +3/10", out)  # no plain step line next to the bar
    assert progress.bar is None and console._active_bar is None
    progress.finish()  # idempotent


# ---- summaries --------------------------------------------------------------------------------------


def test_format_count():
    assert [format_count(n) for n in (494_032_768, 7_615_616_512, 1_234_567, 35_000, 812, None)] == [
        "494M",
        "7.6B",
        "1.2M",
        "35K",
        "812",
        "n/a",
    ]


def values(block: str) -> dict[str, str]:
    """key -> value of a summary block, checking that the values are aligned."""
    title, *rows = block.splitlines()
    starts = {len(row) - len(row.split(": ", 1)[1].lstrip()) for row in rows}
    assert len(starts) == 1, block
    return {row.split(":", 1)[0].strip(): row.split(": ", 1)[1].strip() for row in rows}


STARTUP = {
    "world_size": 2,
    "device": "cpu",
    "roles": {
        "actor": {
            "zero_stage": 3,
            "offload_params": True,
            "offload_optimizer": True,
            "dtype": "bfloat16",
            "params": 494_032_768,
            "gradient_checkpointing": True,
        },
        "reference": {
            "zero_stage": 3,
            "offload_params": True,
            "offload_optimizer": False,
            "dtype": "bfloat16",
            "params": 7_615_616_512,
        },
        "critic": None,
    },
    "rollout": "vllm (tp 2)",
    "estimator": "grpo",
    "policy_loss": "vanilla",
    "loss_agg_mode": "token-mean",
    "kl_loss": {"type": "low_var_kl", "coef": 0.001},
    "kl_in_reward": None,
    "prompts_per_step": 8,
    "n": 4,
    "optimizer_steps": {"actor": 2, "critic": None},
    "micro_batch_size": 4,
    "max_token_len": None,
    "prompts": {
        "train": {"rows": 1024, "kept": 1000, "filtered_overlong": 24, "truncated": 0},
        "val": {"rows": 50, "kept": 48, "filtered_overlong": 0, "truncated": 2},
    },
    "total_steps": 10,
    "start_step": 0,
    "resume_from": None,
    "checkpoint_dir": "checkpoints/dsrl/grpo",
    "save_freq": 5,
    "mlflow": {"tracking_uri": "sqlite:///mlflow.db", "experiment_id": "1", "run_id": "abc123"},
}


def test_startup_summary_shows_every_fact():
    block = startup_summary(STARTUP)
    assert block.splitlines()[0] == "start-up summary"
    assert values(block) == {
        "world": "2 rank(s), cpu",
        "actor": "ZeRO-3, offload params+optimizer, bfloat16, 494M params, gradient checkpointing",
        "reference": "ZeRO-3, offload params, bfloat16, 7.6B params",
        "critic": "none",
        "rollout": "vllm (tp 2)",
        "estimator": "grpo",
        "policy loss": "vanilla, loss_agg_mode token-mean",
        "kl": "loss low_var_kl coef 0.001; in reward off",
        "batch": "8 prompts x 4 = 32 responses per step",
        "optimizer steps": "actor 2, critic none per step",
        "micro-batches": "4 per rank",
        "train prompts": "1000 of 1024 kept, 24 filtered (over-long), 0 truncated",
        "val prompts": "48 of 50 kept, 0 filtered (over-long), 2 truncated",
        "steps": "10",
        "checkpoints": "checkpoints/dsrl/grpo, every 5 steps and at the end",
        "mlflow": "sqlite:///mlflow.db, experiment 1, run abc123",
    }


def test_startup_summary_variants():
    facts = {
        **STARTUP,
        "roles": {
            **STARTUP["roles"],
            "critic": {
                "zero_stage": 2,
                "dtype": "float32",
                "params": 35_000,
                "sequence_parallel": 2,
                "gradient_checkpointing": False,
            },
        },
        "kl_loss": None,
        "kl_in_reward": {"penalty": "kl", "coef": 0.05, "ctrl": "adaptive"},
        "optimizer_steps": {"actor": 4, "critic": 4},
        "max_token_len": 8192,
        "prompts": {"train": STARTUP["prompts"]["train"], "val": None},
        "start_step": 4,
        "resume_from": "checkpoints/dsrl/grpo/global_step_4",
        "save_freq": 0,
        "mlflow": None,
    }
    shown = values(startup_summary(facts))
    assert shown["critic"] == (
        "ZeRO-2, no offload, float32, 35K params, Ulysses sequence parallelism over 2 ranks, no gradient checkpointing"
    )
    assert shown["kl"] == "loss off; in reward kl coef 0.05 (adaptive)"
    assert shown["optimizer steps"] == "actor 4, critic 4 per step"
    assert shown["micro-batches"] == "token budget 8192 per rank (dynamic batch size)"
    assert shown["val prompts"] == "none"
    assert shown["steps"] == "10, resuming at step 4 from checkpoints/dsrl/grpo/global_step_4"
    assert shown["checkpoints"] == "checkpoints/dsrl/grpo, off"
    assert shown["mlflow"] == "off"


def test_startup_summary_shows_the_reward_model_and_the_teacher_only_when_on():
    assert not {"reward model", "teacher", "distillation"} & set(values(startup_summary(STARTUP)))
    rm = {**STARTUP["roles"]["reference"], "params": 494_033_664, "path": "/models/rm", "micro_batch_size": 8,
          "max_token_len": 8192, "max_length": 1536}  # fmt: skip
    teacher = {**STARTUP["roles"]["reference"], "path": "Qwen/Qwen2.5-7B-Instruct", "micro_batch_size": 16,
               "max_token_len": None}  # fmt: skip
    distill = {
        "teacher": teacher,
        "loss_mode": "k3",
        "use_policy_gradient": False,
        "use_task_rewards": True,
        "coef": 0.5,
    }
    shown = values(startup_summary({**STARTUP, "reward_model": rm, "distillation": distill}))
    assert shown["reward model"] == (
        "/models/rm, ZeRO-3, offload params, bfloat16, 494M params, micro-batches of 8192 tokens per rank (dynamic "
        "batch size), sequences up to 1536 tokens"
    )
    assert shown["teacher"] == (
        "Qwen/Qwen2.5-7B-Instruct, ZeRO-3, offload params, bfloat16, 7.6B params, micro-batches of 16 rows per rank "
        "(the reference's)"
    )
    assert shown["distillation"] == (
        "k3 as a supervised loss (the divergence backpropagated), added x 0.5 to the task rewards' policy loss"
    )
    reward = {**distill, "loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": False}
    assert values(startup_summary({**STARTUP, "distillation": reward}))["distillation"] == (
        "k1 as a policy-gradient reward (minus the divergence is each token's advantage), alone "
        "(use_task_rewards false)"
    )


FINAL = {
    "validation": {0: 0.25, 4: 0.5, 10: 0.375},
    "tokens": 1_234_567,
    "last_step": 10,
    "total_steps": 10,
    "initial_step": 0,
    "wall_time_s": 3661.2,
    "model_dir": "checkpoints/dsrl/grpo/final_model",
    "checkpoint_dir": "checkpoints/dsrl/grpo",
    "last_checkpoint": "checkpoints/dsrl/grpo/global_step_10",
    "mlflow": {"tracking_uri": "sqlite:///mlflow.db", "experiment_id": "1", "run_id": "abc123"},
    "cwd": "/runs/here",
}


def test_final_summary_shows_every_fact_and_how_to_open_the_run():
    block = final_summary(FINAL)
    assert block.splitlines()[0] == "final summary"
    assert values(block) == {
        "status": "finished",
        "steps": "10/10",
        "validation score": "best 0.5 (step 4), last 0.375 (step 10)",
        "wall time": "1:01:01",
        "tokens": "1,234,567 (1.2M)",
        "model": "checkpoints/dsrl/grpo/final_model",
        "checkpoints": "checkpoints/dsrl/grpo (last: checkpoints/dsrl/grpo/global_step_10)",
        "mlflow": "sqlite:///mlflow.db, experiment 1, run abc123",
        # the relative sqlite path made absolute, so the command works from any directory
        "open the run": "mlflow ui --backend-store-uri sqlite:////runs/here/mlflow.db  "
        "(then open http://127.0.0.1:5000/#/experiments/1/runs/abc123)",
    }


@pytest.mark.parametrize(
    ("mlflow", "hint"),
    [
        (
            {"tracking_uri": "http://mlflow.example:5000/", "experiment_id": "3", "run_id": "r1"},
            "open http://mlflow.example:5000/#/experiments/3/runs/r1",
        ),
        (
            {"tracking_uri": "sqlite:////abs/my runs/m.db", "experiment_id": None, "run_id": "r1"},
            "mlflow ui --backend-store-uri 'sqlite:////abs/my runs/m.db'",
        ),
        (
            {"tracking_uri": "mlruns", "experiment_id": "0", "run_id": "r1"},
            "mlflow ui --backend-store-uri /runs/here/mlruns  (then open http://127.0.0.1:5000/#/experiments/0/runs/r1)",
        ),
    ],
)
def test_final_summary_mlflow_hints(mlflow, hint):
    assert values(final_summary({**FINAL, "mlflow": mlflow}))["open the run"] == hint


def test_final_summary_of_a_resumed_interrupted_run_without_validation_or_mlflow():
    facts = {
        **FINAL,
        "validation": {},
        "initial_step": 4,
        "last_step": 6,
        "status": "stopped by SIGTERM",
        "model_dir": None,
        "mlflow": None,
    }
    shown = values(final_summary(facts))
    assert shown["status"] == "stopped by SIGTERM"
    assert shown["steps"] == "6/10 (2 in this run, resumed at step 4)"
    assert shown["validation score"] == "none" and shown["model"] == "not exported"
    assert shown["mlflow"] == "off" and "open the run" not in shown


# ---- secrets -------------------------------------------------------------------------------------


def test_a_secret_that_reached_a_path_prints_as_stars_on_every_log_line(monkeypatch):
    secret = "tok-51c2a7e9d04b8f36"
    monkeypatch.setenv("MY_API_TOKEN", secret)  # e.g. trainer.default_local_dir=/runs/${oc.env:MY_API_TOKEN}
    run = f"/runs/{secret}"
    stream = io.StringIO()
    setup_logging(0, stream=stream)
    logger.info(startup_summary({**STARTUP, "checkpoint_dir": run}))
    logger.info("checkpoint saved to %s (1.0 MiB in 0.10 s)", f"{run}/global_step_2")
    logger.info(
        final_summary(
            {
                **FINAL,
                "checkpoint_dir": run,
                "model_dir": f"{run}/huggingface",
                "last_checkpoint": f"{run}/global_step_2",
            }
        )
    )
    try:
        raise OSError(f"cannot write {run}/latest")
    except OSError:
        logger.exception("save failed")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warn_from_dsrl(f"tracking: cannot upload {run}/huggingface")
    out = stream.getvalue()
    assert secret not in out
    assert "/runs/***, every 5 steps and at the end" in out  # the start-up summary
    assert "] checkpoint saved to /runs/***/global_step_2 (1.0 MiB" in out
    assert "/runs/*** (last: /runs/***/global_step_2)" in out and "/runs/***/huggingface\n" in out  # the final summary
    assert "] error: save failed\n" in out and "OSError: cannot write /runs/***/latest" in out  # the traceback too
    assert "] warning: tracking: cannot upload /runs/***/huggingface" in out
