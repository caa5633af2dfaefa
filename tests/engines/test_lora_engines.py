"""The LoRA actor (``actor_rollout_ref.model.lora_rank``) on a tiny Qwen3 in float32, one rank.

What is pinned down, under ZeRO-3 + CPU offload and ZeRO-2: a new actor scores as its base model (PEFT
starts ``B`` at 0; to the last float32 bit); its reference (the actor with the adapters off) scores as a plain
``ReferenceEngine`` of the same weights before and after an update (to 1e-6); an update moves the adapters
only, the optimizer holds nothing else, and it gives the same adapters (to 1e-6, as the full fine-tuning
tests) with micro-batches of 1, of 4 with activation checkpointing, of a token budget, or with the shared-
prompt forward; the merged weights give a plain transformers model the actor's log-probs; the old
log-probs an on-policy update records are those of a separate pass.

DeepSpeed configs and the training batch are test_engines.py's (AdamW with eps=1: equal gradients give
equal parameters to float precision). PEFT draws ``A`` from torch's generator: every actor here is built
after the same seed, so they all start from the same adapters.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsrl.engines import ActorEngine, AdapterOffReference, ReferenceEngine
from dsrl.engines.lora import iter_merged_parameters, trainable_parameter_count
from tests.helpers.engines import (
    ACTOR_TRAINING,
    TEMPERATURE,
    assert_same_metrics,
    assert_same_params,
    full_params,
    make_batch,
    training_batch,
)

pytestmark = pytest.mark.e2e

RANK = 4
LORA = (f"actor_rollout_ref.model.lora_rank={RANK}", "actor_rollout_ref.model.lora_alpha=8")


def lora_actor(make_cfg, *overrides: str) -> ActorEngine:
    torch.manual_seed(0)  # the adapters' initial A
    return ActorEngine(make_cfg(*LORA, *ACTOR_TRAINING, *overrides))


def adapter_elements(model_dir) -> int:
    """Elements of rank-RANK adapters on every linear layer of the model but its output layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(
        RANK * (layer.in_features + layer.out_features)
        for name, layer in model.named_modules()
        if isinstance(layer, torch.nn.Linear) and name != "lm_head"
    )


def optimizer_elements(actor: ActorEngine) -> int:
    """Elements of the fp32 master copy the ZeRO optimizer steps (its stage 3 or stage 1/2 partition)."""
    optimizer = actor.engine.optimizer
    groups = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
    return sum(flat.numel() for flat in groups)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def check_update_trains_the_adapters_alone(actors: dict[str, ActorEngine], reference: torch.Tensor) -> None:
    """Update every actor on one batch: same adapters and metrics as actors["micro1"], base weights
    bit-identical, the adapters moved; the reference (adapters off) still gives ``reference``."""
    first = actors["micro1"]
    batch = training_batch(first)
    before = full_params(first.module)
    metrics = {name: actor.update(batch, temperature=TEMPERATURE) for name, actor in actors.items()}
    params = {name: full_params(actor.module) for name, actor in actors.items()}
    assert metrics["micro1"]["actor/skipped_steps"] == 0 and metrics["micro1"]["actor/pg_clipfrac"] > 0
    assert all(math.isfinite(v) for v in metrics["micro1"].values())
    after = params["micro1"]
    adapters = [name for name in before if is_adapter(name)]
    assert all(torch.equal(after[name], before[name]) for name in before if not is_adapter(name))
    # 4 optimizer steps: B leaves 0 at the first, A moves once B is not 0
    assert all(not torch.equal(after[name], before[name]) for name in adapters)
    assert max((after[name] - before[name]).abs().max().item() for name in adapters) > 1e-3
    for other in actors.keys() - {"micro1"}:
        assert_same_params(params[other], after)
        assert_same_metrics(metrics[other], metrics["micro1"])
    for actor in actors.values():
        ref = AdapterOffReference(actor.cfg, actor).compute_log_probs(make_batch(), temperature=TEMPERATURE)
        torch.testing.assert_close(ref, reference, atol=1e-6, rtol=1e-6)
    moved = first.compute_log_probs(make_batch(), temperature=TEMPERATURE)["old_log_probs"]
    assert (moved - reference).abs().max() > 1e-3


@pytest.fixture(scope="module")
def z3(ds_test_config):
    return ds_test_config("zero3_offload", optimizer={"eps": 1.0})


@pytest.fixture(scope="module")
def reference(world_of_one, make_cfg, ds_test_config) -> torch.Tensor:
    """The base model's log-probs of ``make_batch()`` from a plain ``ReferenceEngine``."""
    cfg = make_cfg(
        f"actor_rollout_ref.ref.deepspeed_config={ds_test_config('zero3_offload_inference')}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
    )
    return ReferenceEngine(cfg).compute_log_probs(make_batch(), temperature=TEMPERATURE)


