"""DAPO's dynamic sampling (Yu et al., 2025, https://arxiv.org/abs/2503.14476): ``algorithm.filter_groups``.

A group (the responses to one prompt, rows sharing a ``group_ids`` value) whose metric is the same for
every response has zero advantage under a group estimator and teaches nothing. After scoring, such
groups are dropped; while fewer than ``data.train_batch_size`` informative groups remain, the next
``data.gen_batch_size`` prompts (null: ``data.train_batch_size``) are drawn from the sampler, generated and
scored ("a round"), and their informative groups added. The step then trains on exactly
``data.train_batch_size`` groups, so the optimizer's geometry does not change; informative groups beyond that
are dropped, as verl does, and so are the prompts they came from: the sampler moves on by whole rounds.

As verl's DAPO recipe (``recipe/dapo/dapo_ray_trainer.py``, ``fit``): a group is kept when its metric's
std is > 0 or it has a single response (here: when its values are not all equal, which is what std > 0
means without float round-off); ``max_num_gen_batches`` rounds at most, <= 0 for no limit, and a step
that is still short after them raises; each round is one batch of verl's dataloader, ``data.gen_batch_size``
prompts (verl's DAPO script: 3 x ``data.train_batch_size``); ``train/num_gen_batches`` counts a step's rounds.

Across ranks. Each rank generates its own shard of every round's prompts, exactly as without
filtering. One collective per round (``all_gather_object`` of each rank's per-group verdicts) gives
every rank the same view, so all agree on when to stop and on the kept set: the first
``data.train_batch_size`` informative groups in (round, rank, position) order. Kept group ``i`` goes to
rank ``i // (train_batch_size / world_size)``, so each rank again holds the same number of rows
(``dsrl.trainer.balance.take_global_rows``; ``trainer.balance_batch`` then runs on the kept batch).

The metric (``algorithm.filter_groups.metric``): ``seq_reward`` or ``score`` is a row's score (its
``token_level_scores`` summed, before any in-reward KL); ``seq_final_reward`` is the same here, since
an in-reward KL penalty (not known before the reference pass) is refused with filtering; any other name
is a number the reward function returns in its dict (DAPO's recipe uses ``acc``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsrl.data.batch import Batch
from dsrl.trainer.balance import take_global_rows

SCORE_METRICS = ("seq_reward", "score", "seq_final_reward")  # the row's score; else a reward extra
KEPT = "kept"
# Why a group was dropped: every value 1 (for a 0/1 metric such as acc: every response right), every value 0
# (every response wrong), or any other value shared by all responses.
DROP_REASONS = ("all_correct", "all_wrong", "all_equal")


def metric_values(metric: str, scores: torch.Tensor, extras: dict[str, list]) -> tuple[list[float], str | None]:
    """This round's metric per row, and a problem line (the run stops) when the reward did not give it.

    ``scores``: ``[B]`` the rows' scores; ``extras``: the reward's extras, B values per name (None where a row
    gave none)."""
    if metric in SCORE_METRICS:
        return scores.tolist(), None
    values = extras.get(metric)
    bad = (
        list(range(len(scores)))
        if values is None
        else [i for i, v in enumerate(values) if not (isinstance(v, (int, float)) and math.isfinite(v))]
    )
    if bad:
        given = ", ".join(sorted(extras)) or "none"
        return [], (
            f"algorithm.filter_groups.metric={metric}: the reward gave no finite number under {metric!r} for "
            f"{len(bad)} of {len(scores)} rows (first: row {bad[0]}; the reward's extras: {given}). Fix: set "
            f"algorithm.filter_groups.metric to seq_reward (the score) or to a key every row's reward dict holds"
        )
    return [float(v) for v in values], None


def group_verdicts(group_ids: list[int], values: list[float]) -> list[str]:
    """For each group, in order of its first row: ``kept`` (values not all equal, or a group of one, as
    verl) or the drop reason (``DROP_REASONS``)."""
    groups: dict[int, list[float]] = {}
    for gid, value in zip(group_ids, values, strict=True):
        groups.setdefault(gid, []).append(value)
    verdicts = []
    for members in groups.values():
        if len(members) == 1 or any(v != members[0] for v in members):
            verdicts.append(KEPT)
        else:
            verdicts.append({1.0: "all_correct", 0.0: "all_wrong"}.get(members[0], "all_equal"))
    return verdicts


def kept_groups(verdicts: list[list[list[str]]], n_groups: int) -> list[tuple[int, int, int]]:
    """The first ``n_groups`` kept groups as (round, rank, position) in that order (all of them when fewer);
    ``verdicts[round][rank][position]``."""
    order = [
        (k, r, p)
        for k, ranks in enumerate(verdicts)
        for r, groups in enumerate(ranks)
        for p, verdict in enumerate(groups)
        if verdict == KEPT
    ]
    return order[:n_groups]


def transfer_plan(
    kept: list[tuple[int, int, int]], world: int, rank: int, n: int
) -> tuple[list[tuple[int, int]], int, list[int]]:
    """How the kept groups (of ``n`` rows each) reach their ranks: the (round, position) of the groups this rank
    ships, the rows ``M`` every rank ships (the most any rank holds; fewer are padded), and the global rows
    (``take_global_rows``' numbering: rank r's j-th shipped row is ``r * M + j``) this rank takes. Kept group
    ``i`` goes to rank ``i // (len(kept) / world)``."""
    held: list[list[int]] = [[] for _ in range(world)]  # per source rank: indices into kept
    for i, (_, r, _) in enumerate(kept):
        held[r].append(i)
    width = max(len(h) for h in held) * n
    home = {}  # kept index -> its first global row
    for r, indices in enumerate(held):
        for j, i in enumerate(indices):
            home[i] = r * width + j * n
    per_rank = len(kept) // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    rows = [home[i] + t for i in mine for t in range(n)]
    return [(kept[i][0], kept[i][2]) for i in held[rank]], width, rows


