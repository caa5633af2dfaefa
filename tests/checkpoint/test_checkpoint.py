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

from dsrl.checkpoint.save import (
    FORMAT,
    CheckpointError,
    _files,
    config_hash,
    export_hf_model,
    sha256_file,
    state_config,
    step_dir,
    write_state,
)
from dsrl.config.layout import ADAPTER_DIR
from dsrl.engines import ActorEngine
from dsrl.engines.weight_sync import iter_full_parameters
from tests.conftest import recipe
from tests.helpers.engines import ACTOR_TRAINING, make_batch, training_batch
from tests.helpers.resume import _differences
from tests.helpers.trainer import trainer_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def actor(world_of_one, make_cfg, ds_test_config):
    return ActorEngine(
        make_cfg(*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}")
    )


def sequences() -> tuple[torch.Tensor, torch.Tensor]:
    """The test batch's prompt + response ids and attention mask."""
    batch = make_batch()
    return torch.cat([batch.prompt_ids, batch.response_ids], 1), torch.cat([batch.prompt_mask, batch.response_mask], 1)


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
    ids, mask = sequences()
    actor.engine.eval()
    with torch.no_grad():
        expected = actor.engine(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    assert (got - expected).abs().max().item() == 0.0
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (original(input_ids=ids, attention_mask=mask).logits - expected).abs().max().item() > 1e-3


LORA = (
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
)


@pytest.fixture(scope="module")
def lora_actor(world_of_one, make_cfg, ds_test_config):
    return ActorEngine(
        make_cfg(*ACTOR_TRAINING, *LORA, f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}")
    )


def test_lora_export_is_the_merged_model_and_a_peft_adapter_both_giving_the_actors_logits(
    lora_actor, tiny_model_dir, make_cfg, ds_test_config, tmp_path
):
    """A LoRA actor on ZeRO-3 + offload exports the merged model under the base model's names (config.json
    as the base's: no PEFT key) and, in lora_adapter/, the adapter that PEFT loads onto the base. Float32
    throughout: the merged weights W + s B A reassociate the actor's x W^T + s (x A^T) B^T, rounding at
    float32's ~1e-7 relative error, so 1e-5 on logits of order 1 bounds the merged model; the PEFT model
    computes as the actor does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = lora_actor
    adapters = [p for p in actor.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(adapters, modifier_rank=0), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in adapters:  # lora_B starts at zero: the adapters must change the model for the test to tell
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    out = export_hf_model(
        actor.module, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / "hf", max_shard_bytes=400_000
    )

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _ in base.named_parameters()}
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((tiny_model_dir / "config.json").read_text())
    adapter_files = sorted(p.name for p in (out / ADAPTER_DIR).iterdir())
    assert adapter_files == ["adapter_config.json", "adapter_model.safetensors"]

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()
    ids, mask = sequences()
    actor.engine.eval()
    with torch.no_grad():
        expected = actor.engine(input_ids=ids, attention_mask=mask).logits
        with peft.disable_adapter():
            plain = peft(input_ids=ids, attention_mask=mask).logits
        assert (plain - expected).abs().max().item() > 1e-2  # the adapters change the model
        assert (peft(input_ids=ids, attention_mask=mask).logits - expected).abs().max().item() <= 1e-6
        assert (merged(input_ids=ids, attention_mask=mask).logits - expected).abs().max().item() <= 1e-5

    # The exported adapter starts another run (actor_rollout_ref.model.lora_adapter_path) at the same policy, its
    # adapters trainable again; lora_rank 0 takes the adapter's own rank.
    resumed = ActorEngine(
        make_cfg(
            *ACTOR_TRAINING,
            f"actor_rollout_ref.model.lora_adapter_path={out / ADAPTER_DIR}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        )
    )
    assert resumed.lora and sum(p.requires_grad for p in resumed.module.parameters()) == len(adapters)
    resumed.engine.eval()
    with torch.no_grad():
        assert (resumed.engine(input_ids=ids, attention_mask=mask).logits - expected).abs().max().item() <= 1e-6


def test_a_lora_resume_onto_another_base_model_is_refused(lora_actor, tiny_model_dir, tmp_path):
    """A LoRA checkpoint holds the adapters alone: the frozen base's checksum, the same on ZeRO-3 partitions as
    on the whole model, tells a resume whether model.path holds the weights they were trained on."""
    from types import SimpleNamespace

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from dsrl.checkpoint.resume import restore
    from dsrl.checkpoint.save import frozen_checksum
    from dsrl.engines.lora import lora_config

    checksum = frozen_checksum(lora_actor.module)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert frozen_checksum(base) is None  # nothing frozen: a full fine-tuning's checkpoint holds every weight
    whole = get_peft_model(base, lora_config(lora_actor.cfg.actor_rollout_ref.model))
    assert frozen_checksum(whole) == checksum
    with torch.no_grad():
        whole.get_base_model().model.norm.weight[0] += 1e-6  # one element, one ulp or so
    assert frozen_checksum(whole) != checksum
    state = {"frozen_checksums": {"actor": checksum + 1}}
    with pytest.raises(CheckpointError, match="actor_rollout_ref.model.path"):
        restore(
            tmp_path,
            state,
            roles={"actor": SimpleNamespace(engine=lora_actor.engine)},
            sampler=None,
            kl_ctrl=None,
            rank=0,
            root=tmp_path,
            seed=1,
            stall_s=600,
        )


def optimizer_state(actor):
    return {
        "params": {name: t.clone() for name, t in iter_full_parameters(actor.module)},
        "optimizer": {
            k: v for k, v in actor.engine.optimizer.state_dict().items() if k not in ("loss_scaler", "overflow")
        },
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
        name,
        tiny_model_dir,
        data,
        ds_test_config,
        out,
        "data.val_files=null",
        "data.max_response_length=6",
        *extra,
        *overrides,
    )


def test_consecutive_non_finite_steps_stop_the_run_naming_step_and_metric(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    from dsrl.trainer.loop import TrainingStopped

    trainer = make_trainer(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "trainer.total_training_steps=4",
        "trainer.max_consecutive_skips=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    )
    loss = trainer.actor._loss
    trainer.actor._loss = lambda *a, **kw: (loss(*a, **kw)[0] * math.nan, loss(*a, **kw)[1])
    with pytest.raises(TrainingStopped, match=r"step 2: 4 actor optimizer steps in a row skipped .*actor/loss=nan"):
        trainer.fit()  # 2 optimizer steps per step: 2 skipped after step 1, 4 >= 3 after step 2


def test_checkpoints_are_kept_as_asked_and_the_model_comes_from_the_last_one(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    from dsrl.checkpoint.save import LATEST_FILE, complete_steps

    trainer = make_trainer(
        "ppo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        "trainer.max_critic_ckpt_to_keep=1",
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
        name,
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "trainer.total_training_steps=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
    )
    generate = trainer.rollout.generate

    def with_empty_rows(prompt_ids, prompt_mask, sampling):
        out = generate(prompt_ids, prompt_mask, sampling)
        mask = out.response_mask.clone()
        mask[: sampling.n] = 0  # the first group: every response empty
        mask[sampling.n + 1] = 0  # the second group: one empty response
        return type(out)(
            **{
                **vars(out),
                "response_mask": mask,
                "response_ids": out.response_ids * mask,
                "log_probs": out.log_probs * mask,
            }
        )

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


def write_checkpoint(directory, cfg, *, world_size=1, train_data=(), garbage_in=None):
    """A checkpoint of ``cfg`` as save_checkpoint leaves it (its engine files stand-ins: a resume that gets as far
    as loading them has passed every check), the trainer's state complete."""
    (directory / "actor" / "ds").mkdir(parents=True)
    (directory / "actor" / "ds" / "model_states.pt").write_bytes(b"weights" * 100)
    config = state_config(cfg, world_size=world_size)
    step = int(directory.name.rpartition("_")[2])
    state = {
        "format": FORMAT,
        "dsrl_version": "0.1.0",
        "global_step": step,
        "world_size": world_size,
        "sampler": {"epoch": 0, "index": step},
        "kl_coef": 0.001,
        "skips": {"actor": {"total": 0, "consecutive": 0, "last_bad": {}}},
        "lr_schedulers": {"actor": {}},
        "frozen_checksums": {"actor": None},
        "mlflow_run_id": None,
        "save_contents": ["model", "optimizer", "extra"],
        "config": config,
        "config_hash": config_hash(config),
        "train_data": list(train_data),
    }
    digests = {name: sha256_file(directory / name) for name in _files(directory)}
    write_state(directory, state, digests)
    return directory


@pytest.fixture
def resume_setup(tiny_model_dir, arithmetic_data, world_of_one, tmp_path, monkeypatch):
    """(config overrides, a function that builds a Trainer of them): no model may load, so a Trainer that gets
    past the checks raises 'a model was loaded'."""
    import dsrl.trainer.loop
    import dsrl.trainer.setup
    from dsrl.config import load_and_validate

    def models_must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(dsrl.trainer.setup, "ActorEngine", models_must_not_load)
    base = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        "data.val_files=null",
        f"trainer.default_local_dir={tmp_path}",
    ]
    return base, lambda *overrides: dsrl.trainer.loop.Trainer(
        load_and_validate(recipe("grpo"), base + list(overrides), 1)[0]
    )


