"""A mixture-of-experts actor (the tiny Qwen3-MoE, ZeRO-3 with offload): its update logs the routers' load-balancing
loss and imbalance (``actor/moe/*``), and ``actor_rollout_ref.actor.router_aux_loss_coef`` adds the loss to the
objective, so the routers train differently with it; packed and padded micro-batches log the same metrics; a dense
model with the key set is refused."""

from __future__ import annotations

import math

import pytest

from dsrl.engines import ActorEngine
from tests.helpers.engines import ACTOR_TRAINING, TEMPERATURE, full_params, training_batch

pytestmark = pytest.mark.e2e

COEF = "actor_rollout_ref.actor.router_aux_loss_coef"


@pytest.fixture(scope="module")
def actor_for(world_of_one, make_cfg, ds_test_config, moe_model_dir):
    z3 = ds_test_config("zero3_offload", optimizer={"eps": 1.0})

    def build(*extra: str) -> ActorEngine:
        model = f"actor_rollout_ref.model.path={moe_model_dir}"
        return ActorEngine(make_cfg(*ACTOR_TRAINING, model, f"actor_rollout_ref.actor.deepspeed_config={z3}", *extra))

    return build


def test_the_aux_loss_trains_the_routers_and_every_update_logs_the_load(actor_for):
    actors = {
        "off": actor_for(),
        "on": actor_for(f"{COEF}=0.1"),
        "packed": actor_for(f"{COEF}=0.1", "actor_rollout_ref.model.use_remove_padding=true"),
    }
    batch = training_batch(actors["off"])
    metrics = {name: actor.update(batch, temperature=TEMPERATURE) for name, actor in actors.items()}
    for name, logged in metrics.items():
        assert math.isfinite(logged["actor/moe/aux_loss"]) and logged["actor/moe/aux_loss"] > 0, name
        assert logged["actor/moe/load_imbalance"] >= 1, name
    # the aux term is in the objective (actor/loss, the objective itself)
    assert metrics["on"]["actor/loss"] > metrics["off"]["actor/loss"]
    params = {name: full_params(actor.module) for name, actor in actors.items()}
    routers = [k for k in params["off"] if k.endswith("mlp.gate.weight")]
    assert len(routers) == 4
    assert max((params["on"][k] - params["off"][k]).abs().max().item() for k in routers) > 1e-6


def test_a_dense_model_with_the_aux_loss_is_refused(world_of_one, make_cfg, ds_test_config):
    with pytest.raises(ValueError, match=f"{COEF}=0.1: .* has no routers .*; fix: set it to 0"):
        ActorEngine(make_cfg(f"{COEF}=0.1", f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3')}"))