@dataclass
class Rounds:
    """A step's rounds on this rank: the scored batches and every rank's verdicts."""

    batches: list[Batch] = field(default_factory=list)
    verdicts: list[list[list[str]]] = field(default_factory=list)  # [round][rank][position]

    def metrics(self, n_groups: int, prompts_per_round: int) -> dict[str, float]:
        counts = verdict_counts([v for ranks in self.verdicts for groups in ranks for v in groups])
        informative = counts[KEPT]
        return {
            "train/num_gen_batches": len(self.verdicts),  # verl's name
            "dynamic_sampling/prompts_consumed": len(self.verdicts) * prompts_per_round,
            "dynamic_sampling/groups_generated": sum(counts.values()),
            "dynamic_sampling/groups_informative": informative,
            "dynamic_sampling/groups_kept": min(informative, n_groups),
            "dynamic_sampling/groups_surplus": max(informative - n_groups, 0),  # informative, beyond the batch
            **{f"dynamic_sampling/dropped_{reason}": counts[reason] for reason in DROP_REASONS},
        }


def verdict_counts(verdicts: list[str]) -> dict[str, int]:
    """How many of ``verdicts`` are ``kept`` and each drop reason."""
    counts = {reason: 0 for reason in (KEPT, *DROP_REASONS)}
    for verdict in verdicts:
        counts[verdict] += 1
    return counts


def judged_metrics(verdicts: list[str], fillings: int) -> dict[str, float]:
    """Partial rollout's dynamic sampling (``dsrl.trainer.partial_rollout``): the verdicts of the groups this rank
    judged in a step, counted over all ranks, and the fillings of the pool (``train/num_gen_batches``). Collective."""
    counts = verdict_counts(verdicts)
    totals = torch.tensor([counts[reason] for reason in counts], dtype=torch.float64)
    dist.all_reduce(totals)
    summed = dict(zip(counts, totals.tolist(), strict=True))
    return {
        "train/num_gen_batches": fillings,
        "dynamic_sampling/groups_generated": sum(summed.values()),
        "dynamic_sampling/groups_informative": summed[KEPT],
        **{f"dynamic_sampling/dropped_{reason}": summed[reason] for reason in DROP_REASONS},
    }


def fill_batch(
    prompts: Batch,
    *,
    scored_round: Callable[[Batch, int], tuple[Batch, list[float], str | None]],
    next_prompts: Callable[[int], Batch],
    n_groups: int,
    max_rounds: int,
    log: Callable[[str], None],
) -> tuple[Batch, dict[str, float]]:
    """This rank's share of ``n_groups`` informative groups, and the metrics. Collective.

    ``scored_round(prompts, round)``: the round's generated and scored rows (``n`` per prompt, contiguous),
    their metric values, and a problem line or None; ``next_prompts(round)``: this rank's prompts of round
    ``round`` (drawn from the sampler); ``max_rounds`` <= 0: no limit. Raises ``ValueError`` on every rank
    when a rank's reward lacks the metric, or when ``max_rounds`` rounds give too few informative groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rounds = Rounds()
    while True:
        k = len(rounds.batches)
        batch, values, problem = scored_round(prompts, k)
        mine = [] if problem else group_verdicts(batch.group_ids.tolist(), values)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (mine, problem))
        problems = sorted({p for _, p in everyone if p})
        if problems:
            raise ValueError("; ".join(problems))
        rounds.batches.append(batch)
        rounds.verdicts.append([v for v, _ in everyone])
        informative = sum(v == KEPT for ranks in rounds.verdicts for groups in ranks for v in groups)
        if informative >= n_groups:
            break
        if 0 < max_rounds <= k + 1:
            raise ValueError(
                f"algorithm.filter_groups.max_num_gen_batches={max_rounds}: {k + 1} rounds of {len(prompts) * world} "
                f"prompts gave {informative} groups whose metric varies, fewer than data.train_batch_size={n_groups} "
                "(verl raises here too); the prompts are too easy or too hard for the model. Fix: raise "
                "max_num_gen_batches (0 = no limit, as verl), data.gen_batch_size or actor_rollout_ref.rollout.n, or "
                "change the data"
            )
        log(f"dynamic sampling: {informative} of {n_groups} groups after round {k + 1}; generating another round")
        prompts = next_prompts(k + 1)
    n = len(rounds.batches[0]) // len(prompts)  # responses per prompt
    shipped, width, rows = transfer_plan(kept_groups(rounds.verdicts, n_groups), world, rank, n)
    offsets = [sum(len(b) for b in rounds.batches[:k]) for k in range(len(rounds.batches))]
    index = [offsets[k] + p * n + t for k, p in shipped for t in range(n)]
    index += [0] * (width - len(index))  # padding rows, never taken
    everything = Batch.concat(rounds.batches)
    batch = take_global_rows(everything.select(torch.tensor(index)), rows)
    return batch, rounds.metrics(n_groups, len(prompts) * world)
