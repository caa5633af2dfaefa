"""The PPO update loop shared by the actor and the critic.

``ppo_epochs`` passes over the rank's batch, each a (seeded) shuffle cut into mini-batches; each
mini-batch is cut into micro-batches and ends in exactly one optimizer step.

Loss normalisation and DeepSpeed's scaling. A mini-batch's loss is normalised by GLOBAL counts
(tokens / sequences of the mini-batch over all ranks and micro-batches), so every micro-batch loss
``l_j`` on rank ``r`` is a partial sum and the objective is ``L = sum_r sum_j l_rj``. DeepSpeed
divides the loss by ``gradient_accumulation_steps`` inside ``backward`` and averages gradients over
the ``W`` data-parallel ranks. dsrl calls ``engine.backward(W * l_j, scale_wrt_gas=False)``: no
division by the accumulation steps, and the factor ``W`` cancels the averaging, so the reduced
gradient is exactly ``grad L`` for any split into micro-batches (and any number of them). The
accumulation boundary is driven explicitly (``set_gradient_accumulation_boundary``), so the
number of micro-batches may differ from the nominal ``gradient_accumulation_steps`` (token-budget
micro-batching).

Non-finite updates. ZeRO (stages 1-3, every precision dsrl allows) discards an optimizer step whose
global gradient norm is not finite. dsrl counts those steps
(``SkipCounter``) and checks the guarantee: a step DeepSpeed applied with a non-finite loss or norm
stops the run before that state can be saved.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from dsrl.data.batch import Batch
from dsrl.engines.grad_variance import (
    SUM_SHARE_SQUARED,
    SUM_SQUARED_OVER_SHARE,
    MicroBatchGradNorms,
    grad_variance,
    micro_batch_share,
)
from dsrl.engines.sequence_parallel import SequenceParallel
from dsrl.runtime.distributed import all_reduce

# loss_fn(micro, rows, num_tokens, num_seqs) -> (loss, metric contributions); ``rows`` are the micro-batch's
# row numbers in the batch given to ``run_ppo_updates`` (None: another sequence-parallel member's rows); the
# contributions of all micro-batches and ranks add up to the mini-batch's metric values.
LossFn = Callable[[Batch, torch.Tensor | None, float, float], tuple[torch.Tensor, dict[str, torch.Tensor]]]
SplitFn = Callable[[Batch], list[torch.Tensor]]


class SkipCounter:
    """Optimizer steps skipped for a non-finite loss or gradient norm: in total and in a row."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.total = 0
        self.consecutive = 0
        self.last_bad: dict[str, float] = {}

    def record(self, *, applied: bool, loss: float, grad_norm: float) -> None:
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if applied and not finite:
            raise RuntimeError(
                f"{self.prefix}: DeepSpeed applied an optimizer step with loss={loss}, grad_norm={grad_norm}; "
                "dsrl needs ZeRO's non-finite gradient check (zero_optimization.stage 1-3, bf16.check_grad_overflow "
                "true)"
            )
        if applied:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        self.last_bad = {f"{self.prefix}/loss": loss, f"{self.prefix}/grad_norm": grad_norm}

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive, "last_bad": self.last_bad}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.consecutive, self.last_bad = state["total"], state["consecutive"], state["last_bad"]


def mini_batch_geometry(
    *, prefix: str, mini_batch_size: int, n: int, micro_batch_size: int, use_dynamic_bsz: bool
) -> tuple[int, int, int]:
    """(sequences per rank per mini-batch, DeepSpeed micro-batch size, accumulation steps).

    ``mini_batch_size`` counts prompts over all ranks (verl); each has ``n`` responses. With
    token-budget micro-batches the DeepSpeed geometry is nominal (one row per micro-step): dsrl
    drives the accumulation boundary and the loss scaling itself.
    """
    world = dist.get_world_size()
    rows = mini_batch_size * n
    if rows % world:
        raise ValueError(
            f"{prefix}.ppo_mini_batch_size={mini_batch_size} x rollout.n={n} = {rows} sequences "
            f"does not split over {world} ranks; make it a multiple of the world size"
        )
    per_rank = rows // world
    if use_dynamic_bsz:
        return per_rank, 1, per_rank
    if per_rank % micro_batch_size:
        raise ValueError(
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro_batch_size} does not divide the {per_rank} sequences "
            f"per rank of a mini-batch ({prefix}.ppo_mini_batch_size x rollout.n / world size); choose a divisor"
        )
    return per_rank, micro_batch_size, per_rank // micro_batch_size


