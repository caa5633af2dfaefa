"""Routing replay (``dsrl.engines.routers.RouteReplay`` and ``RouteRecorder``, ``actor.router_replay.mode``): the
transformers rollout records the experts every token ran through; a trainer forward replaying them runs exactly
those experts (padded and packed), weighs them by the router's current logits (its gradient flows), changes nothing
when they are the router's own choices, brings the log-probs back to the rollout's when the trainer's router is
perturbed, and pins an activation-checkpoint recompute to the forward's experts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointError
from transformers import AutoModelForCausalLM

from dsrl.data.batch import Batch
from dsrl.engines.forward import PassTally, policy_stats
from dsrl.engines.packing import Packing
from dsrl.engines.routers import RouteReplay
from dsrl.rollout.base import SamplingParams
from dsrl.rollout.hf import HFRollout
from tests.helpers.rollout import sampled_batch

CPU = torch.device("cpu")
LAYOUTS = {"padded": None, "packed": Packing(), "packed, prompts once": Packing(dedup=True)}


def _model(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def rollout_batch(moe_model_dir) -> Batch:
    """Two prompts (one left-padded), two sampled responses each, with the rollout's routes."""
    rollout = HFRollout(str(moe_model_dir), dtype="float32", record_routes=True)
    return sampled_batch(rollout, SamplingParams(n=2, max_tokens=8, seed=1))


def _stats(model, batch, packing, replay, tally=None, grad=False):
    with torch.set_grad_enabled(grad):
        stats, width = policy_stats(model, batch, CPU, temperature=1.0, packing=packing, tally=tally, replay=replay)
    return stats["log_probs"], width


def _gap(batch: Batch, log_probs: torch.Tensor, width: int) -> float:
    valid = batch.response_mask[:, :width].bool()
    return float((log_probs - batch.rollout_log_probs[:, :width])[valid].abs().mean())


