"""Routing replay through the engines (the tiny Qwen3-MoE under DeepSpeed ZeRO-3, activation checkpointing on): R3
with LoRA, the transformers rollout fed the merged push and recording its routes, the actor's old-log-prob pass and
the adapters-off reference replaying them; R2, the old-log-prob pass recording the actor's own routes and the update
replaying them. The unit tests of the replay itself: tests/engines/test_route_replay.py."""

from __future__ import annotations

import pytest
import torch

from dsrl.data.batch import Batch
from dsrl.engines import ActorEngine
from dsrl.engines.reference import AdapterOffReference
from dsrl.rollout.base import SamplingParams
from dsrl.rollout.hf import HFRollout
from tests.helpers.engines import ACTOR_TRAINING, TEMPERATURE, full_params
from tests.helpers.rollout import sampled_batch

pytestmark = pytest.mark.e2e

MODE = "actor_rollout_ref.actor.router_replay.mode"


@pytest.fixture(scope="module")
def cfg_for(world_of_one, make_cfg, ds_test_config, moe_model_dir):
    def build(*extra: str):
        return make_cfg(
            *ACTOR_TRAINING,
            f"actor_rollout_ref.model.path={moe_model_dir}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3')}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.model.use_remove_padding=true",
            *extra,
        )

    return build


def sampled(rollout: HFRollout) -> Batch:
    """Two prompts (one left-padded) and four responses each, at the rollout's temperature, with advantages."""
    batch = sampled_batch(rollout, SamplingParams(n=4, temperature=TEMPERATURE, max_tokens=8, seed=3))
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    return batch.replace(advantages=advantages * batch.response_mask)


@pytest.mark.parametrize("merge", [True, False], ids=["merged push", "adapters push"])
def test_r3_with_lora_replays_the_rollouts_routes_in_every_pass(cfg_for, merge):
    """The rollout a plain copy fed merged weights, or a PEFT copy fed the adapters (its generate runs the wrapped
    model, whose forwards the recorder hooks)."""
    cfg = cfg_for(
        f"{MODE}=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        f"actor_rollout_ref.model.lora.merge={merge}",
    )
    actor = ActorEngine(cfg)
    adapted = {name for name, p in actor.module.named_parameters() if p.requires_grad}
    assert adapted and not any(".experts." in name or ".gate." in name for name in adapted)  # linear layers only
    rollout = HFRollout.from_config(cfg)
    rollout.update_weights(actor.rollout_weights())
    batch = sampled(rollout)
    stats = actor.compute_log_probs(batch, temperature=TEMPERATURE)
    tally = actor.tallies["old_log_prob"]
    assert tally.routes_compared > 0 and tally.routes_agreed == tally.routes_compared  # float32, the same weights
    valid = batch.response_mask.bool()
    assert (stats["old_log_probs"] - batch.rollout_log_probs)[valid].abs().max() < 1e-5
    recorded = batch.response_routes >= 0
    assert torch.equal(stats["response_routes"][recorded], batch.response_routes[recorded])
    assert (stats["response_routes"][valid] >= 0).all()  # the last tokens: the actor's own
    batch = batch.replace(**stats)
    reference = AdapterOffReference(cfg, actor)
    batch = batch.replace(ref_log_probs=reference.compute_log_probs(batch, temperature=TEMPERATURE))
    assert reference.tallies["ref"].routes_compared > 0
    before = full_params(actor.module)
    metrics = actor.update(batch, temperature=TEMPERATURE)  # checkpointed recomputes under replay
    assert metrics["actor/grad_norm"] > 0 and actor.replay.routes is None  # released after the last backward
    after = full_params(actor.module)
    assert max((after[k] - before[k]).abs().max().item() for k in before if "lora_" in k) > 0


def test_r2_records_the_old_policys_routes_and_the_update_replays_them(cfg_for):
    actor = ActorEngine(  # one mini-batch, one epoch: the update's routers are the old-log-prob pass's
        cfg_for(
            f"{MODE}=R2",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=1",
        )
    )
    rollout = HFRollout.from_config(actor.cfg)
    assert rollout.routes is None  # R2 records in the trainer
    rollout.update_weights(actor.rollout_weights())
    batch = sampled(rollout)
    assert batch.prompt_routes is None
    stats = actor.compute_log_probs(batch, temperature=TEMPERATURE)
    assert actor.tallies["old_log_prob"].routes_compared == 0  # nothing to compare: it records
    valid = batch.response_mask.bool()
    assert (stats["response_routes"][valid] >= 0).all()
    assert (stats["prompt_routes"][batch.prompt_mask.bool()] >= 0).all()
    actor.update(batch.replace(**stats), temperature=TEMPERATURE)
    tally = actor.tallies["actor_update"]
    # the same weights in other micro-batches (other packed rows): float rounding may flip a near tie, no more
    assert tally.routes_compared > 0 and tally.routes_agreed / tally.routes_compared > 0.99
