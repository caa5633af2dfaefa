"""A start-up that waits says on what (``dsrl.runtime.stalls``): torch's extension lock left behind by a killed build
(a real ``FileBaton`` lock in a temporary ``TORCH_EXTENSIONS_DIR``) is told from one a live build holds, a DeepSpeed op
load that waits on it names the file to remove within the bound, a stuck phase says where it is while one that
moves on says nothing, and a one-process run whose DeepSpeed collectives' op waits on such a lock says so, not that
it waits for other ranks (the security review's I1)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES
from dsrl.runtime.stalls import lock_holders, stale_extension_locks
from tests.conftest import REPO

KILLED_BUILD = (
    "import os, signal, sys\n"
    "from torch.utils.file_baton import FileBaton\n"
    "assert FileBaton(sys.argv[1]).try_acquire()\n"
    "os.kill(os.getpid(), signal.SIGKILL)  # a build killed while it held the lock\n"
)


def lock_left_by_a_killed_build(lock: Path) -> Path:
    """``lock`` as torch's extension lock stays when the build holding it is killed."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    killed = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], timeout=120)
    assert killed.returncode == -signal.SIGKILL and lock.exists()
    return lock


def environment(**variables) -> dict[str, str]:
    """This process's environment without a launcher's variables, with ``variables``."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return env | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)} | variables


def read_until(process: subprocess.Popen, pattern: str, timeout: float) -> tuple[str, dict[str, float]]:
    """What ``process`` printed until a line matched ``pattern`` or ``timeout`` seconds passed, and when each line
    came (``time.monotonic()``, by its text); the process is killed either way."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    output, came, deadline = "", {}, time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            if process.poll() is not None and lines.empty():
                break
            continue
        output += line
        came.setdefault(line.strip(), time.monotonic())
        if re.search(pattern, line):
            break
    process.kill()
    process.wait()
    return output, came


def came_after(came: dict[str, float], first: str, then: str) -> float:
    """Seconds between the line ``first`` and the first line that contains ``then``."""
    return next(t for line, t in came.items() if then in line) - came[first]


def test_a_lock_no_process_holds_is_stale_and_one_a_build_holds_is_not(tmp_path):
    from torch.utils.file_baton import FileBaton

    left = lock_left_by_a_killed_build(tmp_path / "py311_cpu" / "cpu_adam" / "lock")
    held = FileBaton(str(tmp_path / "fused_adam" / "lock"))
    (tmp_path / "fused_adam").mkdir()
    assert held.try_acquire()  # this process builds fused_adam
    try:
        assert lock_holders(held.lock_file_path) == [os.getpid()]
        assert lock_holders(left) == []
        assert stale_extension_locks(tmp_path) == [left]
    finally:
        held.release()
    assert stale_extension_locks(tmp_path / "py311_cpu" / "fused_adam") == []  # no lock at all


OP_LOAD = (
    "from deepspeed.accelerator import get_accelerator\n"
    "from dsrl.runtime.stalls import startup_watchdog\n"
    "from dsrl.tracking.console import setup_logging\n"
    "setup_logging(0)\n"
    "with startup_watchdog(report_after_s=3):\n"
    "    print('loading', flush=True)\n"
    "    get_accelerator().create_op_builder('CPUAdamBuilder').load()\n"
)


