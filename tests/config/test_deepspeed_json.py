"""The DeepSpeed JSON checks at validation (before torch loads) and their one implementation, shared with
``build_ds_config`` (dsrl.config.deepspeed_json)."""

import json

import pytest

from dsrl import config as C
from dsrl.config.deepspeed_json import DeepSpeedJsonError, fill_ds_json
from tests.conftest import config_problems, recipe, run_train_without_torch, write_model_stub, write_parquet_stub

ACTOR = "actor_rollout_ref.actor.deepspeed_config"
TRAINED = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}  # the least a training engine takes


@pytest.fixture
def files(tmp_path):
    write_parquet_stub(tmp_path / "train.parquet")
    write_model_stub(tmp_path / "model")
    return [
        f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=null",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
    ]


def ds_file(tmp_path, ds, name="ds.json"):
    path = tmp_path / name
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    return path


def violations(name, overrides, world_size=1):
    return config_problems(recipe(name), overrides, world_size)


def test_auto_keys_are_filled_from_the_run_config():
    """grpo under the CPU overlay: mini-batch 8 prompts x n=5 = 40 sequences, micro-batches of 4."""
    cfg = C.load_config(
        recipe("grpo"), ["actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.grad_clip=0.5"]
    )
    actor = cfg.actor_rollout_ref.actor
    ds = fill_ds_json(
        "zero3",
        key=ACTOR,
        prefix="actor_rollout_ref.actor",
        world_size=2,
        micro_batch_size_per_gpu=4,
        gradient_accumulation_steps=5,
        dtype="bfloat16",
        optim=actor.optim,
        grad_clip=0.5,
    )
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        4,
        5,
        40,
    )
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


@pytest.mark.parametrize(
    "ds, rule",
    [
        ({**TRAINED, "fp16": {"enabled": True}}, "fp16 is not supported; fix: remove the fp16 section"),
        ({**TRAINED, "fp16": {"enabled": "auto"}}, "fp16 is not supported"),
        (
            {**TRAINED, "scheduler": {"type": "WarmupLR"}},
            "a DeepSpeed scheduler is refused: dsrl steps the lr once per training step",
        ),
        (
            {"zero_optimization": {"stage": 2}},
            'a training engine needs an "optimizer" section; fix: copy it from ds_configs/zero3_offload.json',
        ),
        ({"optimizer": {"type": "AdamW"}}, "zero_optimization.stage=0: a training engine needs ZeRO stage 1, 2 or 3"),
        ({**TRAINED, "zero_optimization": {"stage": 4}}, "zero_optimization.stage=4: must be 0, 1, 2 or 3"),
        (
            {**TRAINED, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param moves parameters under ZeRO stage 3 only; stage 2 ignores it",
        ),
        (
            {**TRAINED, "zero_optimization": {"stage": 2, "compute_grad_norm": False}},
            "zero_optimization.compute_grad_norm=false turns off the gradient norm",
        ),
        (
            {**TRAINED, "bf16": {"check_grad_overflow": False}},
            "bf16.check_grad_overflow=false would apply optimizer steps",
        ),
        (
            {**TRAINED, "bf16": {"enabled": True}},  # the CPU overlay trains in float32
            "bf16.enabled=true disagrees with the run config (actor_rollout_ref.model.dtype gives false); fix: set "
            'bf16.enabled to "auto"',
        ),
        (
            {**TRAINED, "train_micro_batch_size_per_gpu": 2},
            "train_micro_batch_size_per_gpu=2 disagrees with the run config (the actor_rollout_ref.actor batch "
            "geometry at world size 1 gives 4)",
        ),
        (
            {**TRAINED, "gradient_clipping": 2.0},
            "gradient_clipping=2.0 disagrees with the run config (actor_rollout_ref.actor.optim.clip_grad gives 1.0)",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}},
            "optimizer.params.lr=0.1 disagrees with the run config (actor_rollout_ref.actor.optim.lr gives 0.0001)",
        ),
        ({**TRAINED, "optimizer": "AdamW"}, "optimizer must be a JSON object"),
        ([1, 2], "holds a JSON list, not an object of DeepSpeed settings"),
    ],
)
def test_validation_refuses_a_bad_deepspeed_json_at_its_key(files, tmp_path, ds, rule):
    path = ds_file(tmp_path, ds)
    found = [v for v in violations("grpo", files + [f"{ACTOR}={path}"]) if v.startswith(f"{ACTOR}={path}: ")]
    assert any(rule in v for v in found), found
    assert all("; fix: " in v for v in found)


def test_every_problem_of_a_file_is_listed_at_once(files, tmp_path):
    path = ds_file(tmp_path, {"fp16": {"enabled": True}, "scheduler": {}, "train_micro_batch_size_per_gpu": 2})
    found = violations("grpo", files + [f"{ACTOR}={path}"])
    rules = [v.removeprefix(f"{ACTOR}={path}: ").split(";")[0] for v in found]
    assert rules == [
        "fp16 is not supported",
        "train_micro_batch_size_per_gpu=2 disagrees with the run config (the actor_rollout_ref.actor batch geometry at "
        "world size 1 gives 4)",
        'a training engine needs an "optimizer" section',
        "a DeepSpeed scheduler is refused: dsrl steps the lr once per training step from actor_rollout_ref.actor.optim",
        "zero_optimization.stage=0: a training engine needs ZeRO stage 1, 2 or 3 (dsrl relies on its check that skips "
        "steps with a non-finite gradient norm)",
    ]


