"""Step and validation metrics with verl 0.9's names and formulas.

``batch_metrics``, ``rollout_logprob_metrics`` and ``rollout_correction_metrics`` are collectives:
every rank calls them and gets the same numbers, taken over every rank's rows.
``validation_metrics`` and ``throughput_metrics`` are plain functions of their (already global)
arguments; ``memory_metrics`` reads this process.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import psutil
import torch
import torch.distributed as dist

from dsrl.algorithms import RolloutCorrection, kl_penalty
from dsrl.data.batch import Batch
from dsrl.engines.forward import PassTally
from dsrl.runtime.distributed import all_reduce, global_mean, global_stats

NAN = float("nan")
N_BOOTSTRAP = 1000  # verl's bootstrap samples per (prompt, variable, k)
VF_EXPLAINED_VAR_EPS = 1e-5  # verl's epsilon under var(returns)
GIB = 1024**3
# verl's compute_timing_metrics: gen per response token, these per prompt + response token.
_PHASES_PER_TOKEN = ("gen", "ref", "values", "adv", "update_critic", "update_actor")


# ---- reductions over ranks ------------------------------------------------------------------


def _stats(named: dict[str, torch.Tensor]) -> dict[str, tuple[float, float, float]]:
    """(mean, max, min) of each tensor's elements over every rank, in two collectives.

    A name no rank has elements for gets nans (verl's value for an empty selection)."""
    flat = [v.detach().reshape(-1).double() for v in named.values()]
    sums = all_reduce(torch.stack([torch.stack([v.sum(), v.new_tensor(v.numel())]) for v in flat]))
    ends = all_reduce(
        torch.stack([torch.stack([v.max(), -v.min()]) if v.numel() else v.new_full((2,), -math.inf) for v in flat]),
        "max",
    )
    return {
        name: (total / count, hi, -neg_lo) if count else (NAN, NAN, NAN)
        for name, (total, count), (hi, neg_lo) in zip(named, sums.tolist(), ends.tolist(), strict=True)
    }


def _moments(columns: torch.Tensor) -> tuple[int, list[float], torch.Tensor]:
    """Row count, column means and centred cross-product sums ``[k, k]`` of ``columns`` ``[n, k]``
    over every rank.

    Two passes (global means, then sums of centred products) so variances do not cancel the way
    one-pass sums of x and x² can; ``sums[i, i] / (n - 1)`` is the unbiased variance."""
    x = columns.detach().double()
    head = all_reduce(torch.cat([x.new_tensor([x.shape[0]]), x.sum(0)]))
    n = int(head[0])
    means = head[1:] / max(n, 1)
    centred = x - means
    return n, means.tolist(), all_reduce(centred.T @ centred).cpu()


def _unbiased_var(sum_sq: float, n: int) -> float:
    """``torch.var``'s default (ddof 1): nan below two elements."""
    return sum_sq / (n - 1) if n > 1 else NAN


# ---- step metrics ---------------------------------------------------------------------------


def batch_metrics(batch: Batch, *, max_prompt_length: int, max_response_length: int) -> dict[str, float]:
    """verl's ``compute_data_metrics`` over every rank's rows of one step's batch.

    Rows with an empty response count as aborted: verl leaves them out of ``critic/score``,
    ``critic/rewards`` and ``response_length_non_aborted``. Advantages, returns and values are taken
    over response tokens; a clip ratio is the fraction of rows whose length equals its maximum.
    """
    mask = batch.response_mask.bool()
    response_length = batch.response_attention.sum(-1).double()  # tool outputs included, as verl (its attention mask)
    prompt_length = batch.prompt_mask.sum(-1).double()
    finished = response_length > 0
    triples = {
        "critic/score": batch.token_level_scores.sum(-1)[finished],
        "critic/rewards": batch.token_level_rewards.sum(-1)[finished],
        "critic/advantages": batch.advantages[mask],
        "critic/returns": batch.returns[mask],
        "response_length": response_length,
        "response_length_non_aborted": response_length[finished],
        "prompt_length": prompt_length,
    }
    if batch.values is not None:
        triples["critic/values"] = batch.values[mask]
    ratios = {
        "response_length/clip_ratio": (response_length == max_response_length).double(),
        "response_length_non_aborted/clip_ratio": (response_length[finished] == max_response_length).double(),
        "response/aborted_ratio": (~finished).double(),
        "prompt_length/clip_ratio": (prompt_length == max_prompt_length).double(),
    }
    stats = _stats(triples | ratios)
    metrics = {name: stats[name][0] for name in ratios}
    for name in triples:
        metrics[f"{name}/mean"], metrics[f"{name}/max"], metrics[f"{name}/min"] = stats[name]
    if batch.values is not None:
        returns = batch.returns[mask]
        n, _, sums = _moments(torch.stack([returns - batch.values[mask], returns], dim=-1))
        residual_var, returns_var = (_unbiased_var(sums[i, i].item(), n) for i in (0, 1))
        metrics["critic/vf_explained_var"] = 1.0 - residual_var / (returns_var + VF_EXPLAINED_VAR_EPS) if n else NAN
    return metrics


def rollout_logprob_metrics(batch: Batch, version: int | None = None) -> dict[str, float]:
    """verl's rollout-vs-actor check (``calculate_debug_metrics``) over every rank's response tokens; with partial
    rollout (``batch.rollout_versions``) over those the actor's current weights (``version``) sampled, since an older
    version's differ by design.

    In probability space: statistics of ``|exp(old_log_probs) - exp(rollout_log_probs)|`` (std
    unbiased) and the Pearson correlation of the two probabilities. ``..._valid`` is 0, and the rest
    nan, when no rank has a response token.
    """
    mask = batch.response_mask.bool()
    if batch.rollout_versions is not None:
        if version is None:
            raise ValueError("rollout_logprob_metrics: a batch of partial rollouts needs the current version")
        mask &= batch.rollout_versions == version
    actor, rollout = batch.old_log_probs[mask].exp(), batch.rollout_log_probs[mask].exp()
    diff = (actor - rollout).abs()
    n, means, sums = _moments(torch.stack([diff, actor, rollout], dim=-1))
    if n == 0:
        names = ("max", "mean", "std")
        return {"training/rollout_probs_diff_valid": 0.0, "training/rollout_actor_probs_pearson_corr": NAN} | {
            f"training/rollout_probs_diff_{name}": NAN for name in names
        }
    local_max = diff.max().double() if diff.numel() else diff.new_tensor(-math.inf, dtype=torch.float64)
    spread = math.sqrt(sums[1, 1].item() * sums[2, 2].item())
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": all_reduce(local_max, "max").item(),
        "training/rollout_probs_diff_mean": means[0],
        "training/rollout_probs_diff_std": math.sqrt(_unbiased_var(sums[0, 0].item(), n)),
        # torch.corrcoef: clipped to [-1, 1], nan when either side is constant
        "training/rollout_actor_probs_pearson_corr": (
            min(1.0, max(-1.0, sums[1, 2].item() / spread)) if spread > 0 else NAN
        ),
    }


