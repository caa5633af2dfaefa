"""The worker pool of the reward scorer and of the rollout's tools: pebble worker processes started by
``spawn`` without the parent's ``__main__``, each leading a process group that is killed with it, tied to
the trainer's life, memory bounded, output to a log file (``dsrl.workers.process`` is their side).

Why processes: the code a worker runs (a user's reward function or tool) can hang or hold the GIL in C
code; a thread cannot be stopped, and ``signal.alarm`` works only in the main thread and not inside C
calls. A worker process can always be killed, and a crashing function (even a segfault) does not take the
trainer down. pebble's ``ProcessPool`` kills and replaces only the worker whose task ran past its timeout
(or died), so the other tasks go on in the other workers. The clock of a task starts when a worker takes
it.

Start method: ``spawn`` (no ``fork`` of a process holding CUDA, DeepSpeed and NCCL state), but without
the part of ``spawn`` that re-runs the parent's ``__main__`` script in every child as ``__mp_main__``
(for ``scripts/train.py`` that would import torch and the trainer in each worker): the pool's own
multiprocessing context drops the main-module entries from the preparation data of the processes it
starts, and only those (a thread-local flag around ``multiprocessing.spawn.get_preparation_data``). A
worker imports dsrl.rewards, pebble and what its initializer loads (the user's file, once): about 0.3 s
of start-up, paid at construction and again only for a worker that replaces a killed one.

Life of the workers: :meth:`WorkerPool.close` (also at garbage collection and ``atexit``) stops the
pool. A SIGKILLed trainer runs no atexit handler: pebble's idle workers then exit on the end of file of
their task pipe, but a worker inside a hanging call would live on (checked: it is reparented to init); so
every worker also sets ``PR_SET_PDEATHSIG`` (SIGKILL) on Linux, a ``getppid`` watchdog thread elsewhere
(``dsrl.workers.process.die_with_parent``). The kernel sends that signal when the *thread* that started the
worker ends: the pool's first workers are started by the thread that builds the pool (build it on the
trainer's main thread; a pool replaced after a hang or a breakdown, by the thread that replaces it),
replacements by pebble's pool thread. A worker is stopped with SIGKILL (to its process group, below), not
pebble's SIGTERM, whose Python handler could not run inside a C call holding the GIL (pebble would wait
3 s, then SIGKILL): a timed-out call is ended at once.

What a call starts (``subprocess``, ``os.fork``, a shell pipeline: code execution) goes with its worker:
each worker leads a process group of its own (``os.setpgrp`` before the user's file is imported), and the
group is SIGKILLed whenever the worker is stopped: on a timeout and when the pool closes (pebble calls
:meth:`_WorkerProcess.terminate`), and when a worker dies in a call (the group of
``ProcessExpired.pid``, :meth:`WorkerPool.failure`). Not covered: a descendant that starts a session or
group of its own (``start_new_session=True``, ``setsid``), and the descendants of a worker killed with a
SIGKILLed trainer (``PR_SET_PDEATHSIG`` ends the worker alone).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.spawn
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures.process import BrokenProcessPool

import pebble

from dsrl.workers import process

logger = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 16
# Python start-up plus loading the user's file; a pool whose first worker is not ready by then is broken.
_STARTUP_TIMEOUT_S = 120.0


def default_num_workers() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``), shared by
    the ranks of this node (``LOCAL_SIZE``, which ``dsrl.runtime.launch`` sets under every launcher, or torchrun's
    ``LOCAL_WORLD_SIZE``), at most 16: every rank has its own pool, so 8 ranks do not start 8 x 16 workers.
    A SLURM task bound to its ``--cpus-per-task`` (no more CPUs than ``SLURM_CPUS_PER_TASK``) has its share."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1")
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and cpus <= int(per_task):
        local_ranks = 1  # SLURM bound this task to its own share already
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // max(local_ranks, 1)))


# ---------------------------------------------------------------- spawn without re-running __main__

_launching = threading.local()


def _preparation_data(name: str) -> dict:
    data = _stdlib_preparation_data(name)
    if getattr(_launching, "pool_worker", False):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


_stdlib_preparation_data = getattr(
    multiprocessing.spawn.get_preparation_data, "__wrapped__", multiprocessing.spawn.get_preparation_data
)
_preparation_data.__wrapped__ = _stdlib_preparation_data


def _install_preparation_hook() -> None:
    """Route ``spawn.get_preparation_data`` through ``_preparation_data``: unchanged for every process
    but those :class:`_WorkerProcess` starts on this thread at this moment."""
    if multiprocessing.spawn.get_preparation_data is not _preparation_data:
        multiprocessing.spawn.get_preparation_data = _preparation_data


def kill_process_group(pid: int) -> bool:
    """SIGKILL the process group that the worker ``pid`` leads: the worker and every process it started.
    False when there is no such group (the worker had not called ``setpgrp`` yet, or it and all it
    started are gone) or only processes this one may not signal (setuid programs) are left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A pool worker: started without the parent's ``__main__``; stopping it kills its process group."""

    def terminate(self) -> None:
        # pebble stops a worker (a timeout, the pool's end, exit) with terminate(), then SIGKILL to the pid.
        if not kill_process_group(self.pid):
            super().kill()  # not yet a group leader: the worker alone

    kill = terminate

    @staticmethod
    def _Popen(process_obj):
        _launching.pool_worker = True
        try:
            return multiprocessing.context.SpawnProcess._Popen(process_obj)
        finally:
            _launching.pool_worker = False


