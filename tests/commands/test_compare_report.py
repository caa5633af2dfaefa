"""dsrl-compare without training: the confidence interval on constructed samples, the arguments, and what the
comparison adds to each config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dsrl.commands.compare import QUICK_OVERRIDES, QUICK_TASK, common_overrides, parse_args, t_interval


def test_the_t_interval_of_three_values_uses_two_degrees_of_freedom():
    mean, half = t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    t_2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t(0.975) at 2 degrees of freedom, in closed form: (2p-1)/sqrt(2p(1-p))
    assert half == pytest.approx(t_2 * 1.0 / math.sqrt(3), rel=1e-9)  # s = 1


def test_the_t_interval_of_two_values_is_wide_and_of_one_has_no_width():
    mean, half = t_interval([0.4, 0.6])
    assert mean == pytest.approx(0.5)
    t_1 = math.tan(math.pi * (0.975 - 0.5))  # t(0.975) at 1 degree of freedom (the Cauchy quantile)
    assert half == pytest.approx(t_1 * math.sqrt(0.02) / math.sqrt(2), rel=1e-9)  # s = sqrt(0.02)
    assert t_interval([0.3])[0] == 0.3 and math.isnan(t_interval([0.3])[1])
    assert t_interval([math.nan, 0.3])[0] == 0.3  # a run that did not log the measurement is left out
    assert all(math.isnan(v) for v in t_interval([]))


def test_quick_mode_fills_in_the_tiny_task_and_overrides_given_still_win():
    args, configs, overrides = parse_args(
        ["grpo", "opo", "--quick", "--out", "o", "--steps", "4", "data.val_max_samples=8"]
    )
    assert configs == ["grpo", "opo"] and args.task == QUICK_TASK and args.steps == 4 and args.val_every == 5
    assert overrides == [*QUICK_OVERRIDES, "data.val_max_samples=8"]  # later wins
    assert args.seed_list == [1, 2, 3]
    run = common_overrides(args, overrides)
    assert "actor_rollout_ref.actor.measure_grad_variance=true" in run and "trainer.logger=[console,mlflow]" in run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["grpo", "--out", "o"], "--steps N"),
        (["grpo", "--out", "o", "--steps", "3", "--seeds", "1,1"], "each seed once"),
        (["grpo", "--out", "o", "--steps", "3", "--seeds", "one"], "invalid literal"),
        (["data.train_batch_size=8", "--out", "o", "--steps", "3"], "name the configs"),
    ],
)
def test_bad_arguments_exit_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_configs_named_alike_are_refused_before_anything_trains(capsys, tmp_path):
    from dsrl.commands.compare import main

    twin = tmp_path / "grpo.yaml"
    twin.write_text((Path(__file__).parents[2] / "configs" / "grpo.yaml").read_text())
    assert main(["grpo", str(twin), "--out", str(tmp_path / "out"), "--steps", "1", "--task", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "grpo: named twice" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "given, message",
    [
        (["--steps", "0"], "--steps 0: must be >= 1 training step"),  # security_3 F19: 0 meant "not given"
        (["--steps", "-5"], "--steps -5: must be >= 1"),
        (["--val-every", "0"], "--val-every 0: must be >= 1"),
        (["--jobs", "0"], "--jobs 0: must be >= 1"),
    ],
)
def test_zero_is_a_value_given_and_refused_with_quick_too(given, message, capsys):
    for quick in ([], ["--quick"]):
        argv = ["grpo", "--out", "o", *quick, *given]
        if "--steps" not in given and not quick:
            argv += ["--steps", "3"]
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err, (quick, given)


FAKE_RUN = """\
import os, signal, sys, time
def stop(signum, frame):
    open(os.environ["RECORD"], "a").write(f"{os.getpid()} got {signum}\\n")
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
open(os.environ["RECORD"], "a").write(f"{os.getpid()} started\\n")
time.sleep(60)
"""

DRIVER = """\
import os, sys
from dsrl.commands import compare
from dsrl.commands.compare import Arm
# Each run is FAKE_RUN instead of python -m dsrl: it records the signals it gets
sys.executable = os.environ["FAKE_PYTHON"]
compare.validated_arms = lambda configs, task, common, out, seed: [Arm(c, []) for c in configs]
sys.exit(compare.main(sys.argv[1:]))
"""


def test_a_signal_to_dsrl_compare_stops_its_runs_and_starts_no_more(tmp_path):
    """security_3 F21: kill -TERM <dsrl-compare> (alone, in its own session) ended it silently and its run trained
    on, reparented to init. Now each run in flight gets the signal, no further run starts, and the exit code is 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    record = tmp_path / "record.txt"
    (tmp_path / "run.py").write_text(FAKE_RUN)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'run.py'}\n")
    fake.chmod(0o755)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "RECORD": str(record), "FAKE_PYTHON": str(fake), "PYTHONPATH": str(Path(__file__).parents[2])}
    argv = ["grpo", "opo", "rloo", "--steps", "1", "--seeds", "1,2", "--jobs", "2", "--out", str(tmp_path / "out")]
    driver = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), *argv],
        env=env,
        start_new_session=True,  # as in the review: its own session, so only the signal sent to it reaches it
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while (not record.exists() or record.read_text().count("started") < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert record.read_text().count("started") == 2  # two jobs: two runs in flight
    os.kill(driver.pid, signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 128 + signal.SIGTERM, err
    lines = record.read_text().splitlines()
    assert sum(line.endswith("started") for line in lines) == 2  # none of the four left started after the signal
    assert sum(line.endswith(f"got {signal.SIGTERM}") for line in lines) == 2
    assert "dsrl-compare: stopped by SIGTERM; the runs in flight got it too and stopped" in err
