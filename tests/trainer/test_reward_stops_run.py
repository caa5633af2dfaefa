"""A run whose reward fails on every call stops loudly (issue 13): ``dsrl-train`` in-process on the tiny model
exits 1 after ``reward.max_failed_steps`` such steps in a row, quoting the first failure of the streak; the
console shows the failure counts of the steps and of the validation; the workers' prints go to their log
file; no worker is left. The scorer's own faults: tests/rewards/test_reward_faults.py."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.conftest import recipe
from tests.helpers.processes import children, wait_gone
from tests.helpers.resume import finish, start_worker

pytestmark = pytest.mark.e2e

ROWS = 40  # responses per step: data.train_batch_size 8 (configs/cpu.yaml) x rollout.n 5 (grpo)

# Fails every call of steps 1, 3 and 4 and none of step 2 (the steps' calls never overlap, so the count of
# calls so far tells the step); every validation call returns None. Each call prints a line.
STREAK_REWARD = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    print("reward-print", repr(solution_str))
    if extra_info["split"] == "test":
        return None
    fd = os.open({counter!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, b".")
    os.close(fd)
    step = -(-os.path.getsize({counter!r}) // {rows})
    if step == 2:
        return 1.0
    raise ValueError(f"no score at step {{step}}")
"""

HANGING_REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)
"""

# Marks its worker (a file named by its pid), then spins in C holding the GIL.
SPINNING_REWARD = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    open(os.path.join({marks!r}, str(os.getpid())), "w").close()
    sum(range(10**13))
"""


def train(tiny_model_dir, data, ds_test_config, out, reward, *overrides) -> int:
    """``dsrl-train grpo cpu`` on the tiny model with the reward file ``reward``; its exit code."""
    from dsrl.commands.train import main

    return main(
        [
            *recipe("grpo"),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"custom_reward_function.path={reward}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "trainer.total_training_steps=5",
            "trainer.test_freq=-1",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={out}",
            "reward.num_workers=2",
            "reward.max_failed_steps=2",
            *overrides,
        ]
    )


def step_line(out: str, step: int) -> str | None:
    found = re.search(rf"\] step {step}/5 (.*)", out)
    return found and found.group(1)


def test_a_failing_reward_stops_the_run_quoting_the_first_failure_of_the_streak(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, capfd
):
    reward = tmp_path / "streak_reward.py"
    reward.write_text(STREAK_REWARD.format(counter=str(tmp_path / "calls"), rows=ROWS))
    before = children()
    code = train(tiny_model_dir, arithmetic_data, ds_test_config, tmp_path / "run", reward)
    out, err = capfd.readouterr()
    assert code == 1
    raise_line = next(i for i, line in enumerate(reward.read_text().splitlines(), 1) if "raise ValueError" in line)
    # Step 2 scored, so the streak that stops the run is steps 3 and 4, and its first failure is step 3's.
    assert (
        f"dsrl: step 4: every reward call failed in 2 steps in a row (this step's {ROWS} rows: "
        f"reward/fail_exception={ROWS}; reward.max_failed_steps=2). First failure: ValueError: no score at step 3 "
        f"(at streak_reward.py:{raise_line} in compute_score). Fix the reward function "
        f"(custom_reward_function.path={reward}, name=compute_score), then run again (trainer.resume_mode=auto "
        "resumes from the last checkpoint); reward.max_failed_steps=0 trains on through such steps"
    ) in err
    # The console: the validation's failures (8 prompts, one response each) and each step's.
    assert re.search(r"validation at step 0: val-core/arithmetic/reward/mean@1=0 reward_invalid=8\n", out)
    assert f"reward_exceptions={ROWS} " in step_line(out, 1) and f"reward_exceptions={ROWS} " in step_line(out, 3)
    assert "reward_" not in step_line(out, 2) and step_line(out, 4) is None  # stopped before step 4 was logged
    # The workers' prints are in their log file, not on the console: 8 validation calls and 4 steps, a whole
    # line each although two workers print at once (and PYTHONUNBUFFERED may be set).
    log = tmp_path / "run" / "reward_workers_rank0.log"
    assert out.count(f"their output goes to {log}") == 1
    assert "reward-print" not in out + err
    lines = log.read_text().splitlines()
    assert len(lines) == 8 + 4 * ROWS and all(re.fullmatch(r"reward-print (['\"]).*\1", line) for line in lines)
    assert wait_gone(children() - before) == []


def test_a_reward_that_hangs_on_every_call_stops_the_run_in_seconds(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, capfd
):
    # Each step's 40 calls would take 20 rounds of the 2 s limit on 2 workers (40 s); the batch is cut short
    # after 8 calls ran past it (4 rounds).
    reward = tmp_path / "hanging_reward.py"
    reward.write_text(HANGING_REWARD)
    before = children()
    start = time.perf_counter()
    code = train(
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "run",
        reward,
        "reward.timeout_s=2",
        "trainer.val_before_train=false",
    )
    elapsed = time.perf_counter() - start
    out, err = capfd.readouterr()
    assert code == 1
    assert (
        f"dsrl: step 2: every reward call failed in 2 steps in a row (this step's {ROWS} rows: "
        f"reward/fail_timeout={ROWS};" in err
    )
    assert (
        "First failure: the call ran past reward.timeout_s=2 s and was killed. Fix the reward function "
        f"(custom_reward_function.path={reward}, name=compute_score), or raise reward.timeout_s=2 if it is only slow"
        in err
    )
    step_s = float(re.search(r"step_s=([\d.]+)", step_line(out, 1)).group(1))
    assert 4 * 2 <= step_s < 25, step_s
    assert elapsed < 180, elapsed
    assert wait_gone(children() - before) == []


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT", "SIGINT")], ids=["SIGTERM", "SIGINT-twice"])
def test_a_signal_while_the_reward_spins_stops_the_run_and_leaves_no_worker(
    tiny_model_dir, arithmetic_data, ds_test_config, deepspeed_cpu_ops, free_port, tmp_path, signals
):
    """The run of the issue: Ctrl-C or SIGTERM while every reward call spins. One signal: the step ends
    (its batch cut short after 4 rounds of the 2 s limit), a checkpoint is saved, exit 128 + signal; a
    second one exits at once. Either way every worker that was inside a call is gone."""
    marks = tmp_path / "marks"
    marks.mkdir()
    reward = tmp_path / "spinning_reward.py"
    reward.write_text(SPINNING_REWARD.format(marks=str(marks)))
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        "data.val_files=null",
        f"custom_reward_function.path={reward}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "trainer.total_training_steps=5",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "reward.num_workers=2",
        "reward.timeout_s=2",
    ]
    process = start_worker("grpo", overrides, tmp_path / "out", port=free_port())
    deadline = time.monotonic() + 300
    while len(list(marks.iterdir())) < 2:
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before scoring"
        time.sleep(0.1)
    for name in signals:
        process.send_signal(getattr(signal, name))
        time.sleep(0.5)
    start = time.monotonic()
    code, output = finish(process, timeout=120)
    signum = getattr(signal, signals[0])
    assert code == 128 + signum, output[-3000:]
    saved = f"checkpoint saved to {tmp_path / 'run' / 'global_step_1'}"
    if len(signals) == 1:
        assert saved in output and time.monotonic() - start < 60
    else:
        assert saved not in output and time.monotonic() - start < 5
    assert wait_gone(int(p.name) for p in marks.iterdir()) == []  # every worker that entered a call