def rollout_correction_metrics(batch: Batch, correction: RolloutCorrection) -> dict[str, float]:
    """Importance ratios rollout -> actor over the response tokens, whether or not they are applied."""
    mask = batch.response_mask.bool()
    mean, hi, lo = global_stats(correction.ratio[mask])
    return {
        "rollout_corr/is_ratio_mean": mean,
        "rollout_corr/is_ratio_max": hi,
        "rollout_corr/is_ratio_min": lo,
        "rollout_corr/is_weight_mean": global_mean(correction.weights[mask]),
        "rollout_corr/masked_fraction": global_mean(1.0 - correction.keep_mask[mask]),
    }


def distillation_metrics(batch: Batch, loss_mode: str) -> dict[str, float]:
    """On-policy distillation over every rank's response tokens, under the policy that sampled them (the actor's
    log-probs before the update): ``distillation/reverse_kl``, the mean of ``log p_student - log p_teacher`` (the
    sampled tokens' estimate of KL(student || teacher)), and verl's ``distillation/loss_min`` and ``loss_max``, the
    extremes of ``loss_mode``'s per-token divergence (verl's are its micro-batches', under the current policy)."""
    valid = batch.response_mask.bool()
    k1 = (batch.old_log_probs - batch.teacher_log_probs)[valid]
    divergence = kl_penalty(batch.old_log_probs, batch.teacher_log_probs, loss_mode)[valid]
    mean, _, _ = global_stats(k1)
    _, highest, lowest = global_stats(divergence)
    return {"distillation/reverse_kl": mean, "distillation/loss_max": highest, "distillation/loss_min": lowest}


