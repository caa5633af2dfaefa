"""On-policy distillation's loss: hand-computed cases of both forms, the clamp, metrics, split invariance,
the combination with the task's loss, errors."""

import math

import pytest
import torch

from dsrl.algorithms import combined_loss, distillation_loss

# 2 rows x 3 tokens; the mask has a hole at [0, 1] and [1, 2] is padding.
STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -2.0, -2.0]])
MASK = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
VALID = MASK.bool()


def k3(student: float, teacher: float) -> float:
    """exp(r) - r - 1 with r = log p_t - log p_s."""
    r = teacher - student
    return math.exp(r) - r - 1.0


# the valid tokens, row by row: k1 = s - t is 0.5, 0.0, 0.5, -1.0
K3_VALID = [k3(-1.0, -1.5), k3(-0.5, -0.5), k3(-0.2, -0.7), k3(-3.0, -2.0)]


def distill(student=STUDENT, teacher=TEACHER, mask=MASK, **options):
    """distillation_loss with the student's log-probs as a leaf: (loss, metrics, d loss / d log_probs)."""
    log_probs = student.clone().requires_grad_(True)
    options = {
        "loss_mode": "k3",
        "loss_max_clamp": None,
        "use_policy_gradient": False,
        "old_log_probs": None,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "loss_agg_mode": "token-mean",
        "num_tokens": int(mask.sum()),
        "num_seqs": mask.shape[0],
        **options,
    }
    loss, metrics = distillation_loss(log_probs, teacher, mask, **options)
    loss.backward()
    return loss.detach(), metrics, log_probs.grad


def test_supervised_k3_by_hand():
    loss, metrics, _ = distill()
    assert loss.item() == pytest.approx(sum(K3_VALID) / 4)
    assert metrics["distillation/loss"].item() == pytest.approx(sum(K3_VALID) / 4)
    assert metrics["distillation/abs_loss"].item() == pytest.approx(sum(K3_VALID) / 4)
    assert metrics["distillation/loss_min"].item() == 0.0  # [0, 2]: student and teacher agree
    assert metrics["distillation/loss_max"].item() == pytest.approx(K3_VALID[3])


def test_supervised_seq_mean_token_mean_and_global_normalisers():
    loss, *_ = distill(loss_agg_mode="seq-mean-token-mean")
    row_means = [(K3_VALID[0] + K3_VALID[1]) / 2, (K3_VALID[2] + K3_VALID[3]) / 2]
    assert loss.item() == pytest.approx(sum(row_means) / 2)
    # this micro-batch as half of a mini-batch: the normalisers are the mini-batch's
    loss, *_ = distill(loss_agg_mode="seq-mean-token-mean", num_seqs=4)
    assert loss.item() == pytest.approx(sum(row_means) / 4)
    loss, *_ = distill(num_tokens=8)
    assert loss.item() == pytest.approx(sum(K3_VALID) / 8)


def test_supervised_k3_gradient_depends_on_the_teacher():
    _, _, grad = distill()
    # d k3 / d log p_s = 1 - exp(log p_t - log p_s), over N = 4 tokens; none through the masked ones
    expected = (1.0 - torch.exp(TEACHER - STUDENT)) * MASK / 4
    torch.testing.assert_close(grad, expected)
    _, _, other_grad = distill(teacher=TEACHER - 1.0)
    assert not torch.allclose(grad[VALID], other_grad[VALID])


def test_clamp_bounds_the_loss_not_the_metrics():
    loss, metrics, grad = distill(loss_max_clamp=0.5)
    assert K3_VALID[3] > 0.5 > max(K3_VALID[:3])
    assert loss.item() == pytest.approx((sum(K3_VALID[:3]) + 0.5) / 4)
    assert metrics["distillation/loss_max"].item() == pytest.approx(K3_VALID[3])  # before the clamp
    assert metrics["distillation/abs_loss"].item() == pytest.approx(sum(K3_VALID) / 4)
    assert grad[1, 1].item() == 0.0  # the clamped token
    assert grad[1, 0].item() != 0.0


def test_clamp_bounds_negative_k1_from_below():
    # on-policy (ratio 1): the policy-gradient loss is the mean of -A = d' and its gradient d' / N
    loss, metrics, grad = distill(
        loss_mode="k1", loss_max_clamp=0.4, use_policy_gradient=True, old_log_probs=STUDENT.clone()
    )
    clamped = [0.4, 0.0, 0.4, -0.4]  # k1 = 0.5, 0.0, 0.5, -1.0
    assert loss.item() == pytest.approx(sum(clamped) / 4)
    assert metrics["distillation/loss_min"].item() == pytest.approx(-1.0)
    assert metrics["distillation/loss_max"].item() == pytest.approx(0.5)
    assert metrics["distillation/abs_loss"].item() == pytest.approx(2.0 / 4)
    torch.testing.assert_close(grad[VALID], torch.tensor(clamped) / 4)


