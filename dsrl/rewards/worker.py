"""What runs inside a worker process of :class:`dsrl.workers.pool.WorkerPool` (a pebble pool worker):
:func:`setup` and :func:`probe` for every pool, and the reward scorer's tasks (the tools' are in
``dsrl.rollout.tools.worker``).

The pool starts each worker with the ``spawn`` method and without re-running the training script (see
``dsrl.workers.pool``), so a worker imports only this package, pebble and the user's file: no torch. A
pool's initializer (:func:`initialize` for rewards) runs once per worker (and once per replacement of a
killed one): :func:`setup` makes the worker the leader of a process group of its own (the pool kills the
group, so what a user's function starts goes with its worker), ties the worker's life to the trainer's,
bounds its memory (``reward.memory_limit_mb``), sends its output to the pool's log file (rotated at
``reward.log_max_mb``); then the initializer loads the user's function once. A loading error is kept
(:func:`keep_load_error`), not raised (pebble would restart a worker whose initializer fails, forever);
:func:`probe` reports it so the pool fails at construction.

The log is shared by all the workers of a rank, each appending through its own descriptor. Each checks
it after every task and once a second from a daemon thread (one long, chatty call cannot fill the disk):
a worker whose descriptor no longer points at the file at the log's path (another worker rotated it)
reopens the path; one that still writes that file and finds it past the limit takes an ``flock`` on it,
checks again (several may notice at once: only the first renames) and renames it to ``<log>.1``,
replacing the older part, then reopens the path. So about twice the limit is on disk, plus what the
workers write in the second before they notice.

Tasks return one *outcome* per row and never raise for a reward function's fault, not even for
``sys.exit`` or ``KeyboardInterrupt`` raised inside it (pebble would re-raise those in the trainer):
``("ok", score, extras)``, ``("exception", message)`` or ``("invalid", message)``. Timeouts and
crashed workers are seen by the parent (pebble's ``TimeoutError`` / ``ProcessExpired``). pebble's
workers ignore SIGINT, so a Ctrl-C in the terminal reaches the trainer alone, which decides.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import inspect
import math
import os
import pickle
import reprlib
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

Outcome = tuple  # ("ok", score, extras) | ("exception", message) | ("invalid", message)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCHDOG_PERIOD_S = 1.0
_LOG_CHECK_PERIOD_S = 1.0
_MB = 2**20

_fn: Callable | None = None
_batch = False
_load_error: str | None = None
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
    parent_pid: int, log_file: str | None, log_max_mb: int, memory_limit_mb: int, ready, *,
    what: str = "reward", memory_key: str = "reward.memory_limit_mb",
) -> None:
    """Every pool initializer's first step: a process group of its own, tied to the trainer, memory
    bounded, output to ``log_file`` (None: the trainer's stdout and stderr) rotated at ``log_max_mb`` (0:
    never), ``ready`` kept for :func:`probe`. ``what`` and ``memory_key`` name the pool in messages."""
    global _ready, _what, _memory_key, _memory_limit_mb, _log_file, _log_max_mb
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


def keep_load_error(message: str) -> None:
    """What :func:`probe` reports: this worker could not load what it runs."""
    global _load_error
    _load_error = message


def memory_hint() -> str:
    """``under reward.memory_limit_mb=4096: raise it, or set it to 0 for no limit`` (empty without a
    limit): what a MemoryError while loading adds to its message."""
    if not _memory_limit_mb:
        return ""
    return f"under {_memory_key}={_memory_limit_mb}: raise it, or set it to 0 for no limit"


def initialize(
    custom_path: str | None,
    custom_name: str,
    batch: bool,
    math_verify_sources: tuple[str, ...],
    parent_pid: int,
    log_file: str | None,
    log_max_mb: int,
    memory_limit_mb: int,
    ready,
) -> None:
    """The reward pool's initializer: :func:`setup`, then the reward function loaded once."""
    global _fn, _batch
    setup(parent_pid, log_file, log_max_mb, memory_limit_mb, ready)
    _batch = batch
    try:
        _fn = load_reward_function(custom_path, custom_name, batch, math_verify_sources)
    except ValueError as exc:
        keep_load_error(str(exc))
    except BaseException as exc:  # noqa: BLE001 -- anything the user's module does on import, SystemExit included
        message = f"custom_reward_function.path={custom_path!r}: importing it raised\n{traceback.format_exc()}"
        keep_load_error(message + (memory_hint() if isinstance(exc, MemoryError) else ""))


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


def load_reward_function(
    custom_path: str | None, custom_name: str, batch: bool, math_verify_sources: tuple[str, ...]
) -> Callable:
    """The function the worker calls: the built-in dispatcher, or the user's function (its signature
    checked against ``batch``). ValueError with the fix when it cannot be used."""
    from dsrl.rewards import load_custom_reward_function, make_compute_score

    if custom_path is None:
        return make_compute_score(math_verify_sources)
    fn = load_custom_reward_function(custom_path, custom_name)
    _check_signature(fn, custom_name, batch)
    return fn