@pytest.fixture(scope="module")
def actors(world_of_one, make_cfg, z3):
    """Four LoRA actors under ZeRO-3 + offload from the same weights and adapters: micro-batches of 1, of 4
    with activation checkpointing (recomputed through PEFT's layers), by token budget, and of 4 with the
    shared-prompt forward."""
    common = (f"actor_rollout_ref.actor.deepspeed_config={z3}",)
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    return {
        "micro1": lora_actor(make_cfg, *common, f"{micro}=1"),
        "micro4": lora_actor(
            make_cfg, *common, f"{micro}=4", "actor_rollout_ref.model.enable_gradient_checkpointing=true"
        ),
        "dynamic": lora_actor(make_cfg, *common, "actor_rollout_ref.actor.use_dynamic_bsz=true"),
        "shared": lora_actor(make_cfg, *common, f"{micro}=4", "actor_rollout_ref.model.shared_prompt_forward=true"),
    }


def test_a_new_lora_actor_scores_as_its_base_model(actors, reference, tiny_model_dir):
    batch = make_batch()
    assert actors["micro4"].module.base_model.model.model.is_gradient_checkpointing
    elements = adapter_elements(tiny_model_dir)
    for name, actor in actors.items():
        assert trainable_parameter_count(actor.module) == optimizer_elements(actor) == elements, name
        scored = actor.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)["old_log_probs"]
        adapters_off = AdapterOffReference(actor.cfg, actor).compute_log_probs(batch, temperature=TEMPERATURE)
        # B = 0: each adapted layer adds an exact zero (bit-identical without DeepSpeed); under ZeRO-3 a
        # few log-probs differ in the last bit (4.8e-7 at |log p| ~ 5)
        torch.testing.assert_close(scored, adapters_off, atol=1e-6, rtol=0)
        # another DeepSpeed config (inference, no optimizer) and micro-batches of 3: float rounding only
        torch.testing.assert_close(scored, reference, atol=1e-6, rtol=1e-6)


def test_a_zero3_lora_update_trains_the_adapters_alone_whatever_the_micro_batches(actors, reference):
    check_update_trains_the_adapters_alone(actors, reference)


def test_merged_weights_give_a_plain_model_the_actors_log_probs(actors, tiny_model_dir):
    """After the update (the adapters moved): ``W + s B A`` under the base model's names, gathered from ZeRO-3."""
    from transformers import AutoModelForCausalLM

    actor = actors["micro1"]
    merged = dict(iter_merged_parameters(actor.module))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert merged.keys() == dict(model.named_parameters()).keys()  # the tied LM head comes with the embedding
    model.load_state_dict(merged, strict=False)
    batch = make_batch()
    T = batch.response_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, -T - 1 : -1]
    expected = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    mask = batch.response_mask.bool()
    scored = actor.compute_log_probs(batch, temperature=TEMPERATURE)["old_log_probs"]
    torch.testing.assert_close(scored[mask], expected[mask], atol=1e-5, rtol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert any(not torch.equal(p, merged[name]) for name, p in base.named_parameters())


def test_a_zero2_lora_update_trains_the_adapters_alone_whatever_the_micro_batches(
    world_of_one, make_cfg, ds_test_config, reference, tiny_model_dir
):
    # ZeRO-2 with the optimizer offloaded: the CPU Adam op (FusedAdam would compile for minutes)
    z2 = ds_test_config("zero2", offload_optimizer={"device": "cpu"}, optimizer={"eps": 1.0})
    common = (f"actor_rollout_ref.actor.deepspeed_config={z2}",)
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    actors = {f"micro{size}": lora_actor(make_cfg, *common, f"{micro}={size}") for size in (1, 4)}
    for actor in actors.values():
        assert optimizer_elements(actor) == adapter_elements(tiny_model_dir)
        scored = actor.compute_log_probs(make_batch(), temperature=TEMPERATURE)["old_log_probs"]
        torch.testing.assert_close(scored, reference, atol=1e-6, rtol=1e-6)
    check_update_trains_the_adapters_alone(actors, reference)


def test_an_on_policy_lora_update_records_the_old_log_probs_of_a_separate_pass(world_of_one, make_cfg, z3):
    """One mini-batch, one epoch: the update's first forward stands in for the old-log-prob pass (the trainer
    folds it), with the shared-prompt forward as well."""
    for shared in ("false", "true"):
        actor = lora_actor(
            make_cfg,
            f"actor_rollout_ref.actor.deepspeed_config={z3}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            f"actor_rollout_ref.model.shared_prompt_forward={shared}",
        )
        batch = training_batch(actor)
        assert actor.on_policy(len(batch))
        separate = actor.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
        recorded = {}
        actor.update(batch, temperature=TEMPERATURE, recorded=recorded)
        assert recorded.keys() == separate.keys()
        for name, value in separate.items():
            torch.testing.assert_close(recorded[name], value, atol=1e-6, rtol=1e-6)