def test_resume_refuses_a_changed_run_before_any_model_loads(resume_setup, arithmetic_data, tmp_path):
    from dsrl.checkpoint.resume import data_identity
    from dsrl.config import load_and_validate

    base, build = resume_setup
    saved, _ = load_and_validate(recipe("grpo"), base, world_size=1)
    train_data = data_identity(str(arithmetic_data / "train.parquet"))
    write_checkpoint(step_dir(tmp_path, 2), saved, train_data=train_data)
    with pytest.raises(CheckpointError, match=r"settings differ from the checkpoint's:\n  trainer.seed: 1 -> 5\nfix:"):
        build("trainer.seed=5")
    with pytest.raises(AssertionError, match="a model was loaded"):  # past the checks, on to the models
        build("trainer.seed=5", "trainer.resume_allow_config_change=true")

    write_checkpoint(step_dir(tmp_path, 4), saved, world_size=8, train_data=train_data)
    with pytest.raises(
        CheckpointError,
        match="written by 8 ranks, this run has 1;.* set "
        r"trainer.resume_allow_world_size_change=true to convert it",
    ):
        build()
    with pytest.raises(AssertionError, match="a model was loaded"):  # the world size alone differs: allowed
        build("trainer.resume_allow_world_size_change=true")

    with pytest.raises(CheckpointError, match="not a complete dsrl checkpoint: no trainer_state.json"):
        build("trainer.resume_mode=resume_path", f"trainer.resume_from_path={arithmetic_data}")


def test_a_training_file_changed_since_the_checkpoint_is_refused_before_any_model_loads(resume_setup, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from dsrl.checkpoint.resume import data_identity
    from dsrl.config import load_and_validate

    base, build = resume_setup
    data = tmp_path / "data" / "train.parquet"
    data.parent.mkdir()
    shutil.copy(base[1].partition("=")[2], data)
    base[1] = f"data.train_files={data}"
    saved, _ = load_and_validate(recipe("grpo"), base, world_size=1)
    write_checkpoint(step_dir(tmp_path / "run", 2), saved, train_data=data_identity(str(data)))
    base[3] = f"trainer.default_local_dir={tmp_path / 'run'}"
    with pytest.raises(AssertionError, match="a model was loaded"):  # the same file: on to the models
        build()
    table = pq.read_table(data)
    pq.write_table(table.slice(0, table.num_rows - 8), data)  # shrunk
    with pytest.raises(CheckpointError, match=r"data.train_files changed since the checkpoint was written"):
        build()
    with pytest.raises(AssertionError, match="a model was loaded"):  # allowed
        build("trainer.resume_allow_config_change=true")


def test_auto_resume_falls_back_past_damaged_checkpoints_saying_why(
    resume_setup, arithmetic_data, tmp_path, caplog, monkeypatch
):
    import dsrl.trainer.setup
    from dsrl.checkpoint.resume import data_identity
    from dsrl.config import load_and_validate

    base, build = resume_setup
    saved, _ = load_and_validate(recipe("grpo"), base, world_size=1)
    train_data = data_identity(str(arithmetic_data / "train.parquet"))
    for step in (2, 4, 6):
        write_checkpoint(step_dir(tmp_path, step), saved, train_data=train_data)
    weights = step_dir(tmp_path, 6) / "actor" / "ds" / "model_states.pt"
    weights.write_bytes(b"garbage" * 100)  # the right size, other bytes
    state = step_dir(tmp_path, 4) / "trainer_state.json"
    state.write_text(state.read_text().replace('"index": 4', '"index": 3'))  # an edited sampler position
    import dsrl.checkpoint.resume

    chosen = []
    choose = dsrl.checkpoint.resume.checkpoint_to_resume
    monkeypatch.setattr(
        dsrl.trainer.setup, "checkpoint_to_resume", lambda *a: chosen.append(choose(*a)[0]) or (None, None)
    )
    with caplog.at_level("INFO", logger="dsrl"), pytest.raises(AssertionError, match="a model was loaded"):
        build()
    assert chosen == [step_dir(tmp_path, 2)]
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: skipping")]
    assert skipped == [
        f"resume: skipping {step_dir(tmp_path, 6)}: actor/ds/model_states.pt changed since it was written (its SHA-256 "
        "does not match)",
        f"resume: skipping {step_dir(tmp_path, 4)}: trainer_state.json was changed after it was written (its checksum "
        "does not match)",
    ]
    with pytest.raises(
        CheckpointError, match=r"global_step_4: not a complete dsrl checkpoint: trainer_state.json was changed"
    ):
        build("trainer.resume_mode=resume_path", f"trainer.resume_from_path={step_dir(tmp_path, 4)}")


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("sampler", {"epoch": 0}, "sampler.index is missing or not what dsrl writes there"),
        ("kl_coef", "0.1", "kl_coef is missing or not what dsrl writes there"),
        ("global_step", -1, "global_step is missing"),
        ("mlflow_run_id", 7, "mlflow_run_id is missing"),
        ("skips", {"actor": {"total": "0"}}, "skips is missing"),
        ("train_data", [{"path": "a"}], "train_data is missing"),
        ("config_hash", "0" * 64, "config does not match its config_hash"),
        ("lr_schedulers", {}, "lr_schedulers has no state of actor"),
        ("frozen_checksums", {"actor": "12"}, "frozen_checksums is missing"),
        ("frozen_checksums", {}, "frozen_checksums has no state of actor"),
    ],
)
def test_a_state_whose_fields_dsrl_would_not_write_is_refused(field, value, why):
    from dsrl.checkpoint.resume import fields_problem

    state = {
        "global_step": 2,
        "world_size": 1,
        "sampler": {"epoch": 0, "index": 2},
        "kl_coef": 0.1,
        "skips": {"actor": {"total": 0, "consecutive": 0, "last_bad": {}}},
        "lr_schedulers": {"actor": {}},
        "frozen_checksums": {"actor": -3},
        "mlflow_run_id": None,
        "save_contents": ["model"],
        "config": {"a": 1},
        "config_hash": config_hash({"a": 1}),
        "train_data": [],
    }
    assert fields_problem(state, ["actor"]) is None
    assert why in fields_problem({**state, field: value}, ["actor"])