def test_the_rollout_records_every_token_but_the_last(rollout_batch):
    batch = rollout_batch
    layers_k = batch.prompt_routes.shape[2:]
    assert batch.prompt_routes.shape[:2] == batch.prompt_ids.shape and layers_k == (4, 2)
    assert batch.response_routes.shape[:2] == batch.response_ids.shape and batch.response_routes.dtype == torch.int16
    recorded = batch.response_routes[..., 0, 0] >= 0
    last = batch.response_mask.sum(1) - 1  # no forward ran a response's last token
    assert recorded.sum(1).tolist() == last.tolist()
    assert (batch.prompt_routes[batch.prompt_mask.bool()] >= 0).all()
    # the two responses of a prompt share its prefill: the same prompt routes
    assert torch.equal(batch.prompt_routes[0], batch.prompt_routes[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_forward_replaying_the_rollouts_routes_runs_them(moe_model_dir, rollout_batch, layout):
    """Float32, the same weights: the trainer's routers agree with every recorded choice, the log-probs with the
    rollout's, and the routes the forward ran are the recorded ones where recorded."""
    model = _model(moe_model_dir)
    replay, tally = RouteReplay(model, "key"), PassTally()
    log_probs, width = _stats(model, rollout_batch, LAYOUTS[layout], replay, tally)
    # 48 positions (10 prompt tokens and 7 responses tokens in each pair of rows), 4 layers of 2 choices; with the
    # prompts once, each prompt's tokens once
    assert tally.routes_compared == (304 if "once" in layout else 384) == tally.routes_agreed
    assert _gap(rollout_batch, log_probs, width) < 1e-5
    prompt_routes, response_routes = replay.recorded()
    at = rollout_batch.response_routes[:, :width] >= 0
    assert torch.equal(response_routes[at], rollout_batch.response_routes[:, :width][at])
    in_prompt = rollout_batch.prompt_mask.bool()
    assert torch.equal(prompt_routes[in_prompt], rollout_batch.prompt_routes[in_prompt])
    assert (response_routes[rollout_batch.response_mask[:, :width].bool()] >= 0).all()  # the last tokens: its own


def _perturbed(path, scale: float) -> torch.nn.Module:
    model = _model(path)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.add_(torch.randn(gate.shape, generator=generator) * scale * gate.std())
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_runs_the_recorded_experts_on_a_perturbed_router(moe_model_dir, rollout_batch, layout):
    """The trainer's routers perturbed: on their own they choose other experts; replaying, every token runs the
    recorded ones (hooks on the experts see them), the gap to the rollout's log-probs shrinks, and the routers
    still get a gradient."""
    model = _perturbed(moe_model_dir, 1.0)
    packing = LAYOUTS[layout]
    ran: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_hook(lambda module, args, out: ran.append(args[1].clone()))
    own, width = _stats(model, rollout_batch, packing, None)
    replay, tally = RouteReplay(model, "key"), PassTally()
    ran.clear()
    replayed, _ = _stats(model, rollout_batch, packing, replay, tally, grad=True)
    assert tally.routes_agreed < tally.routes_compared  # the perturbation changed the routers' own choices
    flat = replay.routes
    recorded = torch.stack(ran, dim=1)  # [positions, layers, k]: what the experts ran
    assert torch.equal(recorded, flat)
    prompt_routes, response_routes = replay.recorded()
    at = rollout_batch.response_routes[:, :width] >= 0
    assert torch.equal(response_routes[at], rollout_batch.response_routes[:, :width][at])  # 100% of the recorded
    assert _gap(rollout_batch, replayed.detach(), width) < _gap(rollout_batch, own, width)
    replayed[rollout_batch.response_mask[:, :width].bool()].sum().backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0


def test_replaying_a_routers_own_choices_changes_nothing(moe_model_dir, rollout_batch):
    """Routes recorded by the trainer itself (R2's record: nothing installed, each token routes itself), then
    replayed: the same log-probs to the bit, and the router's weights as its own (recomputed from its logits)."""
    model = _model(moe_model_dir)
    plain, width = _stats(model, rollout_batch, None, None)
    replay = RouteReplay(model, "key")
    batch = rollout_batch.replace(prompt_routes=None, response_routes=None)
    recorded, _ = _stats(model, batch, None, replay)
    prompt_routes, response_routes = replay.recorded()
    batch = batch.replace(prompt_routes=prompt_routes, response_routes=response_routes)
    replayed, _ = _stats(model, batch, None, replay)
    assert torch.equal(plain, recorded) and torch.equal(plain, replayed)


def _noisy_routers(model: torch.nn.Module) -> None:
    """Routers that choose k experts at random on every call (a recompute routes anew, as a GPU's non-deterministic
    kernels can make it), weighted by their softmax as the router's own."""

    draws = torch.Generator().manual_seed(0)  # its own: checkpoint restores the global RNG for the recompute

    def shuffle(module, args, out):
        logits, scores, own = out
        chosen = torch.rand(logits.shape, generator=draws).topk(own.shape[1], dim=-1).indices
        return logits, torch.softmax(logits.float(), -1).gather(1, chosen).to(scores.dtype), chosen

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(shuffle)


def _gate_grads(model) -> list[torch.Tensor]:
    return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]


def _checkpointed_grads(path, batch, *, experts: str, checkpointed: bool, replayed: bool):
    """The routers' gradients of one forward and backward with noisy routers; and the routes the forward ran."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=experts)
    _noisy_routers(model)  # before RouteReplay's hooks: replay sees, and overrides, the noisy choice
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    replay = RouteReplay(model, "key") if replayed else None
    log_probs, width = _stats(model, batch, Packing(), replay, grad=True)
    log_probs[batch.response_mask[:, :width].bool()].sum().backward()
    return _gate_grads(model), None if replay is None else replay.recorded()


@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
def test_a_checkpointed_recompute_runs_the_forwards_experts(moe_model_dir, rollout_batch, experts):
    """Activation checkpointing with routers that route anew on every call (as a GPU's non-deterministic kernels can
    make a recompute do). Replay with nothing recorded (R2's update when the old-log-prob pass folds into it) pins
    the recompute to the forward's experts: the gradients are those of the same routes without checkpointing.
    Without replay, transformers' eager experts save other tensors in the recompute and torch raises
    ``CheckpointError``; its default grouped_mm experts save tensors of the same shapes, and the gradients come out
    silently wrong."""
    path, batch = moe_model_dir, rollout_batch.replace(prompt_routes=None, response_routes=None)
    pinned, (prompt_routes, response_routes) = _checkpointed_grads(
        path, batch, experts=experts, checkpointed=True, replayed=True
    )
    recorded = batch.replace(prompt_routes=prompt_routes, response_routes=response_routes)
    expected, _ = _checkpointed_grads(path, recorded, experts=experts, checkpointed=False, replayed=True)
    for got, want in zip(pinned, expected, strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    if experts == "eager":
        with pytest.raises(CheckpointError):
            _checkpointed_grads(path, recorded, experts=experts, checkpointed=True, replayed=False)
    else:
        wrong, _ = _checkpointed_grads(path, recorded, experts=experts, checkpointed=True, replayed=False)
        assert not all(torch.allclose(got, want) for got, want in zip(wrong, expected, strict=True))


def test_a_dense_model_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"mode: .* whose routers dsrl cannot replay \(a dense model.*fix: set"):
        RouteReplay(_model(tiny_model_dir), "actor_rollout_ref.actor.router_replay.mode")


def test_routes_travel_with_their_rows():
    """Concatenated batches re-pad the routes as their columns: prompts on the left, responses on the right."""

    def batch(P: int, T: int, value: int) -> Batch:
        return Batch(
            torch.ones(1, P, dtype=torch.long),
            torch.ones(1, P, dtype=torch.long),
            torch.ones(1, T, dtype=torch.long),
            torch.ones(1, T, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            prompt_routes=torch.full((1, P, 3, 2), value, dtype=torch.int16),
            response_routes=torch.full((1, T, 3, 2), value, dtype=torch.int16),
        )

    joined = Batch.concat([batch(2, 5, 7), batch(4, 3, 9)])
    assert joined.prompt_routes.shape == (2, 4, 3, 2) and joined.response_routes.shape == (2, 5, 3, 2)
    assert joined.prompt_routes[0, 2:].eq(7).all() and joined.prompt_routes[0, :2].eq(0).all()
    assert joined.response_routes[1, :3].eq(9).all() and joined.response_routes[1, 3:].eq(0).all()
