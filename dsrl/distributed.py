"""Cross-rank reductions used outside the engines: every rank calls them and gets the same answer."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def global_stats(values: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max, min) of a 1-D tensor over every rank's values."""
    values = values.detach().double().cpu()
    packed = torch.stack([values.sum(), values.new_tensor(values.numel())])
    hi, lo = values.max().clone(), values.min().clone()
    if _world_size() > 1:
        dist.all_reduce(packed)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (packed[0] / packed[1]).item(), hi.item(), lo.item()


def global_mean(values: torch.Tensor) -> float:
    """Mean of a tensor's elements over every rank's elements."""
    return global_stats(values.reshape(-1))[0]


def all_gather_rows(tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, slice]:
    """Concatenate every rank's ``[B_r, T_r]`` rows (right-padded with 0 to the widest T).

    Returns the whole ``[sum B_r, T]`` tensor and the slice of rows (this rank's) to take back;
    callers cut the width back to their own ``T_r``. Every rank must hold the same number of rows.
    """
    world = _world_size()
    rows = slice(0, 0) if tensor is None else slice(0, tensor.shape[0])
    if tensor is None or world == 1:
        return tensor, rows
    width = torch.tensor([tensor.shape[1]])
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    padded = F.pad(tensor, (0, int(width) - tensor.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    rank, n = dist.get_rank(), tensor.shape[0]
    return torch.cat(parts), slice(rank * n, (rank + 1) * n)
