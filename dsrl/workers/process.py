"""A worker process's side of :class:`dsrl.workers.pool.WorkerPool`, whatever its tasks: a process group of its own,
tied to the trainer's life, memory bounded, output to the pool's log file, a loading error kept for the start-up
probe. The tasks themselves live with their callers (``dsrl.rewards.worker``, ``dsrl.rollout.tools.worker``).

The log is shared by all the workers of a rank, each appending through its own descriptor. Each checks
it after every task and once a second from a daemon thread (one long, chatty call cannot fill the disk):
a worker whose descriptor no longer points at the file at the log's path (another worker rotated it)
reopens the path; one that still writes that file and finds it past the limit takes an ``flock`` on it,
checks again (several may notice at once: only the first renames) and renames it to ``<log>.1``,
replacing the older part, then reopens the path. So about twice the limit is on disk, plus what the
workers write in the second before they notice.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

Outcome = tuple  # ("ok", ...) | ("exception", message) | ("invalid", message): what a task returns per item

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCHDOG_PERIOD_S = 1.0
_LOG_CHECK_PERIOD_S = 1.0
_MB = 2**20

_load_error: str | None = None
_parent_pid: int | None = None  # the trainer's pid, in a worker
_ready = None  # the multiprocessing.Barrier every worker of a new pool meets in probe()
_what = "reward"  # the pool's name and config keys, for messages
_memory_key = "reward.memory_limit_mb"
_memory_limit_mb = 0
_log_file: str | None = None
_log_max_mb = 0
_log_lock = threading.Lock()  # the task's end and the watcher thread both check the log


def die_with_parent(parent_pid: int) -> str:
    """Make this process end when ``parent_pid`` (the trainer) dies, even by SIGKILL.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, which the kernel delivers even while the worker runs C
    code holding the GIL. Elsewhere: a daemon thread that exits when ``os.getppid()`` changes. Returns
    which one ("pdeathsig" or "watchdog"). Exits at once if the parent is already gone.
    """
    how = "watchdog"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                how = "pdeathsig"
        except (OSError, AttributeError):
            pass
    if how == "watchdog":

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(_WATCHDOG_PERIOD_S)
            os._exit(1)

        threading.Thread(target=watch, name="dsrl-worker-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    return how


def setup(
    parent_pid: int,
    log_file: str | None,
    log_max_mb: int,
    memory_limit_mb: int,
    ready,
    *,
    what: str = "reward",
    memory_key: str = "reward.memory_limit_mb",
) -> None:
    """Every pool initializer's first step: a process group of its own, tied to the trainer, memory
    bounded, output to ``log_file`` (None: the trainer's stdout and stderr) rotated at ``log_max_mb`` (0:
    never), ``ready`` kept for :func:`probe`. ``what`` and ``memory_key`` name the pool in messages."""
    global _ready, _what, _memory_key, _memory_limit_mb, _log_file, _log_max_mb, _parent_pid
    _parent_pid = parent_pid
    # Before the user's file runs, so that every process it or a call starts joins the group the pool
    # kills with this worker (the group's id is this pid).
    os.setpgrp()
    die_with_parent(parent_pid)
    limit_memory(memory_limit_mb)
    _ready, _what, _memory_key, _memory_limit_mb = ready, what, memory_key, memory_limit_mb
    if log_file is not None:
        redirect_output(log_file)
        if log_max_mb:
            _log_file, _log_max_mb = log_file, log_max_mb
            threading.Thread(target=_watch_log, name="dsrl-worker-log", daemon=True).start()


def trainer_pid() -> int:
    """The trainer's pid: this worker's parent, or this process when it is not a pool worker."""
    return _parent_pid or os.getpid()


def keep_load_error(message: str) -> None:
    """What :func:`probe` reports: this worker could not load what it runs."""
    global _load_error
    _load_error = message


def load_error() -> str | None:
    """The error :func:`keep_load_error` kept, or None: a task answers every item with it."""
    return _load_error


def memory_hint() -> str:
    """``under reward.memory_limit_mb=4096: raise it, or set it to 0 for no limit`` (empty without a
    limit): what a MemoryError while loading adds to its message."""
    if not _memory_limit_mb:
        return ""
    return f"under {_memory_key}={_memory_limit_mb}: raise it, or set it to 0 for no limit"


def limit_memory(limit_mb: int) -> None:
    """Bound this process's data (heap and private writable mappings: what allocations use) to ``limit_mb``
    MB with ``RLIMIT_DATA``, soft and hard, so that neither the reward function nor a process it starts
    (which inherits the limit) can raise it; 0 = leave the limit as it is. A hard limit already lower is
    kept."""
    if not limit_mb:
        return
    limit = limit_mb * _MB
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def redirect_output(log_file: str) -> None:
    """Point file descriptors 1 and 2 at ``log_file`` (appending), so that prints, warnings, tracebacks
    and C libraries' output all land there. Python writes each line at once, whatever PYTHONUNBUFFERED
    says (whose piecewise writes would interleave the lines of workers printing together), and at once
    when it ends (a worker may be killed at any moment)."""
    _point_output_at(log_file)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


def _point_output_at(log_file: str) -> None:
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what is buffered belongs to the file it was written for
        os.dup2(fd, stream.fileno())
    os.close(fd)


def bound_log() -> None:
    """Rotate the log once it is past ``reward.log_max_mb``, or follow a rotation another worker made
    (the module doc); nothing without a bound. A failure is reported in the log, never raised: it must
    not fail the rows of the task that just ended."""
    if not _log_max_mb:
        return
    with _log_lock:
        try:
            if not _writes_to(_log_file):
                _point_output_at(_log_file)
                return
            size = os.fstat(1).st_size
            if size <= _log_max_mb * _MB:
                return
            fcntl.flock(1, fcntl.LOCK_EX)
            try:
                rotated = _writes_to(_log_file)  # False: another worker rotated it while this one waited
                if rotated:
                    os.replace(_log_file, f"{_log_file}.1")
            finally:
                fcntl.flock(1, fcntl.LOCK_UN)
            _point_output_at(_log_file)
            if rotated:
                print(
                    f"[dsrl {_what} worker {os.getpid()}] the log reached {size / _MB:.1f} MB "
                    f"(reward.log_max_mb={_log_max_mb}): the earlier output is in {_log_file}.1"
                )
        except OSError as exc:
            with contextlib.suppress(OSError):  # a full disk may refuse this line too
                print(f"[dsrl {_what} worker {os.getpid()}] could not rotate {_log_file}: {exc}", file=sys.stderr)


def _writes_to(path: str) -> bool:
    """Whether file descriptor 1 is the file now at ``path``."""
    try:
        return os.path.samestat(os.fstat(1), os.stat(path))
    except FileNotFoundError:  # another worker is between the rename and the new file
        return False


def _watch_log() -> None:
    while True:
        time.sleep(_LOG_CHECK_PERIOD_S)
        bound_log()


def probe(timeout_s: float) -> tuple[str | None, int]:
    """``(the loading error or None, this worker's pid)``: the scorer's start-up check. Waits until every
    worker of the pool holds a probe (the barrier), so each worker answers exactly one and the scorer
    is built when all its workers are up."""
    if _ready is not None:
        _ready.wait(timeout_s)
    return _load_error, os.getpid()


def then_bound_log(task: Callable) -> Callable:
    """``task``, then :func:`bound_log` when it ends."""

    @functools.wraps(task)  # pebble pickles the task by its name: the wrapper takes it
    def run(rows: list[tuple]) -> list[Outcome]:
        try:
            return task(rows)
        finally:
            bound_log()

    return run


def describe(exc: BaseException, fn: Callable | None) -> str:
    """What a user's function ``fn`` did, for the failure counts and the
    stop message: ``called sys.exit(3)``, ``raised KeyboardInterrupt``, or ``ZeroDivisionError: division
    by zero (at my_reward.py:12 in compute_score)``: the innermost line in the function's file, else the
    innermost frame. A ``MemoryError`` under a memory limit names it: ``... (reward.memory_limit_mb=4096)``."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})" if exc.code is not None else "called sys.exit()"
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        return f"raised {text}"
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first frame is the call in this file
    fn_file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = [f for f in frames if f.filename == fn_file] or frames  # the user's line over a library's
    if frames:
        frame = frames[-1]
        text += f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    if isinstance(exc, MemoryError) and _memory_limit_mb:
        text += f" ({_memory_key}={_memory_limit_mb})"
    return text