def shuffle_order(n: int, *, seed: int, step: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Row order of one epoch: a permutation drawn from (seed, optimizer step count, epoch), or 0..n-1.

    Seeding from DeepSpeed's step count (restored with its checkpoints) keeps resumed runs identical.
    """
    if not shuffle:
        return torch.arange(n)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch)
    return torch.randperm(n, generator=generator)


def global_counts(response_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, sequences with at least one valid token) of a mini-batch over all ranks."""
    mask = response_mask.float()
    local = torch.stack([mask.sum(), (mask.sum(-1) > 0).float().sum()])
    num_tokens, num_seqs = all_reduce(local).tolist()
    return num_tokens, num_seqs


def run_ppo_updates(
    engine,
    batch: Batch,
    *,
    rows_per_mini_batch: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    split: SplitFn,
    loss_fn: LossFn,
    skips: SkipCounter,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_norms: MicroBatchGradNorms | None = None,
    loss_agg_mode: str = "token-mean",
    sp: SequenceParallel | None = None,
) -> dict[str, float]:
    """Train ``engine`` on ``batch`` (one training step), then step ``lr_scheduler`` once, as verl does.

    Metrics are averaged over the optimizer steps and equal on all ranks. Adds ``{prefix}/loss`` (the
    objective), ``{prefix}/grad_norm``
    (global, before clipping), ``{prefix}/lr`` (after the scheduler step: verl's value) and
    ``{prefix}/skipped_steps`` (optimizer steps skipped so far in the run) to the loss function's
    metrics; ``prefix`` is ``skips.prefix``. With ``grad_norms`` (hooked on ``engine``'s module), also
    ``{prefix}/grad_var`` and ``{prefix}/grad_var_relative`` (``dsrl.engines.grad_variance``; micro-batch
    shares by ``loss_agg_mode``), for optimizer steps of two or more micro-batches over all ranks.

    With ``sp`` (``dsrl.engines.sequence_parallel``) the group trains each member's micro-batches in turn, every
    rank on its shard of the same loss: each token's gradient comes from one rank, so the scaling above holds, and
    only the member whose rows they are adds a micro-batch's metrics.
    """
    prefix = skips.prefix
    loss_name = f"{prefix}/loss"  # the objective itself: verl's metric, and the non-finite check
    world = dist.get_world_size()
    start_step = engine.global_steps
    records: dict[str, list[float]] = {}
    for epoch in range(epochs):
        order = shuffle_order(len(batch), seed=seed, step=start_step, epoch=epoch, shuffle=shuffle)
        for rows in order.split(rows_per_mini_batch):
            mini = batch.select(rows)
            num_tokens, num_seqs = global_counts(mini.response_mask)
            # a mini-batch whose every row is masked (actor.mask_truncated_completions) trains on a zero loss, not 0/0
            num_tokens, num_seqs = max(num_tokens, 1.0), max(num_seqs, 1.0)
            members = [mini] if sp is None else sp.members(mini)
            own = 0 if sp is None else sp.rank
            micro_batches = [(m, member.select(idx), idx) for m, member in enumerate(members) for idx in split(member)]
            sums: dict[str, torch.Tensor] = {}
            for j, (m, micro, idx) in enumerate(micro_batches):
                engine.set_gradient_accumulation_boundary(j == len(micro_batches) - 1)
                loss, contributions = loss_fn(micro, rows[idx] if m == own else None, num_tokens, num_seqs)
                engine.backward(loss * world, scale_wrt_gas=False)
                if m != own:
                    continue
                for name, value in {**contributions, loss_name: loss}.items():
                    sums[name] = sums.get(name, 0.0) + value.detach().double()  # stays on device: no sync
                if grad_norms is not None:
                    squared = grad_norms.take(loss.device) / world**2  # the hooks saw the gradient of world * loss
                    share = micro_batch_share(
                        micro.response_mask, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs
                    )
                    # a micro-batch with no response token gives no gradient and no estimate; the keys are added
                    # on every rank all the same, as the all-reduce below stacks the sums by name
                    over_share = squared / share if share > 0 else squared.new_zeros(())
                    sums[SUM_SQUARED_OVER_SHARE] = sums.get(SUM_SQUARED_OVER_SHARE, 0.0) + over_share
                    sums[SUM_SHARE_SQUARED] = sums.get(SUM_SHARE_SQUARED, 0.0) + squared.new_tensor(share**2)
            engine.step()
            names = sorted(sums)
            totals = dict(zip(names, all_reduce(torch.stack([sums[name] for name in names])).tolist(), strict=True))
            grad_norm = float(engine.get_global_grad_norm())
            skips.record(applied=engine.was_step_applied(), loss=totals[loss_name], grad_norm=grad_norm)
            if grad_norms is not None:
                variance, relative = grad_variance(
                    totals.pop(SUM_SQUARED_OVER_SHARE), totals.pop(SUM_SHARE_SQUARED), grad_norm
                )
                if math.isfinite(variance):
                    records.setdefault(f"{prefix}/grad_var", []).append(variance)
                    records.setdefault(f"{prefix}/grad_var_relative", []).append(relative)
            for name, total in totals.items():
                records.setdefault(name, []).append(total)
            records.setdefault(f"{prefix}/grad_norm", []).append(grad_norm)
    metrics = {name: sum(values) / len(values) for name, values in records.items()}
    lr_scheduler.step()
    metrics[f"{prefix}/lr"] = lr_scheduler.get_last_lr()[0]
    metrics[f"{prefix}/skipped_steps"] = float(skips.total)
    return metrics
