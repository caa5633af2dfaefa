"""Faults of a two-rank run (issue 13, parts 1-3), with real gloo process groups and, where the launcher is part of
the fault, scripts/train.py under the real ``deepspeed`` launcher on two CPU ranks:

- a stuck rank: the other fails within ``actor_rollout_ref.nccl_timeout``, naming the phase it waited in;
- the ``deepspeed`` runner killed alone, or torchrun's agent: the ranks notice, finish the step, save a checkpoint
  and exit;
- a bad config or bad data: one report, from rank 0, exit code 2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsrl.runtime.distributed import collective_timeout_message, stop_when_launcher_dies
from dsrl.runtime.phases import in_phase
from tests.conftest import QUICKSTART
from tests.helpers.processes import wait_gone

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "helpers" / "stuck_rank_worker.py"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def test_a_collective_that_times_out_names_the_phase_it_waited_in(free_port):
    """Rank 1 sleeps 60 s; rank 0, all-reducing in phase reward, fails after the 10 s of init_distributed's timeout."""
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "10", "60"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        for r in (0, 1)
    ]
    try:
        out, _ = ranks[0].communicate(timeout=120)
    finally:
        ranks[1].kill()
        ranks[1].wait()
    assert ranks[0].returncode == 1, out[-3000:]
    waited = float(re.search(r"waited ([\d.]+) s; ", out).group(1))
    assert 9 <= waited <= 20  # the key's seconds, not DeepSpeed's default 10 minutes
    message = out[out.index("dsrl: ") :]
    assert re.match(r"dsrl: rank 0 on \S+: a collective timed out in phase 'reward' \(", message), message
    assert "Timed out waiting 10000ms" in message and "raise actor_rollout_ref.nccl_timeout" in message


def test_the_phase_is_the_innermost_one_and_survives_the_error_raised_in_it():
    """The message names where this rank was: nested phases restore the outer one, an error keeps its own."""

    def phase_named_by_a_timeout():
        return collective_timeout_message(
            RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")
        )

    with in_phase("step"):
        with in_phase("reward"):
            assert "in phase 'reward' (" in phase_named_by_a_timeout()
        assert "in phase 'step' (" in phase_named_by_a_timeout()
        with pytest.raises(KeyError):
            with in_phase("update_actor"):
                raise KeyError("an error on the way out of a phase")
        assert "in phase 'update_actor' (" in phase_named_by_a_timeout()  # where it went wrong
    assert collective_timeout_message(RuntimeError("CUDA out of memory")) is None
    assert collective_timeout_message(ValueError("Timed out waiting 5ms")) is None


def test_the_launcher_watchdog_runs_under_a_launcher_only():
    """Without a launcher there is nothing to watch (a plain `python scripts/train.py` survives its shell)."""
    before = {t.name for t in threading.enumerate()}
    for launcher in ("none", "environment"):
        stop_when_launcher_dies(launcher)
    assert "dsrl-launcher-watchdog" not in {t.name for t in threading.enumerate()} - before


LAUNCHERS = {
    "deepspeed": lambda port: [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
    ],
    "torchrun": lambda port: [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
    ],
}


