"""Cross-rank reductions: every rank calls them (they are collectives) and gets the same answer; and what a
rank needs to fail loudly rather than wait: the phase it is in, named when a collective times out, and a
watchdog that stops it when its launcher is gone.

Collectives run on the accelerator device (gloo on CPU, nccl on GPUs, which takes device tensors
only); results come back on the caller's device.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

logger = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_phase = "start-up"  # what this rank is doing, for the message of a collective that times out
# gloo's timeout ("Timed out waiting 600000ms for recv"), the collectives after it, and NCCL's watchdog (raised
# only under TORCH_NCCL_BLOCKING_WAIT=1; otherwise the watchdog aborts the process with its own message).
_TIMEOUT = re.compile(r"Timed out waiting|Application timeout caused pair closure|collective operation timeout")


def accelerator_device() -> torch.device:
    """This rank's accelerator device (``cpu`` under ``DS_ACCELERATOR=cpu``)."""
    return torch.device(get_accelerator().current_device_name())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``values`` reduced (``sum``, ``max`` or ``min``) over all ranks; a new tensor on ``values``' device.

    Sums travel as float64 so token counts and metric sums stay exact.
    """
    out = values.detach().to(accelerator_device(), dtype=torch.float64 if op == "sum" else values.dtype, copy=True)
    if _world_size() > 1:
        dist.all_reduce(out, op=_OPS[op])
    return out.to(values.device)


def global_stats(values: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max, min) of a tensor's elements over every rank's elements."""
    values = values.detach().reshape(-1).double()
    total, count = all_reduce(torch.stack([values.sum(), values.new_tensor(values.numel())])).tolist()
    return total / count, all_reduce(values.max(), "max").item(), all_reduce(values.min(), "min").item()


def global_mean(values: torch.Tensor) -> float:
    """Mean of a tensor's elements over every rank's elements."""
    return global_stats(values)[0]


def all_gather_rows(tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, slice]:
    """Concatenate every rank's ``[B, T_r]`` rows, right-padded with 0 to the widest ``T_r``.

    Returns the whole ``[world * B, T]`` tensor and the slice of this rank's rows in it; callers cut
    the width back to their own ``T_r``. Every rank must hold the same number of rows ``B``.
    """
    if tensor is None:
        return None, slice(0, 0)
    world, n = _world_size(), tensor.shape[0]
    if world == 1:
        return tensor, slice(0, n)
    width = int(all_reduce(torch.tensor(tensor.shape[1]), "max"))
    padded = F.pad(tensor, (0, width - tensor.shape[1])).to(accelerator_device()).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    rank = dist.get_rank()
    return torch.cat(parts).to(tensor.device), slice(rank * n, (rank + 1) * n)


@contextmanager
def in_phase(name: str) -> Iterator[None]:
    """Within ``with``: this rank is in phase ``name`` (the outer phase again after it)."""
    global _phase
    outer, _phase = _phase, name
    yield
    _phase = outer  # skipped by an exception: the phase it was raised in stays named for the error message


def collective_timeout_message(err: BaseException) -> str | None:
    """What to tell the user when ``err`` is a collective that timed out, naming the phase this rank was in;
    None for any other error."""
    if not isinstance(err, RuntimeError) or not _TIMEOUT.search(str(err)):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"rank {rank}: a collective timed out in phase {_phase!r} ({str(err).splitlines()[0]}): another rank did "
        "not join it within actor_rollout_ref.nccl_timeout seconds, so it is stuck (stopped, deadlocked, waiting on "
        "I/O or in another collective) in this phase or an earlier one; its own output shows where. Fix: if a rank "
        "is stuck, stop the run and resume from the last checkpoint; if this phase is only slow on some ranks, "
        "raise actor_rollout_ref.nccl_timeout"
    )


def _parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (None once it is gone), from /proc/<pid>/stat: "pid (comm) state ppid ..."."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def stop_when_launcher_dies() -> None:
    """Under the ``deepspeed`` launcher, send this rank SIGTERM (the trainer's graceful stop: finish the step, save
    a checkpoint) once the launcher (``deepspeed.launcher.launch``, the parent) or the runner that started it (the
    ``deepspeed`` command) is gone; killing the runner alone would otherwise leave the ranks training headless.
    A no-op elsewhere: a plain ``python scripts/train.py`` keeps running when its shell exits (``nohup``)."""
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            if b"deepspeed.launcher.launch" not in f.read():
                return
    except OSError:  # no /proc (not Linux): nothing to watch
        return
    runner = _parent_pid(launcher)

    def watch() -> None:
        while os.getppid() == launcher and _parent_pid(launcher) == runner:
            time.sleep(1.0)  # a second late is nothing next to a step
        logger.warning(
            f"the deepspeed launcher (pid {launcher}) or its runner (pid {runner}) is gone: stopping as on SIGTERM",
            extra={"all_ranks": True},
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dsrl-launcher-watchdog", daemon=True).start()