def _check_signature(fn: Callable, name: str, batch: bool) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    per_row = "def {}(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"
    per_batch = "def {}(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]"
    if batch and "solution_strs" not in params:
        raise ValueError(
            f"custom_reward_function.batch=true calls {name}(data_sources=, solution_strs=, ground_truths=, "
            f"extra_infos=) with lists (verl's batch reward manager), but {name} takes {list(params)}. "
            f"Fix: define {per_batch.format(name)}, or set custom_reward_function.batch=false."
        )
    if not batch and "solution_str" not in params:
        hint = " (it looks like a batch function)" if "solution_strs" in params else ""
        raise ValueError(
            f"custom_reward_function.name={name!r} takes {list(params)}{hint}, but each row is scored with "
            f"{name}(data_source=, solution_str=, ground_truth=, extra_info=). Fix: define "
            f"{per_row.format(name)}, or set custom_reward_function.batch=true for a function of lists."
        )


def probe(timeout_s: float) -> tuple[str | None, int]:
    """``(the loading error or None, this worker's pid)``: the scorer's start-up check. Waits until every
    worker of the pool holds a probe (the barrier), so each worker answers exactly one and the scorer
    is built when all its workers are up."""
    if _ready is not None:
        _ready.wait(timeout_s)
    return _load_error, os.getpid()


def _then_bound_log(task: Callable) -> Callable:
    """``task``, then :func:`bound_log` when it ends."""

    @functools.wraps(task)  # pebble pickles the task by its name: the wrapper takes it
    def run(rows: list[tuple]) -> list[Outcome]:
        try:
            return task(rows)
        finally:
            bound_log()

    return run


@_then_bound_log
def score_rows(rows: list[tuple]) -> list[Outcome]:
    """One outcome per ``(data_source, solution_str, ground_truth, extra_info)`` row, calling the
    per-row function with keyword arguments (verl's signature)."""
    if _load_error is not None:
        return [("exception", _load_error)] * len(rows)
    outcomes = []
    for data_source, solution_str, ground_truth, extra_info in rows:
        try:
            result = _fn(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
            )
        except BaseException as exc:  # noqa: BLE001 -- a reward function's failure is a counted outcome
            outcomes.append(("exception", describe(exc)))
            continue
        outcomes.append(as_outcome(result))
    return outcomes


@_then_bound_log
def score_chunk(rows: list[tuple]) -> list[Outcome]:
    """One outcome per row from ONE call of a batch function (verl's ``BatchRewardManager``:
    ``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)`` with lists, returning a list of
    floats or dicts). A call that raises or returns the wrong number of results fails every row."""
    if _load_error is not None:
        return [("exception", _load_error)] * len(rows)
    data_sources, solution_strs, ground_truths, extra_infos = (list(column) for column in zip(*rows))
    try:
        results = _fn(
            data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths, extra_infos=extra_infos
        )
    except BaseException as exc:  # noqa: BLE001
        return [("exception", describe(exc))] * len(rows)
    if isinstance(results, (str, bytes, dict)) or not hasattr(results, "__len__") or len(results) != len(rows):
        got = f"{len(results)} results" if hasattr(results, "__len__") else type(results).__name__
        return [("invalid", f"batch reward function returned {got} for {len(rows)} rows; it must return a list, one per row")] * len(rows)
    return [as_outcome(result) for result in results]


def describe(exc: BaseException, fn: Callable | None = None) -> str:
    """What a user's function (``fn``, default the reward function) did, for the failure counts and the
    stop message: ``called sys.exit(3)``, ``raised KeyboardInterrupt``, or ``ZeroDivisionError: division
    by zero (at my_reward.py:12 in compute_score)``: the innermost line in the function's file, else the
    innermost frame. A ``MemoryError`` under a memory limit names it: ``... (reward.memory_limit_mb=4096)``."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})" if exc.code is not None else "called sys.exit()"
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        return f"raised {text}"
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first frame is the call in this file
    fn_file = getattr(getattr(fn or _fn, "__code__", None), "co_filename", None)
    frames = [f for f in frames if f.filename == fn_file] or frames  # the user's line over a library's
    if frames:
        frame = frames[-1]
        text += f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    if isinstance(exc, MemoryError) and _memory_limit_mb:
        text += f" ({_memory_key}={_memory_limit_mb})"
    return text


def as_score(result) -> tuple[float, dict]:
    """``(score, extras)`` from a reward function's return value; ValueError if it is not usable: not
    a number (None, a string ...) or a dict with a numeric ``"score"``, or not finite."""
    extras = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without 'score' (keys: {list(result)})")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    unusable = f"reward function returned {_shown(result)}; it must return a number or a dict with 'score'"
    if result is None or isinstance(result, (str, bytes)):
        raise ValueError(unusable)
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise ValueError(unusable) from None
    if not math.isfinite(score):
        raise ValueError(f"reward function returned {score}; scores must be finite")
    return score, extras


def _shown(value) -> str:
    """``None``, ``str '1.0'``, ``list [1, 2]``: a returned value as a message quotes it (short)."""
    return "None" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


def as_outcome(result) -> Outcome:
    try:
        score, extras = as_score(result)
        if extras:
            pickle.dumps(extras)  # what cannot travel back to the trainer is an invalid result, not a crash
    except ValueError as exc:
        return ("invalid", str(exc))
    except Exception as exc:  # noqa: BLE001 -- pickling errors come in many types
        return ("invalid", f"reward function returned extras that cannot be pickled: {type(exc).__name__}: {exc}")
    return ("ok", score, extras)
