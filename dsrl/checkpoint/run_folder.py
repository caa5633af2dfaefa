"""One run at a time in a run folder (``trainer.default_local_dir``).

Two runs started into the same folder (every run without an experiment name of its own shares the default)
would write the same checkpoints and final model, the later silently replacing the earlier's. Rank 0 holds
an exclusive ``flock`` on ``<folder>/.dsrl.lock`` for as long as its process lives (until ``release``); the
file names the holder (host, pid, user, start time, command line), so a second run is refused naming it. The
kernel drops the lock when the holder ends, however it ends (SIGKILL included): a lock file left behind
never blocks a later run. On a network filesystem the lock is as good as its ``flock`` (NFS emulates it with
byte-range locks, which hold across clients). A process holds a folder's lock once, however many times it
asks for it (the tests build several trainers on one folder in one process).
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".dsrl.lock"

_held: dict[Path, int] = {}  # folder -> the descriptor holding its lock in this process


class RunFolderBusy(ValueError):
    """Another run holds the run folder."""


def lock(folder: Path) -> None:
    """Take the run folder's lock (making the folder), or raise ``RunFolderBusy`` naming the run that holds it."""
    folder = folder.expanduser().resolve()
    if folder in _held:
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(os.read(fd, 1 << 16))
        os.close(fd)
        raise RunFolderBusy(
            f"trainer.default_local_dir={folder} is in use by another dsrl run ({holder}); two runs there would "
            "overwrite each other's checkpoints and model. Fix: wait for it to end or stop it, or give this run "
            "its own folder (trainer.experiment_name=NAME, or trainer.default_local_dir=DIR)"
        ) from None
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "user": _user(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[folder] = fd


def release(folder: Path) -> None:
    """Give the lock back (the next run may start there); a no-op when this process does not hold it."""
    fd = _held.pop(folder.expanduser().resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no passwd entry and no LOGNAME/USER (a container)
        return str(os.getuid())


def _describe(holder: bytes) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, user {info['user']}, started {info['started']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "its lock file names no holder"
