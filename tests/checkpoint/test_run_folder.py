"""One run at a time in a run folder (``dsrl.checkpoint.run_folder``): a second run is refused naming the holder, the
lock goes with its holder however it ends (SIGKILL included), and a process asks for its own folder freely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dsrl.checkpoint import run_folder

HOLD = """
import sys, time
from pathlib import Path
from dsrl.checkpoint import run_folder
run_folder.lock(Path(sys.argv[1]))
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of ``tmp_path / 'run'`` until killed."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "holding"
    yield process
    process.kill()
    process.wait()


def test_a_second_run_is_refused_naming_the_holder_until_the_holder_is_gone(holder, tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(run_folder.RunFolderBusy) as refused:
        run_folder.lock(folder)
    message = str(refused.value)
    assert f"trainer.default_local_dir={folder} is in use by another dsrl run (pid {holder.pid} on " in message
    assert "Fix: wait for it to end or stop it, or give this run its own folder (trainer.experiment_name" in message
    holder.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel drops the lock
    holder.wait()
    run_folder.lock(folder)
    try:
        assert (folder / run_folder.LOCK_FILE).is_file()
        run_folder.lock(folder)  # this process holds it already: no refusal
    finally:
        run_folder.release(folder)
    assert folder not in run_folder._held


def test_a_lock_file_left_behind_names_no_one_and_blocks_nothing(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / run_folder.LOCK_FILE).write_text("garbage from a crashed run")
    run_folder.lock(folder)
    run_folder.release(folder)
    assert str(os.getpid()) in (folder / run_folder.LOCK_FILE).read_text()  # the last holder is named