@pytest.mark.e2e  # DeepSpeed imported in a process of its own
@pytest.mark.parametrize("lock_is", ["left", "held"])
def test_an_op_load_waiting_on_torchs_extension_lock_names_it_within_the_bound(tmp_path, lock_is):
    """DeepSpeed's CPU Adam loaded with its build folder locked: within the bound (3 s here, a minute in a run) the
    rank says it waits on that lock, and either which process builds the op (the lock held: by this test) or that no
    process holds it and the file to remove (left by a killed build)."""
    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "cpu_adam" / "lock"
    if lock_is == "left":
        lock_left_by_a_killed_build(lock)
    else:
        lock.parent.mkdir()
        baton = FileBaton(str(lock))
        assert baton.try_acquire()
    process = subprocess.Popen(
        [sys.executable, "-c", OP_LOAD],
        env=environment(TORCH_EXTENSIONS_DIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, came = read_until(process, r"no progress for \d+ s in phase 'start-up'", timeout=120)
    finally:
        if lock_is == "held":
            baton.release()
    assert "no progress" in output, output[-3000:]
    assert came_after(came, "loading", "no progress") < 3 + 0.5 + 5  # the bound, a look's delay, a busy machine
    report = re.search(
        r"^\[dsrl r0 [\d:]+\] warning: rank 0 on \S+: no progress for 3 s in phase 'start-up' at (.*)$", output, re.M
    )
    assert report, output[-3000:]
    assert "torch/utils/file_baton.py:" in report.group(
        1
    ) and f"waiting for torch's extension lock {lock}, " in report.group(1)
    if lock_is == "left":
        assert re.search(
            rf"which no process on this machine holds open, left \d+ s ago: a build of DeepSpeed's op cpu_adam was "
            rf"interrupted and left it, .* forever; fix: remove {re.escape(str(lock))} \(unless",
            report.group(1),
        ), report.group(1)
    else:
        assert f"which process {os.getpid()} (" in report.group(1)
        assert (
            "holds while it builds DeepSpeed's op cpu_adam: this process goes on when that build is done"
            in report.group(1)
        )


STUCK = (
    "import time\n"
    "from dsrl.runtime.phases import in_phase\n"
    "from dsrl.runtime.stalls import startup_watchdog\n"
    "from dsrl.tracking.console import setup_logging\n"
    "setup_logging(0)\n"
    "with startup_watchdog(report_after_s=2):\n"
    "    for i in range(3):  # a new phase every second: progress\n"
    "        with in_phase(f'moving {i}'):\n"
    "            time.sleep(1)\n"
    "    print('stuck now', flush=True)\n"
    "    with in_phase('stuck'):\n"
    "        time.sleep(600)\n"
)


def test_a_phase_without_progress_says_where_it_is_within_the_bound_and_one_that_moves_on_says_nothing():
    """``report_after_s`` 2: the phases that change every second are not reported; the stuck one is, 2 s after it
    began (the watchdog looks every 2 / 6 s), with where it is and that nothing there says what it waits on."""
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK], env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, came = read_until(process, r"no progress for \d+ s", timeout=120)
    assert "no progress" in output, output[-3000:]
    assert output.index("stuck now") < output.index("no progress"), output  # nothing while the phases moved on
    assert came_after(came, "stuck now", "no progress") < 2 + 0.4 + 5  # the bound, a look's delay, a busy machine
    assert re.search(
        r"^\[dsrl r0 [\d:]+\] warning: rank 0 on \S+: no progress for 2 s in phase 'stuck' at <string>:12 in <module>: "
        r"in <module> \(<string>:12\); nothing there says what it waits on$",
        output,
        re.M,
    ), output


@pytest.mark.e2e
def test_a_one_process_run_whose_collectives_op_waits_on_a_lock_says_so_not_that_ranks_are_missing(
    tiny_model_dir, arithmetic_data, ds_test_config, tmp_path
):
    """The review's I1: a quickstart in one process, without a launcher, whose DeepSpeed shared-memory collectives
    op waits in init_distributed on a lock a killed build left (in its own TORCH_EXTENSIONS_DIR): 15 s in, it names
    the lock and the fix; it does not say that it waits for the ranks of the run to meet."""
    from tests.conftest import QUICKSTART

    lock = lock_left_by_a_killed_build(tmp_path / "extensions" / "deepspeed_shm_comm" / "lock")
    arguments = [
        *QUICKSTART,
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        "data.val_files=null",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    process = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "train.py"), *arguments],
        env=environment(TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions")),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = read_until(process, r"init_distributed has run 15 s", timeout=240)
    assert re.search(
        r"^\[dsrl r0 [\d:]+\] warning: rank 0 on \S+: DeepSpeed's init_distributed has run 15 s, waiting for torch's "
        rf"extension lock {re.escape(str(lock))}, which no process on this machine holds open, left \d+ s ago: a "
        r"build of DeepSpeed's op deepspeed_shm_comm was interrupted .*; fix: remove ",
        output,
        re.M,
    ), output[-3000:]
    assert "ranks of the run to meet" not in output