class _WorkerContext(multiprocessing.context.SpawnContext):
    """The ``spawn`` context, its processes started without the parent's ``__main__``."""

    Process = _WorkerProcess


# ---------------------------------------------------------------- the pool


class WorkerPool:
    """A pebble pool of ``num_workers`` workers, each set up by ``initializer(*initargs, ready)`` (which
    calls :func:`dsrl.workers.process.setup`, then loads what its tasks call, keeping a loading error).

    Args:
        what: the pool's name in messages ("reward", "tool").
        num_workers: worker processes.
        initializer, initargs: pebble's initializer (a module-level function of the worker side) and its
            arguments; a multiprocessing Barrier is appended, which :func:`dsrl.workers.process.probe` meets.
        memory_limit_mb, memory_key: the workers' memory bound and the config key that sets it (for the
            message of a worker that died).

    :meth:`start` waits until every worker is ready and raises ValueError with a worker's loading error.
    """

    def __init__(
        self,
        what: str,
        num_workers: int,
        initializer: Callable,
        initargs: tuple,
        *,
        memory_limit_mb: int,
        memory_key: str,
    ):
        self.what, self.num_workers = what, num_workers
        self.memory_limit_mb, self.memory_key = memory_limit_mb, memory_key
        self._initializer, self._initargs = initializer, initargs
        self.pebble: pebble.ProcessPool | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self) -> float:
        """Start the workers (stopping any earlier ones) and wait until every one has loaded what it
        runs; seconds it took."""
        self.close()
        _install_preparation_hook()
        start = time.perf_counter()
        context = _WorkerContext()
        # Lives as long as the pool: replacement workers unpickle it from the initializer's arguments too.
        self._ready = context.Barrier(self.num_workers)
        pool = pebble.ProcessPool(
            max_workers=self.num_workers,
            initializer=self._initializer,
            initargs=(*self._initargs, self._ready),
            context=context,
        )
        self.pebble = pool
        self._finalizer = weakref.finalize(self, _stop_pool, pool, self.what)
        probes = [pool.schedule(process.probe, (_STARTUP_TIMEOUT_S,)) for _ in range(self.num_workers)]
        try:
            answers = [probe.result(timeout=_STARTUP_TIMEOUT_S + 10) for probe in probes]
        except FutureTimeoutError:
            self.close()
            raise RuntimeError(
                f"the {self.what} workers did not start within {_STARTUP_TIMEOUT_S:.0f} s "
                "(does importing the user's file hang?)"
            ) from None
        except Exception as exc:
            self.close()
            raise RuntimeError(f"the {self.what} workers failed to start: {type(exc).__name__}: {exc}") from exc
        errors = [error for error, _ in answers if error is not None]
        if errors:
            self.close()
            raise ValueError(errors[0])
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the workers, each with its process group (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self.pebble, self._finalizer = None, None

    def replace_if_broken(self) -> None:
        """A new pool when pebble gave this one up (a worker died at a moment pebble cannot recover from)."""
        if not self.pebble.active:
            logger.warning("%s: the worker pool broke down; starting a new one", self.what)
            self.start()

    def worker_pids(self) -> list[int]:
        """The pids of the live workers (for tests and diagnostics)."""
        manager = getattr(self.pebble, "_pool_manager", None)  # pebble's bookkeeping (5.x)
        workers = getattr(getattr(manager, "worker_manager", None), "workers", {})
        return [pid for pid in tuple(workers) if pid is not None]

    def failure(self, exc: BaseException, timeout_message: str) -> tuple[str, str]:
        """``(kind, message)`` of a task whose future raised ``exc``: ``timeout`` (``timeout_message``),
        ``crash`` (the worker died: its process group is killed here, what the call started), ``broken``
        (the pool broke down under the call) or ``exception`` (e.g. arguments pebble could not pickle)."""
        if isinstance(exc, FutureTimeoutError):
            return "timeout", timeout_message
        if isinstance(exc, pebble.ProcessExpired):
            kill_process_group(exc.pid)
            memory = (
                f" (if it ran out of memory: {self.memory_key}={self.memory_limit_mb} bounds each worker)"
                if self.memory_limit_mb
                else ""
            )
            return "crash", f"the {self.what} worker died ({_exit_reason(exc.exitcode)}) in this call{memory}"
        if isinstance(exc, (BrokenProcessPool, RuntimeError)):
            return "broken", f"the {self.what} worker pool broke down: {type(exc).__name__}: {exc}"
        return "exception", f"{type(exc).__name__}: {exc}"


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _stop_pool(pool: pebble.ProcessPool, what: str) -> None:
    """Stop a pool's workers now (each with its process group: :meth:`_WorkerProcess.terminate`) and its
    threads."""
    pool.stop()
    try:
        pool.join(timeout=30)
    except Exception as exc:  # noqa: BLE001 -- stopping must not raise at exit
        logger.warning("%s: stopping the worker pool: %s: %s", what, type(exc).__name__, exc)