def variance_proxy_metrics(batch: Batch, grad_norm: float | None) -> dict[str, float]:
    """verl's ``variance_proxy/*`` (the OTB guide's gradient-variance gauges), over every rank's rows.

    Per response, ``W = sum_t (1 - 2 pi_t + sum_v pi_v^2)`` (scaled by the squared rollout IS weight
    where one applies) and ``A`` = the mean advantage over its tokens. Total power is
    ``mean(A^2 max(W, 0))`` (off-policy: ``mean(rho^2 A^2 max(W/rho^2, 0))`` with rho the response's
    mean IS weight), signal strength the actor's ``grad_norm^2``, and pure noise
    ``max(0, (power - signal) / (N - 1))``. Only with ``sum_pi_squared`` (OTB, or
    ``actor.calculate_sum_pi_squared``); a collective."""
    if batch.sum_pi_squared is None or batch.advantages is None:
        return {}
    mask = batch.response_mask.float()
    w_token = 1 - 2 * batch.old_log_probs.exp() + batch.sum_pi_squared
    tokens = mask.sum(-1)
    advantage = (batch.advantages * mask).sum(-1) / (tokens + 1e-8)  # verl's masked_mean
    if batch.rollout_is_weights is None:
        w = (w_token * mask).sum(-1)
        power = advantage**2 * w.clamp(min=0)
    else:
        weights = batch.rollout_is_weights
        w = (w_token * weights**2 * mask).sum(-1)
        rho = (weights * mask).sum(-1) / (tokens + 1e-8)
        w_unweighted = (w_token * weights**2 / (weights**2).clamp(min=1e-10) * mask).sum(-1)
        power = rho**2 * advantage**2 * w_unweighted.clamp(min=0)
    n, (power_mean, a_squared_mean, w_mean), _ = _moments(torch.stack([power, advantage**2, w], dim=1))
    signal = grad_norm**2 if grad_norm is not None else None
    noise = max(0.0, (power_mean - signal) / (n - 1)) if signal is not None and n > 1 else 0.0
    return {
        "variance_proxy/proxy1_signal_strength": signal if signal is not None else 0.0,
        "variance_proxy/proxy2_total_power": power_mean,
        "variance_proxy/proxy3_pure_noise": noise,
        "variance_proxy/expected_a_squared": a_squared_mean,
        "variance_proxy/expected_w": w_mean,
    }


def throughput_metrics(
    timing_s: Mapping[str, float], *, num_prompt_tokens: int, num_response_tokens: int, world_size: int
) -> dict[str, float]:
    """verl's ``compute_throughout_metrics`` and ``compute_timing_metrics`` for one step.

    ``timing_s`` holds ``timing_s/<phase>`` seconds (``timing_s/step`` required); token counts are
    the whole step's over all ranks. Throughput is tokens per second per rank. Per-token times (ms)
    exist only for verl's phases: ``gen`` per response token, ``ref``, ``values``, ``adv``,
    ``update_critic``, ``update_actor`` per prompt + response token (0 when there are no tokens).
    """
    total = num_prompt_tokens + num_response_tokens
    step = timing_s["timing_s/step"]
    metrics = {"perf/total_num_tokens": total, "perf/time_per_step": step}
    metrics["perf/throughput"] = total / (step * world_size)
    for phase in _PHASES_PER_TOKEN:
        seconds = timing_s.get(f"timing_s/{phase}")
        if seconds is not None:
            tokens = num_response_tokens if phase == "gen" else total
            metrics[f"timing_per_token_ms/{phase}"] = seconds * 1000 / tokens if tokens > 0 else 0.0
    return metrics


def forward_metrics(tallies: Mapping[str, PassTally]) -> dict[str, float]:
    """What the step's model forwards ran (``tallies``: per pass, as the engines counted them), over all ranks:
    ``perf/padding_ratio``, the padding share of their input positions; ``perf/dedup_ratio``, the share of the
    rows' own tokens that running a prompt once per micro-batch saved (``use_prefix_grouper``,
    ``shared_prompt_forward``); ``perf/micro_batches/<pass>``, forwards per rank (every rank runs as many); with
    routing replay, ``moe/route_agreement/<pass>``, the share of the recorded experts (R3: the rollout's, R2: the
    old-log-prob pass's) that the pass's routers chose by themselves. Collective."""
    totals = [sum(getattr(t, field) for t in tallies.values()) for field in ("positions", "tokens", "sequence_tokens")]
    names = sorted(tallies)
    routes = [float(getattr(tallies[name], field)) for name in names for field in ("routes_agreed", "routes_compared")]
    reduced = all_reduce(torch.tensor(totals + routes, dtype=torch.float64)).tolist()
    positions, tokens, own = reduced[:3]
    metrics = {f"perf/micro_batches/{name}": float(tallies[name].micro_batches) for name in names}
    metrics["perf/padding_ratio"] = 1 - tokens / positions if positions else 0.0
    metrics["perf/dedup_ratio"] = 1 - tokens / own if own else 0.0
    for name, agreed, compared in zip(names, reduced[3::2], reduced[4::2], strict=True):
        if compared:
            metrics[f"moe/route_agreement/{name}"] = agreed / compared
    return metrics