class Run:
    """scripts/train.py under ``deepspeed --num_gpus 2`` (or ``torchrun --nproc-per-node 2``), its output read as it
    comes."""

    def __init__(self, overrides: list[str], port: int, launcher: str = "deepspeed"):
        command = [*LAUNCHERS[launcher](port), str(REPO / "scripts" / "train.py"), *QUICKSTART, *overrides]
        self.runner = subprocess.Popen(
            command,
            env=ENV,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output, self.ended = "", False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.runner.stdout:  # until every process holding the pipe (launcher, ranks) is gone
            with self._changed:
                self.output += line
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of ``pattern`` in the output, waiting for it up to ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self.ended or re.search(pattern, self.output, re.M), timeout)
            match = re.search(pattern, self.output, re.M)
            assert match, f"no {pattern!r} within {timeout} s:\n{self.output[-4000:]}"
            return match

    def wait_ended(self, timeout: float) -> str:
        """The whole output, once every process writing it is gone."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.ended, timeout), self.output[-4000:]
            return self.output

    def ranks(self) -> dict[int, psutil.Process]:
        """The rank processes: the children of deepspeed.launcher.launch, by their --local_rank."""
        [launch] = psutil.Process(self.runner.pid).children()
        return {int(re.search(r"--local_rank=(\d)", " ".join(p.cmdline())).group(1)): p for p in launch.children()}

    def stop(self) -> None:
        """Whatever is left of the run (its own session), for a failed test."""
        try:
            os.killpg(self.runner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def run(tiny_model_dir, arithmetic_data, ds_test_config, deepspeed_cpu_ops, free_port, tmp_path):
    """``run(*overrides)``: a long quickstart run on two ranks (no validation, console only); killed at the end."""
    runs = []
    base = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        "data.val_files=null",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_epochs=100",  # longer than any test waits: the run ends by the fault
        "trainer.total_training_steps=null",
        "trainer.log_samples_freq=-1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'checkpoints'}",
    ]

    def start(*overrides: str, launcher: str = "deepspeed") -> Run:
        runs.append(Run([*base, *overrides], free_port(), launcher))
        return runs[-1]

    yield start
    for started in runs:
        started.stop()


def test_a_stopped_rank_fails_the_other_within_the_timeout_naming_the_phase(run):
    timeout = 30
    started = run(f"actor_rollout_ref.nccl_timeout={timeout}")
    started.wait_for(r"^\[dsrl r0 [\d:]+\] step +1/\d+ ", timeout=400)
    stuck = started.ranks()[1]
    stuck.suspend()  # SIGSTOP: alive, silent, never joining another collective
    stopped_at = time.monotonic()
    match = started.wait_for(
        r"^dsrl: rank 0 on \S+: a collective timed out in phase '([^']+)' \(.*$", timeout=timeout + 120
    )
    assert time.monotonic() - stopped_at <= timeout + 60  # the other rank's next collective, plus the timeout
    assert match.group(1) != "start-up"  # a phase of the training loop: the trainer names them as it goes
    assert "raise actor_rollout_ref.nccl_timeout" in match.group(0)
    stuck.resume()  # the launcher has sent it SIGTERM: it ends once it runs again
    assert started.runner.wait(timeout=120) == 1  # rank 0's exit code, passed on by the launcher


def test_the_ranks_stop_and_save_when_the_runner_alone_is_killed(run):
    started = run()
    started.wait_for(r"^\[dsrl r0 [\d:]+\] step +1/\d+ ", timeout=400)
    ranks = started.ranks()
    started.runner.send_signal(signal.SIGTERM)  # the `deepspeed` command only: it forwards nothing
    assert started.runner.wait(timeout=30) == -signal.SIGTERM
    for rank in (0, 1):
        started.wait_for(
            rf"^\[dsrl r{rank} [\d:]+\] warning: the deepspeed launcher \(pid \d+\) or its runner "
            r"\(pid \d+\) is gone: stopping as on SIGTERM",
            timeout=30,
        )
    saved = started.wait_for(r"checkpoint saved to (\S+global_step_(\d+))", timeout=300)
    assert wait_gone([p.pid for p in ranks.values()], 120) == [], started.output[-4000:]  # none trains on headless
    assert Path(saved.group(1)).is_dir() and int(saved.group(2)) >= 2


def test_the_ranks_stop_and_save_when_the_torchrun_agent_is_killed(run):
    started = run(launcher="torchrun")
    started.wait_for(r"^\[dsrl r0 [\d:]+\] step +1/\d+ ", timeout=400)
    ranks = psutil.Process(started.runner.pid).children()  # torchrun's agent starts the ranks itself
    assert len(ranks) == 2
    started.runner.kill()  # SIGKILL: the agent can tell its ranks nothing
    for rank in (0, 1):
        started.wait_for(
            rf"^\[dsrl r{rank} [\d:]+\] warning: the torchrun process that started this rank "
            rf"\(pid {started.runner.pid}\) is gone: stopping as on SIGTERM",
            timeout=30,
        )
    saved = started.wait_for(r"checkpoint saved to (\S+global_step_(\d+))", timeout=300)
    assert wait_gone([p.pid for p in ranks], 120) == [], started.output[-4000:]  # none trains on headless
    assert Path(saved.group(1)).is_dir() and int(saved.group(2)) >= 2


def bad_data(arithmetic_data: Path, out: Path) -> Path:
    rows = pq.read_table(arithmetic_data / "train.parquet").to_pylist()
    rows[3]["prompt"][0]["content"] = ""
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


@pytest.mark.slow  # reported once by rank 0 with the ranks that have it: tests/runtime/test_rank_problems_2ranks.py
@pytest.mark.parametrize("fault", ["config", "data"])
def test_a_bad_config_or_data_file_is_reported_once_by_rank_0(run, arithmetic_data, tmp_path, fault):
    if fault == "config":
        started = run("actor_rollout_ref.actor.optim.lr=inf")
        problem = "  actor_rollout_ref.actor.optim.lr=inf: must be finite"
    else:
        data = bad_data(arithmetic_data, tmp_path / "empty_message.parquet")
        started = run(f"data.train_files={data}")
        problem = f"  {data} row 3: 'prompt' holds a user message with empty content"
    assert started.runner.wait(timeout=400) == 2
    output = started.wait_ended(timeout=60)
    assert output.count(problem) == 1, output[-4000:]
    assert len(re.findall(r"^dsrl: .* 1 problem\(s\) in ", output, re.M)) == 1, output[-4000:]
    assert "Traceback" not in output
