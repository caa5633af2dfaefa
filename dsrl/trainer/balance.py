"""Rows of a step moved across ranks: ``trainer.balance_batch`` (verl's default), so that each rank
holds the same number of rows and about the same work; and PF-PPO's redraw of the global batch
(``algorithm.use_pf_ppo``).

Balance.
Each rank generates the responses of its own prompts, so with long-tailed response lengths one
rank can hold far more tokens than the others, and under ZeRO-3 every collective of the step waits
for it. Right after generation the rows are reassigned: longest first, each to the rank with the
least work that still has room, work being verl's FLOP estimate ``24576 L + L^2`` of a sequence of
``L`` tokens. Group ids are global and the estimators run on the gathered global batch, so no
result depends on which rank holds a row.

PF-PPO. verl redraws the whole batch on its driver; here every rank gathers the rows' scores, draws
the same global row numbers from a generator seeded by the caller (``dsrl.algorithms.pf_ppo``), and
takes its share, the draws ``rank * B .. (rank + 1) * B - 1``, from the ranks that hold them.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch
import torch.distributed as dist

from dsrl.algorithms import pf_ppo_indices
from dsrl.data.batch import ROW_FIELDS, Batch
from dsrl.runtime.distributed import all_gather_rows


def workload(lengths: torch.Tensor) -> torch.Tensor:
    """verl's relative cost of a sequence: dense FLOPs of a 4096-wide transformer, ``24576 L + L^2``."""
    return 24576 * lengths + lengths**2


def equal_size_partition(costs: list[int], parts: int) -> list[list[int]]:
    """Row indices split into ``parts`` parts of equal size with near-equal cost sums, each sorted.

    Greedy: rows by decreasing cost, each to the cheapest part that is not full.
    """
    if len(costs) % parts:
        raise ValueError(f"{len(costs)} rows do not split into {parts} equal parts")
    size = len(costs) // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    open_parts = [(0, j) for j in range(parts)]  # a heap of (cost so far, part)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        cost, j = heapq.heappop(open_parts)
        members[j].append(i)
        if len(members[j]) < size:
            heapq.heappush(open_parts, (cost + costs[i], j))
    return [sorted(part) for part in members]


def _sums(lengths: list[int], parts: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in part) for part in parts]


def balance_across_ranks(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """This rank's share of the balanced global batch, and verl's ``global_seqlen/*`` metrics
    (tokens per rank before and after). Collective; every rank holds the same number of rows."""
    world, rank, n = dist.get_world_size(), dist.get_rank(), len(batch)
    lengths_all, _ = all_gather_rows(batch.attention_mask.sum(-1, keepdim=True))
    lengths = lengths_all[:, 0].tolist()
    parts = equal_size_partition(workload(lengths_all[:, 0]).tolist(), world)
    before = _sums(lengths, [list(range(r * n, (r + 1) * n)) for r in range(world)])
    after = _sums(lengths, parts)
    metrics = {
        "global_seqlen/min": min(before),
        "global_seqlen/max": max(before),
        "global_seqlen/minmax_diff": max(before) - min(before),
        "global_seqlen/balanced_min": min(after),
        "global_seqlen/balanced_max": max(after),
        "global_seqlen/mean": sum(before) / world,
    }
    return take_global_rows(batch, parts[rank]), metrics


def pf_ppo_resample(batch: Batch, reweight_method: str, weight_pow: float, seed: int) -> Batch:
    """This rank's share of the global batch redrawn with replacement by PF-PPO's weights of the
    rows' scores (``token_level_scores`` summed), drawn with a generator seeded with ``seed``.
    Collective; the same draw on every rank."""
    scores, _ = all_gather_rows(batch.token_level_scores)
    generator = torch.Generator().manual_seed(seed)
    rows = pf_ppo_indices(scores.sum(-1).cpu(), reweight_method, weight_pow, generator)
    n, rank = len(batch), dist.get_rank()
    return take_global_rows(batch, rows[rank * n : (rank + 1) * n].tolist())


def take_global_rows(batch: Batch, rows: list[int]) -> Batch:
    """This rank's new batch: rows ``rows`` of the global batch (every rank's rows in rank order; a row
    may come more than once), from whichever ranks hold them. Collective; every rank holds and takes
    the same number of rows."""
    world = dist.get_world_size()
    mine = torch.tensor(rows)
    if world == 1:
        return batch.select(mine)
    fields = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if f.name in ROW_FIELDS:
            gathered: list[list] = [[] for _ in range(world)]
            dist.all_gather_object(gathered, value)
            everyone = [item for part in gathered for item in part]
            fields[f.name] = [everyone[i] for i in rows] if everyone else []
        elif value is None:
            fields[f.name] = None
        elif value.dim() == 1:
            fields[f.name] = all_gather_rows(value[:, None])[0][mine, 0]
        elif f.name.startswith("prompt_"):  # left-padded: gathered flipped, so the padding is added on the left
            fields[f.name] = all_gather_rows(value.flip(1))[0][mine].flip(1)
        else:
            fields[f.name] = all_gather_rows(value)[0][mine]
    return Batch(**fields)
