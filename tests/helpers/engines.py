"""What the engine tests share: a batch of varied lengths with a mask hole, a training batch built from an
actor's own log-probs, full-parameter snapshots and their comparisons, the training settings of actor and critic,
and the lr of each step under a schedule."""

from __future__ import annotations

import math

import torch

from dsrl.data.batch import Batch
from dsrl.engines import ActorEngine
from dsrl.engines.weight_sync import iter_full_parameters

N_PROMPTS, N, P, T = 2, 4, 6, 8  # 8 sequences; prompts up to 6 tokens, responses up to 8
TEMPERATURE = 0.7
BUDGET = 30  # tokens per micro-batch with use_dynamic_bsz: 2-3 sequences of <= 14 tokens


def make_batch(seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of varied lengths; one response has a
    mask hole (a multi-turn observation token) and one is a single token."""
    g = torch.Generator().manual_seed(seed)
    B = N_PROMPTS * N
    group = torch.arange(N_PROMPTS).repeat_interleave(N)
    prompt_len = torch.tensor([6, 3])[group]
    response_len = torch.tensor([8, 5, 1, 7, 3, 8, 6, 2])
    prompt_ids = torch.randint(3, 100, (N_PROMPTS, P), generator=g)[group]
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    response_mask = (torch.arange(T) < response_len[:, None]).long()
    response_mask[0, 3] = 0
    response_ids = torch.randint(3, 100, (B, T), generator=g) * response_mask
    return Batch(
        prompt_ids=prompt_ids * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=group,
    )


def in_context(batch: Batch) -> Batch:
    """``batch`` with its masked response tokens before a row's last token kept in the context (a tool output's
    tokens, as multi-turn rows have them), so that every response token has the same context packed
    (``use_remove_padding``, which drops tokens out of the context) and padded."""
    last = batch.response_mask.cumsum(1).argmax(1)
    attended = torch.arange(batch.response_mask.shape[1]) <= last[:, None]
    return batch.replace(response_attention_mask=attended.long())


def context_batch(seed: int = 0) -> Batch:
    return in_context(make_batch(seed))


def group_batch(seed: int = 0) -> Batch:
    """3 prompts (one left-padded, one of a single token) x 4 responses of varied lengths, one with a
    mask hole; rows of a prompt are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    P, T = 6, 5
    prompt_len = torch.tensor([6, 3, 1])
    prompts = torch.randint(3, 100, (3, P), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    rows = torch.tensor([0, 1, 2, 0, 1, 2, 2, 0, 1, 0, 2, 1])
    response_len = torch.randint(1, T + 1, (len(rows),), generator=g)
    response_mask = (torch.arange(T) < response_len[:, None]).long()
    response_mask[3, 1] = 0
    return Batch(
        prompt_ids=(prompts * prompt_mask)[rows],
        prompt_mask=prompt_mask[rows],
        response_ids=torch.randint(3, 100, (len(rows), T), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=rows,
    )


def training_batch(actor: ActorEngine) -> Batch:
    """``make_batch`` with old log-probs slightly off the actor's (so ratios move and clip),
    advantages, returns, a reference and rollout IS weights."""
    batch = make_batch()
    g = torch.Generator().manual_seed(1)
    mask = batch.response_mask.float()
    old = actor.compute_log_probs(batch, temperature=TEMPERATURE)["old_log_probs"]

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(old.shape, generator=g) * mask

    return batch.replace(
        old_log_probs=old + noise(0.3),
        ref_log_probs=old + noise(0.5),
        advantages=noise(1.0),
        returns=noise(1.0),
        rollout_is_weights=(1.0 + noise(0.1)).clamp(min=0),
    )


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(iter_full_parameters(module))


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, worst


def assert_same_metrics(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert math.isclose(value, b[key], rel_tol=1e-5, abs_tol=1e-6), (key, value, b[key])


ACTOR_TRAINING = (
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # 2 mini-batches of 4 sequences
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.optim.lr=0.01",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.grad_clip=100.0",  # no clipping: it would hide a wrongly scaled gradient
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
)
CRITIC_TRAINING = (
    "actor_rollout_ref.rollout.n=4",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_epochs=2",
    "critic.optim.lr=0.01",
    "critic.optim.weight_decay=0.0",
    "critic.grad_clip=100.0",
    "critic.cliprange_value=0.2",
    f"critic.ppo_max_token_len_per_gpu={BUDGET}",
)


def stepped(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    """The lr of each of ``steps`` training steps under ``scheduler``."""
    optimizer = scheduler.optimizer
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen
