"""Actor, critic and reference engines on a tiny Qwen3 under ZeRO-3 + CPU offload, one rank.

What is pinned down: the forward equals a plain transformers forward (log-probs with temperature,
entropy, sum_pi_squared); chunking changes nothing; token-budget micro-batches respect the budget
and come back in order; and one update gives the same parameters (and metrics) whether a
mini-batch runs as 1, 4 or token-budget micro-batches.

The test DeepSpeed configs use AdamW with eps=1: the update is then nearly linear in the gradient
(lr * m / (sqrt(v) + 1)), so equal gradients give equal parameters to float precision. With the
usual eps=1e-8, Adam divides float noise in near-zero gradients by its own magnitude.
"""

from __future__ import annotations

import math

import deepspeed
import pytest
import torch

from dsrl.engines import ActorEngine, CriticEngine, ReferenceEngine
from dsrl.engines.deepspeed_setup import build_ds_config
from dsrl.engines.forward import micro_batch_indices, model_inputs
from tests.helpers.engines import (
    ACTOR_TRAINING,
    BUDGET,
    CRITIC_TRAINING,
    N_PROMPTS,
    TEMPERATURE,
    N,
    P,
    T,
    assert_same_metrics,
    assert_same_params,
    full_params,
    make_batch,
    training_batch,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def z3(ds_test_config):
    return ds_test_config("zero3_offload", optimizer={"eps": 1.0})


@pytest.fixture(scope="module")
def actors(world_of_one, make_cfg, z3):
    """Three fresh actors from the same weights: micro-batches of 1, of 4, and by token budget."""
    common = (*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={z3}")
    return {
        "micro1": ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")),
        # Activation checkpointing recomputes the same forward: it must not change the result either.
        "micro4": ActorEngine(
            make_cfg(
                *common,
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            )
        ),
        "dynamic": ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.use_dynamic_bsz=true")),
        # Each prompt runs once per micro-batch, its responses on its KV cache: the same function.
        "shared": ActorEngine(
            make_cfg(
                *common,
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.model.shared_prompt_forward=true",
            )
        ),
    }


def test_actor_log_probs_equal_a_transformers_forward(actors, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    out = actors["micro1"].compute_log_probs(
        batch, temperature=TEMPERATURE, with_entropy=True, with_sum_pi_squared=True
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, P - 1 : P + T - 1]
    log_softmax = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    probs = log_softmax.exp()
    mask = batch.response_mask.bool()
    expected = {
        "old_log_probs": log_softmax.gather(-1, batch.response_ids[..., None]).squeeze(-1),
        "entropy": -(probs * log_softmax).sum(-1),
        "sum_pi_squared": probs.square().sum(-1),
    }
    assert out.keys() == expected.keys()
    for name, value in out.items():
        assert value.shape == (N_PROMPTS * N, T) and value.dtype == torch.float32
        torch.testing.assert_close(value[mask], expected[name][mask], atol=1e-5, rtol=1e-5)
        assert (value[~mask] == 0).all(), name


def test_token_budget_and_shared_prompt_log_probs_come_back_in_order(actors):
    batch = make_batch()
    by_count = actors["micro1"].compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
    by_budget = actors["dynamic"].compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
    # Micro-batches of 3 rows: one holds rows of both prompts, each run once. The key reaches the forward:
    # two model calls per micro-batch (the distinct prompts, then the responses on their cache).
    calls = []
    hook = actors["shared"].module.register_forward_hook(lambda module, args, out: calls.append(len(out.logits)))
    try:
        shared = actors["shared"].compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
    finally:
        hook.remove()
    assert calls == [1, 3, 2, 3, 1, 2]  # rows 0-2 (prompt 0), 3-5 (both prompts), 6-7 (prompt 1)
    for name in by_count:
        torch.testing.assert_close(by_budget[name], by_count[name], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(shared[name], by_count[name], atol=1e-5, rtol=1e-5)


def test_token_budget_packing_respects_the_budget(world_of_one):
    batch = make_batch()
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=BUDGET)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(batch)))
    for part in parts:  # the padded rectangle each forward runs, not just its valid tokens
        inputs, _ = model_inputs(batch.select(part), torch.device("cpu"))
        assert inputs["input_ids"].numel() <= BUDGET, part
    # Rows (prompt, response columns): (6,8) (6,5) (6,1) (6,7) (3,3) (3,8) (3,6) (3,2): sorted by
    # response, cut at 30 -> {2,7,4} 27, {1,6} 24, {3,5} 28, {0} 14. Valid tokens alone (75) would
    # suggest 3 parts, but 3 parts need two disjoint triples of <= 10 columns: only rows 2, 4, 6, 7 allow one.
    assert {tuple(part.tolist()) for part in parts} == {(2, 4, 7), (1, 6), (3, 5), (0,)}
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"):
        micro_batch_indices(
            batch, micro_batch_size=1, max_token_len=10, key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
        )


def test_actor_update_is_micro_batch_invariant(actors):
    before = full_params(actors["micro1"].module)
    batch = training_batch(actors["micro1"])
    metrics = {name: actor.update(batch, temperature=TEMPERATURE) for name, actor in actors.items()}
    params = {name: full_params(actor.module) for name, actor in actors.items()}

    expected_keys = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy_loss",
        "actor/kl_loss",
        "actor/kl_coef",
        "actor/loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/skipped_steps",
    }
    assert set(metrics["micro1"]) == expected_keys
    assert metrics["micro1"]["actor/skipped_steps"] == 0
    assert all(math.isfinite(v) for v in metrics["micro1"].values())
    assert metrics["micro1"]["actor/pg_clipfrac"] > 0  # the perturbed old log-probs make clipping matter
    assert metrics["micro1"]["actor/lr"] == pytest.approx(0.01)
    assert max((params["micro1"][k] - before[k]).abs().max().item() for k in before) > 1e-3
    for other in ("micro4", "dynamic", "shared"):
        assert_same_params(params[other], params["micro1"])
        assert_same_metrics(metrics[other], metrics["micro1"])