def memory_metrics() -> dict[str, float]:
    """The memory gauges verl's training engine logs with each update, in GiB.

    This process's peak CUDA memory since the last call, i.e. the step's peak (only when CUDA is
    available; the peak is reset after reading it), and the host's used RAM as
    ``psutil.virtual_memory().used`` reports it.
    """
    metrics = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / GIB}
    if torch.cuda.is_available():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GIB
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GIB
        torch.cuda.reset_peak_memory_stats()  # else every later step would report the run's peak so far
    return metrics


# ---- validation -----------------------------------------------------------------------------


def _bootstrap_sizes(n: int) -> list[int]:
    """verl's subset sizes for ``n`` responses: the powers of two below ``n``, then ``n`` (none for one)."""
    if n <= 1:
        return []
    sizes = [2**e for e in range(1, n.bit_length()) if 2**e < n]
    return sizes + [n]


@lru_cache(maxsize=256)
def _bootstrap_indices(n: int, k: int, seed: int) -> np.ndarray:
    """``[N_BOOTSTRAP, k]`` draws with replacement from ``range(n)``.

    verl reseeds numpy's legacy global generator with ``seed`` before each bootstrap, so its draws
    depend only on ``(n, k, seed)``; a private ``RandomState`` gives the same ones without touching
    the global generator."""
    indices = np.random.RandomState(seed).choice(n, size=(N_BOOTSTRAP, k), replace=True)
    indices.flags.writeable = False
    return indices