def test_policy_gradient_advantages_are_the_negative_divergence_with_clipping():
    # every ratio is 1.5; k1 = 0.5, 0.0, 0.5, -1.0 gives A = -0.5, 0, -0.5, 1.0
    old = STUDENT - math.log(1.5)
    loss, metrics, grad = distill(loss_mode="k1", use_policy_gradient=True, old_log_probs=old)
    # A < 0: max(0.5 · 1.5, 0.5 · 1.2) = 0.75 (under the dual clip 0.5 · 3); A = 0: 0; A = 1: max(-1.5, -1.2) = -1.2
    assert loss.item() == pytest.approx((0.75 + 0.0 + 0.75 - 1.2) / 4)
    # -A r's gradient is -A r = 0.75 where unclipped; the clipped token has none
    torch.testing.assert_close(grad[VALID], torch.tensor([0.75, 0.0, 0.75, 0.0]) / 4)
    assert metrics["distillation/pg_clipfrac"].item() == pytest.approx(0.25)
    assert metrics["distillation/pg_clipfrac_lower"].item() == 0.0
    assert metrics["distillation/ppo_kl"].item() == pytest.approx(-math.log(1.5))
    assert metrics["distillation/loss"].item() == pytest.approx(loss.item())


def test_policy_gradient_dual_clip_is_three_and_weights_multiply():
    # ratio 4 on a negative advantage: the dual clip bounds -A r = 0.5 · 4 at 0.5 · 3
    old = STUDENT - math.log(4.0)
    weights = torch.tensor([[2.0, 9.0, 1.0], [1.0, 1.0, 9.0]])
    loss, metrics, _ = distill(
        loss_mode="k1", use_policy_gradient=True, old_log_probs=old, rollout_is_weights=weights, clip_ratio_high=0.28
    )
    assert loss.item() == pytest.approx((1.5 * 2.0 + 0.0 + 1.5 - 1.28) / 4)
    assert metrics["distillation/pg_clipfrac_lower"].item() == pytest.approx(0.5)


def test_metric_names_and_detached():
    supervised = {"distillation/abs_loss", "distillation/loss_min", "distillation/loss_max", "distillation/loss"}
    _, metrics, _ = distill()
    assert set(metrics) == supervised
    _, metrics, _ = distill(loss_mode="k1", use_policy_gradient=True, old_log_probs=STUDENT)
    pg = {"distillation/pg_clipfrac", "distillation/ppo_kl", "distillation/pg_clipfrac_lower"}
    assert set(metrics) == supervised | pg
    assert not any(value.requires_grad for value in metrics.values())


def test_micro_batch_without_response_tokens():
    loss, metrics, grad = distill(mask=torch.zeros(2, 3), num_tokens=4)
    assert loss.item() == 0.0
    assert metrics["distillation/abs_loss"].item() == 0.0
    assert metrics["distillation/loss_min"].item() == math.inf
    assert metrics["distillation/loss_max"].item() == -math.inf
    assert not grad.any()


@pytest.mark.parametrize("use_policy_gradient", [False, True])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_with_the_mini_batch_normalisers_sum_to_the_whole(use_policy_gradient, mode):
    gen = torch.Generator().manual_seed(0)
    student = -3.0 * torch.rand(6, 5, generator=gen)
    teacher = -3.0 * torch.rand(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) < 0.7).float()
    old = student + 0.3 * torch.randn(6, 5, generator=gen)
    options = dict(
        loss_mode="k1" if use_policy_gradient else "k3",
        loss_max_clamp=1.0,
        use_policy_gradient=use_policy_gradient,
        loss_agg_mode=mode,
        num_tokens=int(mask.sum()),
        num_seqs=6,
    )
    whole, _, whole_grad = distill(student, teacher, mask, old_log_probs=old, **options)
    halves = [
        distill(student[rows], teacher[rows], mask[rows], old_log_probs=old[rows], **options)
        for rows in (slice(0, 2), slice(2, 6))
    ]
    assert sum(loss for loss, *_ in halves).item() == pytest.approx(whole.item())
    torch.testing.assert_close(torch.cat([grad for *_, grad in halves]), whole_grad)


def test_combined_loss_keeps_or_drops_the_task_loss():
    task = torch.tensor(2.0, requires_grad=True)
    distilled = torch.tensor(3.0, requires_grad=True)
    assert combined_loss(task, distilled, use_task_rewards=True, coef=0.5).item() == pytest.approx(3.5)
    alone = combined_loss(task, distilled, use_task_rewards=False, coef=0.5)
    assert alone.item() == 3.0  # no coef without the task's loss
    alone.backward()
    assert task.grad is None
    assert distilled.grad.item() == 1.0


def test_policy_gradient_needs_old_log_probs():
    with pytest.raises(ValueError, match="needs old_log_probs"):
        distill(loss_mode="k1", use_policy_gradient=True)


def test_unknown_loss_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown KL kind 'k4'.*k3"):
        distill(loss_mode="k4")
