"""Faults outside the training loop and in what runs share, tried as a user meets them (issue 20): the real
``scripts/train.py`` in a subprocess on the tiny model, the quickstart's configuration.

Shared resources (two runs without a launcher: tests/runtime/test_multinode.py): two runs creating one new MLflow sqlite
store both track. Signals: Ctrl-C while the run starts, SIGHUP during training. User code: a reward file that
fails to import stops the run before any model loads. Late errors: a disk that cannot take the checkpoint
(a stale WORLD_SIZE without a launcher: tests/runtime/test_multinode.py). Secrets in a path stay out of the console.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import QUICKSTART

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-value-of-a-test-token"


class Run:
    """``scripts/train.py`` on the quickstart's files and the tiny model, its output read as it comes."""

    def __init__(self, overrides, *, env=None, preexec_fn=None):
        environment = {**os.environ, "DSRL_TEST_API_TOKEN": SECRET, **(env or {})}
        for name in LAUNCHER_VARIABLES:
            if env is None or name not in env:
                environment.pop(name, None)  # no launcher: dsrl fills in a world of one
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "train.py"), *QUICKSTART, *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=environment,
            preexec_fn=preexec_fn,
            start_new_session=True,
        )
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output += line

    def wait_for(self, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.M):
            assert self.process.poll() is None or re.search(pattern, self.output, re.M), self.output[-4000:]
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n{self.output[-4000:]}"
            time.sleep(0.1)

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
        self._reader.join(10)
        return code


@pytest.fixture
def quickstart(tiny_model_dir, arithmetic_data, deepspeed_cpu_ops, tmp_path):
    """Overrides that put the quickstart on the test model and data, its run folder in ``tmp_path``."""
    return [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        f"data.val_files={arithmetic_data / 'test.parquet'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[console]",
    ]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_the_run_starts_stops_it_with_a_message_not_a_traceback(signum, quickstart):
    run = Run(quickstart)
    run.wait_for(r"^# validated for world size 1")  # the trainer's imports come next
    run.process.send_signal(signum)
    assert run.finish() == 128 + signum, run.output[-3000:]
    assert "Traceback" not in run.output
    name = signal.Signals(signum).name
    assert re.search(
        rf"stopped by {name} during start-up: nothing of this run needed saving yet; run the same "
        r"command again",
        run.output,
    ), run.output[-3000:]


def test_a_second_run_in_a_held_run_folder_is_refused_naming_the_holder(quickstart, tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from dsrl.checkpoint import run_folder; "
            "run_folder.lock(Path(sys.argv[1])); print('holding', flush=True); time.sleep(600)",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        run = Run(quickstart)
        assert run.finish() == 2, run.output[-3000:]
    finally:
        holder.kill()
        holder.wait()
    assert (
        f"trainer.default_local_dir={tmp_path / 'run'} is in use by another dsrl run (pid {holder.pid} on" in run.output
    )
    assert "Loading weights" not in run.output and "Traceback" not in run.output


def test_sighup_during_training_saves_and_stops_and_a_secret_in_the_path_stays_masked(quickstart, tmp_path):
    folder = tmp_path / "run-${oc.env:DSRL_TEST_API_TOKEN}"
    run = Run(
        [
            *quickstart,
            f"trainer.default_local_dir={folder}",
            "trainer.total_training_steps=50",
            "trainer.total_epochs=50",
            "trainer.val_before_train=false",
        ]
    )
    run.wait_for(r"^\[dsrl r0 [\d:]+\] step +1/50 ")
    run.process.send_signal(signal.SIGHUP)  # the terminal closed: finish the step, save, stop
    assert run.finish() == 129, run.output[-3000:]
    assert "SIGHUP received: finishing this step" in run.output
    saved = sorted(p.name for p in (tmp_path / f"run-{SECRET}").glob("global_step_*"))
    assert len(saved) == 1 and f"checkpoint saved to {tmp_path}/run-***/{saved[0]}" in run.output
    assert "Traceback" not in run.output
    assert SECRET not in run.output  # the start-up summary, the checkpoint line, the final summary


def test_a_reward_file_that_fails_to_import_stops_the_run_before_any_model_loads(quickstart, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("import a_module_that_is_not_installed\n\ndef compute_score(**kwargs):\n    return 0.0\n")
    run = Run([*quickstart, f"custom_reward_function.path={reward}"])
    assert run.finish() == 2, run.output[-3000:]
    assert "1 problem(s) in the files the configuration names" in run.output
    assert "No module named 'a_module_that_is_not_installed'" in run.output
    assert "Loading weights" not in run.output and "start-up summary" not in run.output  # no model loaded


def test_a_checkpoint_the_disk_cannot_take_stops_the_run_saying_so_and_leaves_no_partial_one(quickstart, tmp_path):
    limit = 4 * 2**20  # the checkpoint's files are 9 MiB: a write past 4 MiB fails as on a full disk

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = Run(
        [*quickstart, "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.val_before_train=false"],
        preexec_fn=small_disk,
    )
    assert run.finish() == 1, run.output[-3000:]
    assert re.search(
        r"step 1: the checkpoint could not be written to .*\.tmp_global_step_1 \(.*\); [\d,]+ MiB are "
        r"free on the filesystem of .*The partial checkpoint was removed; the last complete one is none",
        run.output,
    ), run.output[-3000:]
    assert not list((tmp_path / "run").glob(".tmp_*")) and not list((tmp_path / "run").glob("global_step_*"))


def test_two_runs_creating_one_new_mlflow_store_both_track(tmp_path):
    code = (
        "import os, sys, time\n"
        "from dsrl.tracking import Tracker\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"  # both start on one signal
        "t = Tracker(['mlflow'], project_name='p', experiment_name='e', total_steps=1, rank=0)\n"
        "print(t.run_id, t.failures, flush=True)\n"
        "t.finish('FINISHED')\n"
    )
    go = tmp_path / "go"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}",
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
    }
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    time.sleep(3)  # both have imported mlflow and wait
    go.touch()
    results = [run.communicate(timeout=120) for run in runs]
    run_ids = [out.split()[0] for out, _ in results]
    assert [out.split()[1] for out, _ in results] == ["0", "0"], [err[-2000:] for _, err in results]
    assert "None" not in run_ids and run_ids[0] != run_ids[1]