def _majority_values(values: np.ndarray, votes: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Per sample (row of ``indices``): the value of the first response giving the most common vote.

    Ties go to the vote seen first in the sample, as in verl's ``calc_maj_val``; ``votes`` are small
    integer codes of the responses' predictions."""
    samples = indices.shape[0]
    rows = np.arange(samples)[:, None]
    sample_votes = votes[indices]
    counts = np.zeros((samples, int(votes.max()) + 1), dtype=np.int64)
    np.add.at(counts, (rows, sample_votes), 1)
    # The first position holding a most common vote is that vote's first response, and its vote is
    # the earliest seen of the most common ones.
    winners = counts[rows, sample_votes].argmax(axis=1)
    return values[indices[np.arange(samples), winners]]


def _prompt_metrics(values: np.ndarray, votes: np.ndarray | None, seed: int) -> dict[str, float]:
    """One prompt's N responses: ``mean@N``, and for N > 1 ``std@N`` (population) and bootstrap
    ``best|worst|maj@k/mean|std`` for each of verl's sizes k."""
    n = len(values)
    metrics = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return metrics
    metrics[f"std@{n}"] = float(np.std(values))
    for k in _bootstrap_sizes(n):
        indices = _bootstrap_indices(n, k, seed)
        samples = values[indices]
        draws = {"best": samples.max(axis=1), "worst": samples.min(axis=1)}
        if votes is not None:
            draws["maj"] = _majority_values(values, votes, indices)
        for name, drawn in draws.items():
            metrics[f"{name}@{k}/mean"], metrics[f"{name}@{k}/std"] = float(np.mean(drawn)), float(np.std(drawn))
    return metrics


def _vote_codes(preds: Sequence[Hashable]) -> np.ndarray:
    """Integer codes of predictions, equal where the predictions are (dict equality, as verl votes)."""
    codes: dict[Hashable, int] = {}
    return np.array([codes.setdefault(pred, len(codes)) for pred in preds], dtype=np.int64)


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Hashable],
    variables: Mapping[str, Sequence[float]],
    preds: Sequence[Hashable] | None = None,
    *,
    seed: int = 42,
) -> dict[str, float]:
    """verl's validation metrics (``process_validation_metrics`` named as ``_validate`` names them).

    One entry per response in every argument. Responses are grouped by data source and prompt
    (``uids``); per prompt of N responses and per variable (``reward``, ``acc``, other numeric
    extras) come ``mean@N``, and for N > 1 ``std@N`` and bootstrap ``best@k``/``worst@k``
    (``maj@k`` too, voting on ``preds``, when given) ``/mean`` and ``/std``; each is then averaged
    over the prompts of the data source that have it. Bootstrap draws follow response order, so pass
    responses in dataset order to reproduce verl's numbers.

    Names are ``<section>/<data_source>/<variable>/<metric>``: section ``val-core`` for the core
    variable (``acc`` when given, else ``reward``) on ``mean``, ``maj`` and ``best`` metrics at the
    data source's largest N (their ``/std`` included, as in verl), ``val-aux`` for all else.
    """
    groups: dict[str, dict[Hashable, list[int]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups.setdefault(source, {}).setdefault(uid, []).append(i)
    columns = {name: np.asarray(values, dtype=np.float64) for name, values in variables.items()}
    core_variable = "acc" if "acc" in columns else "reward"
    metrics: dict[str, float] = {}
    for source, prompts in groups.items():
        per_prompt: dict[str, dict[str, list[float]]] = {name: {} for name in columns}
        for rows in prompts.values():
            votes = None if preds is None else _vote_codes([preds[i] for i in rows])
            for name, column in columns.items():
                for metric, value in _prompt_metrics(column[rows], votes, seed).items():
                    per_prompt[name].setdefault(metric, []).append(value)
        for name, by_metric in per_prompt.items():
            sizes = {metric: int(metric.split("/")[0].split("@")[1]) for metric in by_metric}
            largest = max(sizes.values(), default=0)
            for metric, values in by_metric.items():
                core = name == core_variable and metric.startswith(("mean", "maj", "best")) and sizes[metric] == largest
                metrics[f"{'val-core' if core else 'val-aux'}/{source}/{name}/{metric}"] = float(np.mean(values))
    return metrics


def reward_metrics(counts: Mapping[str, float], extras: Mapping[str, list[float]]) -> dict[str, float]:
    """A step's reward metrics over all ranks (collectives): the scorer's failure ``counts`` summed, and
    ``reward/<name>/mean`` of each numeric extra over the rows, on any rank, that returned it (``extras``:
    this rank's values by name, as ``dsrl.rewards.numeric_extras`` gives them)."""
    names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(names, sorted(extras))
    extra_names = sorted({name for part in names for name in part})
    sums = [sum(extras.get(name, [])) for name in extra_names]
    sizes = [len(extras.get(name, [])) for name in extra_names]
    totals = all_reduce(
        torch.tensor([float(v) for v in [*counts.values(), *sums, *sizes]], dtype=torch.float64)
    ).tolist()
    metrics = dict(zip(counts, totals, strict=False))  # the counts' totals come first
    k = len(extra_names)
    for name, total, size in zip(
        extra_names, totals[len(counts) : len(counts) + k], totals[len(counts) + k :], strict=True
    ):
        metrics[f"reward/{name}/mean"] = total / size
    return metrics


def multi_turn_metrics(stats) -> dict[str, float]:
    """Multi-turn rollouts over every rank's conversations since the last count (``stats``: the rollout's
    ``MultiTurnRollout.take_stats``): turns and tool calls per response (mean, max), the shares ended by the turn
    limit and by the length budget, tool calls by tool and failures by kind (counts), the prompt tokens of the turns
    after the first and those the rollout's prefix cache served (counts: ``multi_turn/later_turns/``); and this
    rank's own ``timing_s/tool_calls``, its calls' summed seconds, and ``timing_s/gen_turn_max``, its longest turn
    of generation (rank-local timings, as the other ``timing_s/``)."""
    turns = torch.tensor(stats.turns, dtype=torch.float64)
    calls = torch.tensor(stats.calls_per_row, dtype=torch.float64)
    turns_mean, turns_max, _ = global_stats(turns)
    calls_mean, calls_max, _ = global_stats(calls)
    counts = {f"tool/calls/{name}": count for name, count in stats.calls.items()}
    counts |= {f"tool/fail_{kind}": count for kind, count in stats.failures.items()}
    counts["multi_turn/later_turns/prompt_tokens"] = stats.later_prompt_tokens
    counts["multi_turn/later_turns/prefix_cached_tokens"] = stats.later_cached_tokens
    counts["rows"] = len(stats.turns)
    counts |= {f"stop/{reason}": count for reason, count in stats.stops.items()}
    totals = dict(
        zip(counts, all_reduce(torch.tensor(list(counts.values()), dtype=torch.float64)).tolist(), strict=True)
    )
    rows = max(totals.pop("rows"), 1.0)
    return {
        "multi_turn/turns_per_response/mean": turns_mean,
        "multi_turn/turns_per_response/max": turns_max,
        "multi_turn/calls_per_response/mean": calls_mean,
        "multi_turn/calls_per_response/max": calls_max,
        "multi_turn/stopped_by_turn_limit": totals.pop("stop/turn_limit") / rows,
        "multi_turn/stopped_by_length": totals.pop("stop/length") / rows,
        "multi_turn/answered": totals.pop("stop/answered") / rows,
        "timing_s/tool_calls": stats.seconds,
        "timing_s/gen_turn_max": max(stats.turn_seconds, default=0.0),
    } | totals
