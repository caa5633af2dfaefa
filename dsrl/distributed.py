"""Cross-rank reductions: every rank calls them (they are collectives) and gets the same answer.

Collectives run on the accelerator device (gloo on CPU, nccl on GPUs, which takes device tensors
only); results come back on the caller's device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


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
