"""actor/grad_var measured by an actor under ZeRO-3 + CPU offload, on mini-batches built so that its value is
known exactly: two micro-batches holding the same rows (each estimates G exactly: no variance, and the hooks'
norms must agree with DeepSpeed's global gradient norm for that), then the same rows with the second
micro-batch's advantages negated (G = 0 and h_2 = -h_1: a variance of 2 ||h||^2, ||h|| the first update's norm)."""

from __future__ import annotations

import pytest
import torch

from dsrl.data.batch import Batch
from dsrl.engines import ActorEngine

pytestmark = pytest.mark.e2e

TEMPERATURE = 1.0


def rows_twice() -> Batch:
    """Two sequences, then the same two again: micro-batches of 2 rows hold the same data."""
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    pair = Batch(
        prompt_ids=torch.randint(3, 90, (2, 4), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, 90, (2, 5), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=torch.tensor([0, 0]),
        advantages=torch.randn(2, 5, generator=g) * response_mask,
    )
    return pair.select(torch.tensor([0, 1, 0, 1]))


@pytest.fixture(scope="module")
def actor(world_of_one, make_cfg, ds_test_config):
    return ActorEngine(
        make_cfg(
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # one mini-batch of the 4 rows (exactly on-policy) ...
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # ... in 2 micro-batches, in row order:
            "actor_rollout_ref.actor.shuffle=false",
            "actor_rollout_ref.actor.optim.lr=1e-12",  # the weights stay put between the two updates
            "actor_rollout_ref.actor.measure_grad_variance=true",
        )
    )


def test_the_variance_across_micro_batches_is_zero_for_equal_ones_and_twice_the_norm_squared_for_opposite_ones(actor):
    batch = rows_twice()
    same = actor.update(batch, temperature=TEMPERATURE)
    h_squared = same["actor/grad_norm"] ** 2  # G = h_1 = h_2
    assert h_squared > 1e-6
    assert same["actor/grad_var"] == pytest.approx(0.0, abs=1e-5 * h_squared)
    assert same["actor/grad_var_relative"] == pytest.approx(0.0, abs=1e-5)

    negated = batch.advantages.clone()
    negated[2:] *= -1
    opposite = actor.update(batch.replace(advantages=negated), temperature=TEMPERATURE)
    assert opposite["actor/grad_norm"] ** 2 < 1e-8 * h_squared
    assert opposite["actor/grad_var"] == pytest.approx(2 * h_squared, rel=1e-4)


def test_one_micro_batch_per_optimizer_step_logs_no_variance(world_of_one, make_cfg, ds_test_config):
    single = ActorEngine(
        make_cfg(
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.measure_grad_variance=true",
        )
    )
    metrics = single.update(rows_twice(), temperature=TEMPERATURE)
    assert "actor/grad_norm" in metrics and "actor/grad_var" not in metrics