def test_a_file_that_is_not_json_is_one_problem_naming_the_file_and_the_position(files, tmp_path):
    path = ds_file(tmp_path, '{\n  "optimizer": {"type": "AdamW",}\n}')  # column 33 of line 2: the "}" after a ","
    assert violations("grpo", files + [f"{ACTOR}={path}"]) == [
        f"{ACTOR}={path}: {path} is not valid JSON: Expecting property name enclosed in double quotes at line 2, "
        "column 33; fix: correct the JSON syntax there"
    ]


def test_the_batch_geometry_is_checked_for_the_world_size(files, tmp_path):
    """40 sequences per mini-batch in micro-batches of 4: 10 accumulation steps on one rank, 5 on each of two."""
    path = ds_file(tmp_path, {**TRAINED, "gradient_accumulation_steps": 5})
    assert violations("grpo", files + [f"{ACTOR}={path}"], world_size=2) == []
    [v] = violations("grpo", files + [f"{ACTOR}={path}"], world_size=1)
    assert v.startswith(f"{ACTOR}={path}: gradient_accumulation_steps=5 disagrees with the run config")
    assert "gives 10)" in v


def test_the_reference_json_must_not_train_and_is_checked_only_when_the_reference_is_built(files):
    """grpo's KL loss builds the reference; zero3 has an optimizer section."""
    ref = "actor_rollout_ref.ref.deepspeed_config"
    [v] = violations("grpo", files + [f"{ref}=zero3"])
    assert v == (
        f"{ref}=zero3: this engine never trains, so its DeepSpeed config must have no optimizer section; "
        "fix: use zero3_offload_inference or remove the section"
    )
    assert violations("grpo", files + [f"{ref}=zero3", "actor_rollout_ref.actor.use_kl_loss=false"]) == []


def test_the_critic_json_is_checked_with_gae_only(files, tmp_path):
    path = ds_file(tmp_path, {"zero_optimization": {"stage": 3}})
    critic = [files[2].replace("actor_rollout_ref.model.path", "critic.model.path")]
    [v] = violations("ppo", files + critic + [f"critic.deepspeed_config={path}"])
    assert v.startswith(f'critic.deepspeed_config={path}: a training engine needs an "optimizer" section')
    assert violations("grpo", files + [f"critic.deepspeed_config={path}"]) == []


def test_the_shipped_jsons_pass_for_every_role():
    cfg = C.load_config(recipe("ppo"), [])
    for name in ("zero2", "zero3", "zero3_offload"):
        ds = fill_ds_json(
            name,
            key="critic.deepspeed_config",
            prefix="critic",
            world_size=8,
            micro_batch_size_per_gpu=4,
            gradient_accumulation_steps=1,
            dtype="bfloat16",
            optim=cfg.critic.optim,
            grad_clip=1.0,
        )
        assert ds["train_batch_size"] == 32 and ds["optimizer"]["params"]["lr"] == cfg.critic.optim.lr
    ref = fill_ds_json(
        "zero3_offload_inference",
        key="actor_rollout_ref.ref.deepspeed_config",
        prefix="actor_rollout_ref.ref",
        world_size=8,
        micro_batch_size_per_gpu=8,
        gradient_accumulation_steps=1,
        dtype="float32",
    )
    assert ref["train_batch_size"] == 64 and ref["bf16"]["enabled"] is False and "optimizer" not in ref


def test_the_error_lists_every_problem_as_violation_lines():
    with pytest.raises(DeepSpeedJsonError) as err:
        fill_ds_json(
            "zero3",
            key="k",
            prefix="p",
            world_size=1,
            micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            dtype="float32",
        )
    assert isinstance(err.value, ValueError)
    assert (
        str(err.value)
        == "k=zero3: this engine never trains, so its DeepSpeed config must have no optimizer section; fix: use "
        "zero3_offload_inference or remove the section"
    )
    assert err.value.problems == [
        (
            "this engine never trains, so its DeepSpeed config must have no optimizer section",
            "use zero3_offload_inference or remove the section",
        )
    ]


def test_validate_only_refuses_a_bad_json_without_importing_torch(files, tmp_path):
    path = ds_file(
        tmp_path, {"fp16": {"enabled": True}, "scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 2}}
    )
    result = run_train_without_torch([*recipe("grpo"), *files, f"{ACTOR}={path}", "--validate-only"], WORLD_SIZE="1")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "3 problem(s) in the configuration" in result.stderr
    assert f"  {ACTOR}={path}: fp16 is not supported; fix: remove the fp16 section" in result.stderr
    assert f"  {ACTOR}={path}: a DeepSpeed scheduler is refused" in result.stderr


def test_build_ds_config_raises_what_validation_reports(world_of_one, files, tmp_path):
    """One implementation: the engine's builder and validation give the same lines for the same file."""
    from dsrl.engines.deepspeed_setup import build_ds_config

    path = ds_file(tmp_path, {"optimizer": {"type": "AdamW"}, "scheduler": {}, "gradient_clipping": 2.0})
    cfg = C.load_config(recipe("grpo"), files + [f"{ACTOR}={path}"])
    actor = cfg.actor_rollout_ref.actor
    with pytest.raises(ValueError) as err:
        build_ds_config(
            str(path),
            key=ACTOR,
            micro_batch_size_per_gpu=4,
            gradient_accumulation_steps=10,
            dtype="float32",
            optim=actor.optim,
            grad_clip=1.0,
            prefix="actor_rollout_ref.actor",
        )
    assert str(err.value).splitlines() == violations("grpo", files + [f"{ACTOR}={path}"])
