"""Cross-rank reductions: every rank calls them (they are collectives) and gets the same answer; every rank's
problems in one report (``gather_problems``); and what a rank needs to fail loudly rather than wait: the phase
it is in, named when a collective times out, a word when the ranks take long to meet (``rendezvous_watchdog``),
and a watchdog that stops it when its launcher is gone.

Collectives run on the accelerator device (gloo on CPU, nccl on GPUs, which takes device tensors
only); results come back on the caller's device.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

from dsrl.runtime.launch import Launch
from dsrl.runtime.phases import current_phase
from dsrl.runtime.stalls import extension_wait, in_call

logger = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
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
    """Concatenate every rank's ``[B, T_r, ...]`` rows, right-padded with 0 to the widest ``T_r``.

    Returns the whole ``[world * B, T]`` tensor and the slice of this rank's rows in it; callers cut
    the width back to their own ``T_r``. Every rank must hold the same number of rows ``B``.
    """
    if tensor is None:
        return None, slice(0, 0)
    world, n = _world_size(), tensor.shape[0]
    if world == 1:
        return tensor, slice(0, n)
    width = int(all_reduce(torch.tensor(tensor.shape[1]), "max"))
    padded = F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, width - tensor.shape[1]))  # the columns, any rank
    wire = torch.int32 if tensor.dtype == torch.int16 else tensor.dtype  # gloo gathers no int16 (routing replay's)
    padded = padded.to(accelerator_device(), wire).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    rank = dist.get_rank()
    return torch.cat(parts).to(tensor.device, tensor.dtype), slice(rank * n, (rank + 1) * n)


def gather_problems(problems: list[str]) -> list[str]:
    """Every rank's ``problems`` (one line each), the same list on every rank: a line every rank has, once; a line
    only some have, with which (``... [rank 3 on node-b]``, ``[ranks 8-15 on node-c]``), so that what a rank
    sees alone (a file missing on its node, a module that fails to import there) reaches rank 0's report.
    Collective."""
    world = _world_size()
    if world == 1:
        return list(problems)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), list(problems)))
    seen: dict[str, list[int]] = {}
    for rank, (_, lines) in enumerate(gathered):
        for line in lines:
            seen.setdefault(line, []).append(rank)
    merged = []
    for line, ranks in seen.items():
        if len(ranks) < world:
            hosts = sorted({gathered[rank][0] for rank in ranks})
            line += f" [{rank_span(ranks)} on {', '.join(hosts)}]"
        merged.append(line)
    return merged


def rank_span(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 1, 4``, ``ranks 8-15``, ``ranks 0-4, 6-7`` (ascending ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def collective_timeout_message(err: BaseException) -> str | None:
    """What to tell the user when ``err`` is a collective that timed out, naming the phase this rank was in;
    None for any other error."""
    if not isinstance(err, RuntimeError) or not _TIMEOUT.search(str(err)):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"rank {rank} on {socket.gethostname()}: a collective timed out in phase {current_phase()!r} "
        f"({str(err).splitlines()[0]}): another rank did not join it within actor_rollout_ref.nccl_timeout seconds, so "
        "it is stuck (stopped, deadlocked, waiting on I/O or in another collective) in this phase or an earlier one; "
        "its own output shows where. Fix: if a rank is stuck, stop the run and resume from the last checkpoint; if "
        "this phase is only slow on some ranks, raise actor_rollout_ref.nccl_timeout"
    )


def leave_timed_out_group() -> None:
    """Destroy the default process group after one of its collectives timed out, while this process still
    runs: left to the interpreter's exit, gloo's threads still waiting on the missing peer abort the process
    ("terminate called without an active exception", exit code 134) in place of the exit code the run chose."""
    if dist.is_initialized():
        dist.destroy_process_group()


RENDEZVOUS_REPORT_S = 15.0


@contextmanager
def rendezvous_watchdog(launch: Launch, report_after_s: float = RENDEZVOUS_REPORT_S) -> Iterator[None]:
    """Within ``with`` (forming the process group): every ``report_after_s`` seconds this rank is still in it, say
    what it waits on: an op DeepSpeed builds, or the extension lock of one (``dsrl.runtime.stalls.extension_wait``:
    on a fresh machine, the shared-memory collectives' op); else, in a world of several ranks, the others: where it
    waits, for how many ranks, and why they may not come (a host that never started its ranks; a ``WORLD_SIZE``
    left over in the environment when no launcher started this process)."""
    done = threading.Event()
    watched = threading.get_ident()
    address = f"{launch.master_addr}:{launch.master_port}"
    if launch.launcher == "environment":
        hint = (
            f"; no launcher started this process, so WORLD_SIZE={launch.world_size} may be left over in the "
            "environment: unset WORLD_SIZE RANK LOCAL_RANK MASTER_ADDR MASTER_PORT for one process, or start "
            "the ranks with deepspeed --num_gpus N"
        )
    else:
        hint = (
            f" ({launch.launcher}); a rank that never comes is on a node whose ranks did not start (a hostfile "
            "host pdsh could not reach, a --no_ssh or torchrun command not run there) or cannot reach "
            f"{address}; every rank waits until actor_rollout_ref.nccl_timeout"
        )

    def watch() -> None:
        waited = 0.0
        while not done.wait(report_after_s):
            waited += report_after_s
            frame = sys._current_frames().get(watched)
            if frame is None:
                return
            where = f"rank {launch.rank} on {socket.gethostname()}"
            if (what := extension_wait(frame)) is not None:  # DeepSpeed builds its collectives' op in it
                message = f"{where}: DeepSpeed's init_distributed has run {waited:.0f} s, {what}"
            elif launch.world_size == 1:
                message = (
                    f"{where}: DeepSpeed's init_distributed has run {waited:.0f} s in a world of one process (no "
                    f"other rank to wait for), {in_call(frame)}"
                )
            else:
                message = (
                    f"{where}: waited {waited:.0f} s for the {launch.world_size} ranks of the run to meet at "
                    f"{address}{hint}"
                )
            del frame  # a frame kept between looks would keep its locals alive
            logger.warning(message, extra={"all_ranks": True})

    threading.Thread(target=watch, name="dsrl-rendezvous-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (None once it is gone), from /proc/<pid>/stat: "pid (comm) state ppid ..."."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def stop_when_launcher_dies(launcher: str) -> None:
    """Send this rank SIGTERM (the trainer's graceful stop: finish the step, save a checkpoint) once the process
    that launched it is gone, so that no rank trains on headless: its parent under torchrun, srun and mpirun
    (the agent, slurmstepd, orted), and under ``deepspeed`` also the runner that started the parent (killing
    the ``deepspeed`` command alone leaves its launchers running). A no-op without a launcher
    (``launcher`` "none" or "environment"): a plain ``python scripts/train.py`` keeps running when its shell
    exits (``nohup``)."""
    if launcher in ("none", "environment"):
        return
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            under_deepspeed = b"deepspeed.launcher.launch" in f.read()
    except OSError:  # no /proc (not Linux): nothing to watch
        return
    runner = _parent_pid(parent) if under_deepspeed else None
    gone = (
        f"the deepspeed launcher (pid {parent}) or its runner (pid {runner})"
        if under_deepspeed
        else f"the {launcher} process that started this rank (pid {parent})"
    )

    def watch() -> None:
        while os.getppid() == parent and (runner is None or _parent_pid(parent) == runner):
            time.sleep(1.0)  # a second late is nothing next to a step
        logger.warning(f"{gone} is gone: stopping as on SIGTERM", extra={"all_ranks": True})
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dsrl-launcher-watchdog", daemon=True).start()
