"""dsrl's on-policy distillation loss gives verl 0.9.1's numbers: `distillation_loss` against verl's
`distillation_loss` (its single-sample estimators), and `combined_loss` over the task's vanilla policy loss
against verl's `distillation_ppo_loss`: loss, gradient with respect to the student's log-probs, and the
`distillation/*` metrics.

verl's inputs are built as its FSDP engine holds them: the model's log-probs and the teacher's (top-1)
log-probs as jagged nested tensors over each row's prompt and response tokens (the log-prob of response token
j at position prompt_len + j - 1), left-padded prompts, right-padded responses, an attention mask over both;
the response mask, old log-probs, advantages and rollout IS weights padded `[B, T]`; `dp_size`,
`batch_num_tokens` and `global_batch_size` as non-tensor data.

The batch has a fully padded row, a one-token response, holes in the response mask (seed 1), student-teacher
gaps up to ±8 (past the clamp, and k3's own bound of 10) and student-old gaps of ±2 (ratios past the clip and
the dual clip). Tolerance: float32, `rtol = atol = 1e-6`.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.distillation import losses as verl_distillation
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig

from dsrl.algorithms import combined_loss, distillation_loss, policy_loss
from tests.verl.verl_calls import assert_close

TOL = 1e-6
B, P, T = 8, 4, 6
EMPTY_ROW, ONE_TOKEN_ROW = 3, 5
LOSS_MODES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
# verl's DistillationLossConfig refuses k1 backpropagated directly (its gradient ignores the teacher), as dsrl's
# config does.
REFUSED_SUPERVISED = ("k1", "kl")
# The actor's own clip settings, which verl's distillation policy gradient does not read (its clip_ratio_c is 3).
ACTOR_CLIP = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.4, "clip_ratio_c": 10.0}
# verl's distillation clip settings and the (low, high) they resolve to: a null bound takes clip_ratio.
CLIPS = [
    ({}, (0.2, 0.2)),
    ({"clip_ratio": 0.15, "clip_ratio_low": None, "clip_ratio_high": 0.28}, (0.15, 0.28)),
]
TASK_COEF = 0.7


close = partial(assert_close, tol=TOL)  # (dsrl value, verl value, what)


@dataclasses.dataclass
class Batch:
    """`[B, T]` float32 response tensors and `[B]` prompt / response lengths."""

    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    teacher_log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    rollout_is_weights: torch.Tensor


def make_batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, P + 1, (B,), generator=gen)
    response_lengths = torch.randint(1, T + 1, (B,), generator=gen)
    response_lengths[0], response_lengths[EMPTY_ROW], response_lengths[ONE_TOKEN_ROW] = T, 0, 1
    inside = torch.arange(T) < response_lengths[:, None]
    mask = inside.float()
    if seed == 1:  # observation tokens inside responses: in the attention mask, out of the loss
        mask[(torch.rand(B, T, generator=gen) < 0.25) & inside] = 0.0
        mask[0, 0] = 1.0
    log_probs = -3.0 * torch.rand(B, T, generator=gen)
    teacher = log_probs + torch.randn(B, T, generator=gen)
    teacher[0, 0], teacher[0, 1] = log_probs[0, 0] - 8.0, log_probs[0, 1] + 8.0
    old = log_probs + 0.3 * torch.randn(B, T, generator=gen)
    old[0, 2], old[0, 3] = log_probs[0, 2] - 2.0, log_probs[0, 3] + 2.0
    return Batch(
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        response_mask=mask,
        log_probs=log_probs,
        teacher_log_probs=teacher,
        old_log_probs=old,
        advantages=torch.randn(B, T, generator=gen) * mask,
        rollout_is_weights=2.0 * torch.rand(B, T, generator=gen) * mask,
    )


def nested(response_values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """`[B, T]` response values as verl's engine holds per-token model outputs: a jagged `[B, j]` tensor over
    each row's prompt and response, token j's value at prompt_len + j - 1 (the rest 0)."""
    rows = []
    for values, prompt_length, response_length in zip(
        response_values, batch.prompt_lengths.tolist(), batch.response_lengths.tolist(), strict=True
    ):
        pad = values.new_zeros
        rows.append(torch.cat([pad(prompt_length - 1), values[:response_length], pad(1)]))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def verl_data(batch: Batch, *, is_weights: bool, global_batch_info: dict) -> TensorDict:
    prompt_mask = torch.arange(P) >= P - batch.prompt_lengths[:, None]  # left-padded
    response_attention = torch.arange(T) < batch.response_lengths[:, None]
    fields = {
        "prompts": torch.zeros(B, P, dtype=torch.long),
        "responses": torch.zeros(B, T, dtype=torch.long),
        "attention_mask": torch.cat([prompt_mask, response_attention], dim=-1).long(),
        "response_mask": batch.response_mask,
        "teacher_logprobs": nested(batch.teacher_log_probs, batch).unsqueeze(-1),  # top-1: [B, j, 1]
        "old_log_probs": batch.old_log_probs,
        "advantages": batch.advantages,
    }
    if is_weights:
        fields["rollout_is_weights"] = batch.rollout_is_weights
    data = TensorDict(fields, batch_size=[B])
    tu.assign_non_tensor(
        data, **{"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, **global_batch_info}
    )
    return data


def normalisers(batch: Batch, kind: str) -> tuple[dict, dict]:
    """(dsrl's num_tokens / num_seqs, verl's global batch info): this micro-batch's counts (verl: none given),
    or those of a mini-batch it is one micro-batch of."""
    num_tokens, num_seqs = int(batch.response_mask.sum()), int((batch.response_mask.sum(-1) > 0).sum())
    if kind == "local":
        return {"num_tokens": num_tokens, "num_seqs": num_seqs}, {}
    return (
        {"num_tokens": num_tokens + 9, "num_seqs": B + 5},
        {"batch_num_tokens": num_tokens + 9, "global_batch_size": B + 5},
    )


def metric_value(metric: Metric | float) -> float:
    return metric.aggregate() if isinstance(metric, Metric) else metric


CASES = [
    pytest.param(
        loss_mode,
        use_pg,
        clamp,
        clip,
        resolved,
        agg_mode,
        norm,
        is_weights,
        seed,
        id=f"{loss_mode}-{'pg' if use_pg else 'supervised'}-clamp={clamp}-clip={resolved[0]}_{resolved[1]}"
        f"-{agg_mode}-{norm}-{'is' if is_weights else 'nois'}-s{seed}",
    )
    for loss_mode in LOSS_MODES
    for use_pg in (False, True)
    if use_pg or loss_mode not in REFUSED_SUPERVISED
    for clamp in (None, 0.5)
    for clip, resolved in (CLIPS if use_pg else CLIPS[:1])
    for agg_mode in ("token-mean", "seq-mean-token-mean")
    for norm in ("local", "global")
    for is_weights in (False, True)
    for seed in (0, 1)
]


@pytest.mark.parametrize(
    ("loss_mode", "use_pg", "clamp", "clip", "resolved", "agg_mode", "norm", "is_weights", "seed"), CASES
)
def test_distillation_loss_matches_verl(loss_mode, use_pg, clamp, clip, resolved, agg_mode, norm, is_weights, seed):
    batch = make_batch(seed)
    dsrl_norm, global_batch_info = normalisers(batch, norm)
    settings = {"loss_mode": loss_mode, "use_policy_gradient": use_pg, "loss_max_clamp": clamp, **clip}
    verl_settings = DistillationLossConfig(**settings)

    log_probs = batch.log_probs.clone().requires_grad_(True)
    loss, metrics = distillation_loss(
        log_probs,
        batch.teacher_log_probs,
        batch.response_mask,
        loss_mode=loss_mode,
        loss_max_clamp=clamp,
        use_policy_gradient=use_pg,
        old_log_probs=batch.old_log_probs,
        clip_ratio_low=resolved[0],
        clip_ratio_high=resolved[1],
        loss_agg_mode=agg_mode,
        rollout_is_weights=batch.rollout_is_weights if is_weights else None,
        **dsrl_norm,
    )
    (grad,) = torch.autograd.grad(loss, log_probs)

    verl_log_probs = batch.log_probs.clone().requires_grad_(True)
    actor = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg_mode, **ACTOR_CLIP
    )
    verl_loss, verl_metrics = verl_distillation.distillation_loss(
        actor,
        DistillationConfig(distillation_loss=verl_settings),
        {"log_probs": nested(verl_log_probs, batch)},
        verl_data(batch, is_weights=is_weights, global_batch_info=global_batch_info),
    )
    (verl_grad,) = torch.autograd.grad(verl_loss, verl_log_probs)

    what = f"distillation loss {loss_mode}"
    close(loss, verl_loss, what)
    close(grad, verl_grad, f"{what}: d loss / d log_probs")
    # verl's distillation_loss leaves distillation/loss to distillation_ppo_loss (compared below)
    assert set(metrics) - {"distillation/loss"} == set(verl_metrics), f"{what}: metric names"
    for name, value in verl_metrics.items():
        close(metrics[name], metric_value(value), f"{what}: metric {name}")


COMBINED_CASES = [
    pytest.param(
        loss_mode, use_pg, use_task, seed, id=f"{loss_mode}-{'pg' if use_pg else 'supervised'}-task={use_task}-s{seed}"
    )
    for loss_mode, use_pg in (("k3", False), ("k1", True), ("k3", True))
    for use_task in (False, True)
    for seed in (0, 1)
]


@pytest.mark.parametrize(("loss_mode", "use_pg", "use_task", "seed"), COMBINED_CASES)
def test_combined_loss_matches_verl_distillation_ppo_loss(loss_mode, use_pg, use_task, seed):
    """The task's loss is the vanilla policy loss on the batch's advantages (no entropy or KL term)."""
    batch = make_batch(seed)
    dsrl_norm, global_batch_info = normalisers(batch, "global")
    weights = batch.rollout_is_weights
    settings = DistillationLossConfig(
        loss_mode=loss_mode,
        use_policy_gradient=use_pg,
        use_task_rewards=use_task,
        distillation_loss_coef=TASK_COEF,
        loss_max_clamp=0.5,
    )

    log_probs = batch.log_probs.clone().requires_grad_(True)
    distilled, metrics = distillation_loss(
        log_probs,
        batch.teacher_log_probs,
        batch.response_mask,
        loss_mode=loss_mode,
        loss_max_clamp=0.5,
        use_policy_gradient=use_pg,
        old_log_probs=batch.old_log_probs,
        clip_ratio_low=settings.clip_ratio_low,
        clip_ratio_high=settings.clip_ratio_high,
        loss_agg_mode="token-mean",
        rollout_is_weights=weights,
        **dsrl_norm,
    )
    task_loss, _ = policy_loss(
        "vanilla",
        old_log_probs=batch.old_log_probs,
        log_probs=log_probs,
        advantages=batch.advantages,
        response_mask=batch.response_mask,
        rollout_is_weights=weights,
        **ACTOR_CLIP,
        **dsrl_norm,
    )
    total = combined_loss(task_loss, distilled, use_task_rewards=use_task, coef=TASK_COEF)
    (grad,) = torch.autograd.grad(total, log_probs)

    verl_log_probs = batch.log_probs.clone().requires_grad_(True)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **ACTOR_CLIP)
    verl_total, verl_metrics = verl_distillation.distillation_ppo_loss(
        actor,
        DistillationConfig(distillation_loss=settings),
        {"log_probs": nested(verl_log_probs, batch)},
        verl_data(batch, is_weights=True, global_batch_info=global_batch_info),
    )
    (verl_grad,) = torch.autograd.grad(verl_total, verl_log_probs)

    close(total, verl_total, "combined loss")
    close(grad, verl_grad, "combined loss: d loss / d log_probs")
    distillation_names = {name for name in verl_metrics if name.startswith("distillation/")}
    assert set(metrics) == distillation_names, "distillation metric names"
    close(metrics["distillation/loss"], metric_value(verl_metrics["distillation/loss"]), "metric distillation/loss")
