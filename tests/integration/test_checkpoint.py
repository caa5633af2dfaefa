"""Checkpoint pieces that run in one process on the tiny model (ZeRO-3 + CPU offload, float32):
the exported Hugging Face model, non-finite updates, degenerate rollouts, and resume refusals.

Exact resume of whole runs, killed and restarted as processes, is in ``test_resume.py``.
"""

from __future__ import annotations

import json
import math

import deepspeed
import pytest
import torch

from dsrl.checkpoint import CheckpointError, export_hf_model, state_config, step_dir, write_state
from dsrl.engines import ActorEngine
from dsrl.rollout import iter_full_parameters
from tests.conftest import recipe
from tests.integration.test_engines import ACTOR_TRAINING, make_batch, training_batch
from tests.integration.test_trainer import trainer_for
from tests.resume_helpers import _differences


@pytest.fixture(scope="module")
def actor(world_of_one, make_cfg, ds_test_config):
    return ActorEngine(make_cfg(*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}"))


def test_exported_model_loads_and_its_logits_equal_the_actors(actor, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Move every weight away from the files on disk, so only the live ZeRO-3 partitions can explain the export.
    params = list(actor.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in params:
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = export_hf_model(actor.module, tokenizer, tmp_path / "hf", max_shard_bytes=400_000)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == {name for name, _ in actor.module.named_parameters()}
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert AutoTokenizer.from_pretrained(out).encode("12+34=") == tokenizer.encode("12+34=")

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = make_batch()
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    actor.engine.eval()
    with torch.no_grad():
        expected = actor.engine(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    assert (got - expected).abs().max().item() == 0.0
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (original(input_ids=ids, attention_mask=mask).logits - expected).abs().max().item() > 1e-3


def optimizer_state(actor):
    return {
        "params": {name: t.clone() for name, t in iter_full_parameters(actor.module)},
        "optimizer": {k: v for k, v in actor.engine.optimizer.state_dict().items() if k not in ("loss_scaler", "overflow")},
    }


@pytest.fixture(scope="module", params=["zero3_offload", "zero2"])
def any_actor(request, actor, make_cfg, ds_test_config):
    """The ZeRO-3 + offload actor, and one on ZeRO-2 (device optimizer; JIT-builds DeepSpeed's fused Adam once)."""
    if request.param == "zero3_offload":
        return actor
    return ActorEngine(make_cfg(*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero2')}"))


def test_non_finite_loss_skips_the_step_and_changes_no_tensor(any_actor, monkeypatch):
    """ZeRO's own check skips the step (on every stage dsrl accepts); dsrl counts it."""
    actor = any_actor
    batch = training_batch(actor)
    before = optimizer_state(actor)
    total_before, lr_steps_before = actor.skips.total, actor.lr_scheduler.last_epoch
    loss = actor._loss

    def nan_loss(*args, **kwargs):
        value, contributions = loss(*args, **kwargs)
        return value * math.nan, contributions

    monkeypatch.setattr(actor, "_loss", nan_loss)
    metrics = actor.update(batch, temperature=0.7)
    optimizer_steps = 4  # 2 mini-batches x 2 epochs
    assert metrics["actor/skipped_steps"] == total_before + optimizer_steps
    assert actor.skips.consecutive == optimizer_steps and not math.isfinite(actor.skips.last_bad["actor/loss"])
    assert _differences(before, optimizer_state(actor), "state") == []
    # the lr schedule counts training steps whether or not their optimizer steps applied (verl's)
    assert actor.lr_scheduler.last_epoch == lr_steps_before + 1

    monkeypatch.setattr(actor, "_loss", loss)
    metrics = actor.update(batch, temperature=0.7)
    assert metrics["actor/skipped_steps"] == total_before + optimizer_steps and actor.skips.consecutive == 0
    assert math.isfinite(metrics["actor/grad_norm"])
    after = {name: t for name, t in iter_full_parameters(actor.module)}
    assert all(not torch.equal(before["params"][k], after[k]) for k in after)


def make_trainer(name, tiny_model_dir, data, ds_test_config, out, *overrides):
    extra = []
    if name == "ppo":
        extra = [f"critic.model.path={tiny_model_dir}", f"critic.deepspeed_config={ds_test_config('zero3_offload')}"]
    return trainer_for(
        name, tiny_model_dir, data, ds_test_config, out, "data.val_files=null", "data.max_response_length=6", *extra,
        *overrides,
    )


def test_consecutive_non_finite_steps_stop_the_run_naming_step_and_metric(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    from dsrl.trainer import TrainingStopped

    trainer = make_trainer(
        "grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path,
        "trainer.total_training_steps=4", "trainer.max_consecutive_skips=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    )
    loss = trainer.actor._loss
    trainer.actor._loss = lambda *a, **kw: (loss(*a, **kw)[0] * math.nan, loss(*a, **kw)[1])
    with pytest.raises(TrainingStopped, match=r"step 2: 4 actor optimizer steps in a row skipped .*actor/loss=nan"):
        trainer.fit()  # 2 optimizer steps per step: 2 skipped after step 1, 4 >= 3 after step 2


def test_checkpoints_are_kept_as_asked_and_the_model_comes_from_the_last_one(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    from dsrl.checkpoint import LATEST_FILE, complete_steps

    trainer = make_trainer(
        "ppo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path,
        "trainer.total_training_steps=3", "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=1",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    )
    trainer.fit()
    # step 1 is outside both windows (deleted whole); step 2 keeps the actor only
    assert sorted(complete_steps(tmp_path)) == [2, 3] and (tmp_path / LATEST_FILE).read_text() == "3"
    assert (step_dir(tmp_path, 2) / "actor").is_dir() and not (step_dir(tmp_path, 2) / "critic").exists()
    assert (step_dir(tmp_path, 3) / "critic").is_dir()
    assert trainer.model_dir == step_dir(tmp_path, 3) / "actor" / "huggingface"
    assert (trainer.model_dir / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "huggingface").exists()  # not exported twice
    state = json.loads((step_dir(tmp_path, 3) / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["sampler"] == {"epoch": 0, "index": 3}
    assert state["save_contents"] == ["model", "optimizer", "extra", "hf_model"] and state["world_size"] == 1


@pytest.mark.parametrize("name", ["grpo", "ppo", "otb"])
def test_empty_responses_and_equal_rewards_give_no_nan(
    name, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """Whole groups of empty responses, a lone empty response, and groups whose rewards are all
    equal (the reward of an empty string is 0 for every row of a group): every tensor of the
    batch and every metric stay finite."""
    trainer = make_trainer(
        name, tiny_model_dir, arithmetic_data, ds_test_config, tmp_path,
        "trainer.total_training_steps=1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
    )
    generate = trainer.rollout.generate

    def with_empty_rows(prompt_ids, prompt_mask, sampling):
        out = generate(prompt_ids, prompt_mask, sampling)
        mask = out.response_mask.clone()
        mask[: sampling.n] = 0  # the first group: every response empty
        mask[sampling.n + 1] = 0  # the second group: one empty response
        return type(out)(**{**vars(out), "response_mask": mask, "response_ids": out.response_ids * mask,
                            "log_probs": out.log_probs * mask})

    trainer.rollout.generate = with_empty_rows
    seen = {}
    update = trainer.actor.update
    trainer.actor.update = lambda batch, **kw: seen.setdefault("batch", batch) and update(batch, **kw)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append(metrics)
    trainer.fit()
    batch = seen["batch"]
    assert batch.response_mask[:4].sum() == 0
    for field, value in vars(batch).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), field
    bad = {k: v for k, v in logged[-1].items() if not math.isfinite(v)}
    assert not bad


def test_resume_refuses_a_changed_run_before_any_model_loads(tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, tmp_path, monkeypatch):
    from dsrl.config import load_and_validate
    import dsrl.trainer

    def models_must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the checkpoint was checked")

    monkeypatch.setattr(dsrl.trainer, "ActorEngine", models_must_not_load)
    base = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        "data.val_files=null",
        f"trainer.default_local_dir={tmp_path}",
    ]
    saved, _ = load_and_validate(recipe("grpo"), base, world_size=1)
    step_dir(tmp_path, 2).mkdir(parents=True)
    write_state(step_dir(tmp_path, 2), {"format": 1, "config": state_config(saved, world_size=1)})

    changed, _ = load_and_validate(recipe("grpo"), base + ["trainer.seed=5"], world_size=1)
    with pytest.raises(CheckpointError, match=r"settings differ from the checkpoint's:\n  trainer.seed: 1 -> 5\nfix:"):
        dsrl.trainer.Trainer(changed)

    allowed, _ = load_and_validate(
        recipe("grpo"), base + ["trainer.seed=5", "trainer.resume_allow_config_change=true"],
        world_size=1,
    )
    with pytest.raises(AssertionError, match="a model was loaded"):  # past the check, on to the models
        dsrl.trainer.Trainer(allowed)

    step_dir(tmp_path, 4).mkdir()
    write_state(step_dir(tmp_path, 4), {"format": 1, "config": state_config(saved, world_size=8)})
    with pytest.raises(CheckpointError, match="written by 8 ranks, this run has 1"):
        dsrl.trainer.Trainer(saved)

    not_a_checkpoint, _ = load_and_validate(
        recipe("grpo"),
        base + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={arithmetic_data}"],
        world_size=1,
    )
    with pytest.raises(CheckpointError, match="not a complete dsrl checkpoint: no trainer_state.json"):
        dsrl.trainer.Trainer(not_a_checkpoint)