@pytest.fixture(scope="module")
def critics(world_of_one, make_cfg, z3):
    common = (*CRITIC_TRAINING, f"critic.deepspeed_config={z3}")
    return {
        "micro1": CriticEngine(make_cfg(*common, "critic.ppo_micro_batch_size_per_gpu=1")),
        # Activation checkpointing recomputes the same forward: it must not change the result either.
        "micro4": CriticEngine(
            make_cfg(
                *common, "critic.ppo_micro_batch_size_per_gpu=4", "critic.model.enable_gradient_checkpointing=true"
            )
        ),
        "dynamic": CriticEngine(make_cfg(*common, "critic.use_dynamic_bsz=true")),
    }


def test_the_critic_checkpoints_activations_when_asked(critics):
    assert critics["micro4"].module.backbone.is_gradient_checkpointing
    assert not critics["micro1"].module.backbone.is_gradient_checkpointing


def test_critic_values_align_with_the_token_before_each_response_token(critics):
    critic = critics["micro1"]
    batch = make_batch()
    values = critic.compute_values(batch)
    module = critic.module
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(module.parameters())):
        hidden = module.backbone(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).last_hidden_state
        expected = module.value_head(hidden[:, P - 1 : P + T - 1]).squeeze(-1)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(values[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert (values[~mask] == 0).all()
    torch.testing.assert_close(critics["dynamic"].compute_values(batch), values, atol=1e-6, rtol=1e-6)


def test_critic_update_is_micro_batch_invariant(critics):
    before = full_params(critics["micro1"].module)
    batch = make_batch()
    values = critics["micro1"].compute_values(batch)
    g = torch.Generator().manual_seed(2)
    batch = batch.replace(values=values, returns=values + torch.randn(values.shape, generator=g) * batch.response_mask)
    metrics = {name: critic.update(batch) for name, critic in critics.items()}
    params = {name: full_params(critic.module) for name, critic in critics.items()}

    expected_keys = {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/loss",
        "critic/grad_norm",
        "critic/lr",
        "critic/skipped_steps",
    }
    assert set(metrics["micro1"]) == expected_keys
    assert metrics["micro1"]["critic/skipped_steps"] == 0
    assert all(math.isfinite(v) for v in metrics["micro1"].values())
    assert metrics["micro1"]["critic/vf_clipfrac"] > 0  # returns ~1 away from values, cliprange 0.2
    assert max((params["micro1"][k] - before[k]).abs().max().item() for k in before) > 1e-3
    for other in ("micro4", "dynamic"):
        assert_same_params(params[other], params["micro1"])
        assert_same_metrics(metrics[other], metrics["micro1"])


def test_zero2_update_is_micro_batch_invariant(world_of_one, make_cfg, ds_test_config):
    # ZeRO-2 accumulates and reduces gradients its own way; offloading its optimizer reuses the
    # CPU Adam op (plain ZeRO-2 on CPU would compile FusedAdam for minutes).
    z2 = ds_test_config("zero2", offload_optimizer={"device": "cpu"}, optimizer={"eps": 1.0})
    common = (*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={z2}")
    micro1 = ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"))
    micro4 = ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"))
    batch = training_batch(micro1)
    before = full_params(micro1.module)
    metrics1, metrics4 = (actor.update(batch, temperature=TEMPERATURE) for actor in (micro1, micro4))
    after = full_params(micro1.module)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3
    assert_same_params(full_params(micro4.module), after)
    assert_same_metrics(metrics4, metrics1)


def test_reference_scores_like_the_initial_actor(world_of_one, make_cfg, ds_test_config):
    # A fresh actor (the module fixtures' actors have trained by now) and the reference, same weights.
    cfg = make_cfg(
        f"actor_rollout_ref.ref.deepspeed_config={ds_test_config('zero3_offload_inference')}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
    )
    batch = make_batch()
    ref = ReferenceEngine(cfg).compute_log_probs(batch, temperature=TEMPERATURE)
    actor = ActorEngine(cfg).compute_log_probs(batch, temperature=TEMPERATURE)["old_log_probs"]
    torch.testing.assert_close(ref, actor, atol=1e-6, rtol=1e-6)


def test_ds_config_filling_refuses_conflicts(world_of_one, tmp_path, make_cfg):
    cfg = make_cfg()
    actor = cfg.actor_rollout_ref.actor
    fill = {
        "key": "actor_rollout_ref.actor.deepspeed_config",
        "micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    ds = build_ds_config("zero3_offload", **fill, dtype="bfloat16", optim=actor.optim, grad_clip=0.5, prefix="actor")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        8,
        4,
        2,
    )
    assert ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["lr"] == actor.optim.lr
    assert (
        build_ds_config("zero3_offload", **fill, dtype="float32", optim=actor.optim, grad_clip=1.0)["bf16"]["enabled"]
        is False
    )

    refused = [
        (
            '{"gradient_clipping": 2.0, "optimizer": {"type": "AdamW"}}',
            "float32",
            r"gradient_clipping=2.0 disagrees .*actor.optim.clip_grad",
        ),
        # ZeRO's non-finite gradient check is what skips bad steps: no ZeRO, or the check turned off, is refused.
        (
            '{"optimizer": {"type": "AdamW"}}',
            "float32",
            r"zero_optimization.stage=0: a training engine needs ZeRO stage 1, 2 or 3",
        ),
        (
            '{"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2, "compute_grad_norm": false}}',
            "float32",
            r"compute_grad_norm=false turns off the gradient norm",
        ),
        (
            '{"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}, "bf16": {"check_grad_overflow": '
            "false}}",
            "bfloat16",
            r"bf16.check_grad_overflow=false would apply optimizer steps",
        ),
    ]
    for i, (text, dtype, message) in enumerate(refused):
        path = tmp_path / f"refused{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            build_ds_config(str(path), **fill, dtype=dtype, optim=actor.optim, grad_clip=1.0, prefix="actor")
    with pytest.raises(ValueError, match="no optimizer section"):
        build_ds_config("zero3_offload", **fill, dtype="float32")
    with pytest.raises(ValueError, match="zero3_offload_inference"):
        build_ds_config("nonexistent", **fill, dtype="float32")


def test_lr_schedule_steps_once_per_training_step(world_of_one, make_cfg, z3):
    """verl steps the scheduler after the last mini-batch: with 2 warm-up steps the whole first update
    (2 mini-batches x 2 epochs = 4 optimizer steps) runs at lr 0, the second at lr / 2."""
    actor = ActorEngine(
        make_cfg(
            *ACTOR_TRAINING,
            f"actor_rollout_ref.actor.deepspeed_config={z3}",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        )
    )
    batch = training_batch(actor)
    before = full_params(actor.module)
    first = actor.update(batch, temperature=TEMPERATURE)
    assert actor.engine.global_steps == 4
    unchanged = full_params(actor.module)
    assert all(torch.equal(unchanged[k], before[k]) for k in before)  # AdamW at lr 0 moves nothing
    assert first["actor/lr"] == pytest.approx(0.005)  # verl logs the lr after the step: the next update's
    second = actor.update(batch, temperature=TEMPERATURE)
    assert actor.engine.basic_optimizer.param_groups[0]["lr"] == pytest.approx(0.01) == second["actor/lr"]
    assert max((full_params(actor.module)[k] - before[k]).abs().max().item() for k in before) > 1e-4


def test_a_bf16_actor_accumulates_its_gradients_in_fp32(world_of_one, make_cfg, ds_test_config):
    """The shipped ZeRO configs set data_types.grad_accum_dtype=fp32: ZeRO-3 (offloaded here) sums the
    micro-batches' gradients in an fp32 partition buffer, not in the model's bf16."""
    cfg = make_cfg(
        *ACTOR_TRAINING,
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "actor_rollout_ref.model.dtype=bfloat16",
    )
    optimizer = ActorEngine(cfg).engine.optimizer
    assert next(optimizer.module.parameters()).dtype == torch.bfloat16
    assert optimizer.gradient_accumulation_dtype == torch.float32
    assert optimizer.grad_partitions_flat_buffer.dtype == torch.float32
