"""Processes a test starts, and whether they are gone (the reward workers' tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

# A process started from a background job of a non-interactive shell (``cmd &``, ``nohup``) inherits SIGINT,
# SIGQUIT and SIGHUP ignored, and Python then leaves them so: the scripts start with their usual handlers, as a
# terminal's command does (dsrl's CLI installs its own).
_USUAL_SIGNALS = (
    "import signal\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "signal.signal(signal.SIGQUIT, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
)


def run_script(code: str, tmp_path: Path, **popen) -> subprocess.Popen:
    """``code`` (dedented) as ``tmp_path/script.py``, run by this Python with the checkout importable and the
    usual signal handlers."""
    script = tmp_path / "script.py"
    script.write_text(_USUAL_SIGNALS + textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, text=True, **popen)


def live(pids) -> list[int]:
    """The pids still running (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_gone(pids, seconds: float = 10.0) -> list[int]:
    """Poll until every pid has ended or ``seconds`` have passed; the pids still running."""
    pids, deadline = list(pids), time.monotonic() + seconds
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return live(pids)


def with_argument(argument: str) -> list[int]:
    """The host's processes with ``argument`` on their command line (a process in a pid namespace of its own
    knows itself by another pid)."""
    pids = []
    for p in psutil.process_iter():
        try:
            if argument in p.cmdline():
                pids.append(p.pid)
        except psutil.Error:  # ended meanwhile, or not ours to read
            pass
    return pids


def children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker (one per process, it ends on
    its own when this process does; it is not a reward worker)."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.Error:  # ended meanwhile
            pass
    return pids
