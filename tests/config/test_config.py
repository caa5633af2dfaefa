"""The config system: loading, overrides, every validation rule's error path, the shipped YAMLs, scripts/train.py."""

import functools
import os
import re
import runpy
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from omegaconf.errors import ReadonlyConfigError

from dsrl import config as C
from dsrl.config import loading
from dsrl.config.problems import show
from tests.conftest import QUICKSTART, recipe, run_train_without_torch, stub_file_overrides, write_parquet_stub

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "quickstart", "calculator_cpu", "smollm2", "distill_cpu", "ppo_rm_cpu")  # applied on top of a recipe
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem not in OVERLAYS)
TRAIN = str(REPO / "scripts" / "train.py")


@pytest.fixture
def files(tmp_path):
    """Overrides pointing every file key at files that exist (the shipped YAMLs name outputs/ ones)."""
    return stub_file_overrides(tmp_path)


def critic_path(files):
    return [files[2].replace("actor_rollout_ref.model.path", "critic.model.path")]


def problems(name, overrides, world_size=1):
    """The violations of configs/<name>.yaml under the CPU overlay with ``overrides``; [] when it loads."""
    try:
        C.load_and_validate(recipe(name), overrides, world_size)
    except C.ConfigError as err:
        return err.violations
    return []


def about(violations, key):
    """The violations whose dotted key is ``key``."""
    return [v for v in violations if v.startswith(f"{key}=")]


# ---------------------------------------------------------------- the tree


def test_every_key_is_documented():
    assert len(C.SCHEMA) > 100
    undocumented = [key for key, info in C.SCHEMA.items() if len(info.help.split()) < 2]
    assert undocumented == []


def test_config_module_does_not_import_torch():
    code = "import sys, dsrl.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_defaults_follow_the_spec():
    cfg = C.load_config(None, [])
    assert cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.actor.deepspeed_config == "zero3_offload"
    assert cfg.actor_rollout_ref.ref.deepspeed_config == "zero3_offload_inference"
    assert cfg.critic.optim.lr == 1e-5 and cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert list(cfg.actor_rollout_ref.actor.optim.betas) == [0.9, 0.999]
    assert C.to_dict(cfg)["trainer"]["default_local_dir"] == "checkpoints/dsrl/default"


# ---------------------------------------------------------------- loading and overrides


def test_overrides_parse_like_omegaconf_dotlist(files):
    cfg, _ = C.load_and_validate(
        None,
        files
        + critic_path(files)
        + [
            "actor_rollout_ref.actor.optim.lr=1e-4",
            "actor_rollout_ref.actor.optim.betas=[0.8,0.95]",
            "trainer.logger=[console,mlflow]",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "trainer.total_training_steps=null",
            "data.shuffle=false",
            "data.train_batch_size=16",
            "trainer.experiment_name=run-1",
        ],
        1,
    )
    actor = cfg.actor_rollout_ref.actor
    assert actor.optim.lr == pytest.approx(1e-4) and isinstance(actor.optim.lr, float)
    assert list(actor.optim.betas) == [0.8, 0.95]
    assert list(cfg.trainer.logger) == ["console", "mlflow"]
    assert actor.clip_ratio_high == 0.28 and actor.clip_ratio_low == 0.2
    assert cfg.trainer.total_training_steps is None
    assert cfg.data.shuffle is False and cfg.data.train_batch_size == 16
    assert C.to_dict(cfg)["trainer"]["default_local_dir"] == "checkpoints/dsrl/run-1"


def test_a_list_of_train_files_is_accepted(files, tmp_path):
    write_parquet_stub(tmp_path / "more.parquet")
    cfg, _ = C.load_and_validate(
        None,
        files + critic_path(files) + [f"data.train_files=[{tmp_path / 'train.parquet'},{tmp_path / 'more.parquet'}]"],
        1,
    )
    assert len(cfg.data.train_files) == 2


def test_overrides_win_over_the_yaml_file(files):
    cfg, _ = C.load_and_validate(recipe("grpo"), files + ["actor_rollout_ref.rollout.n=4"], 1)
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.algorithm.adv_estimator == "grpo"


def test_files_merge_left_to_right(files, tmp_path):
    """A recipe, the CPU overlay, then a file of one's own: each later file wins on the keys it sets."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  train_batch_size: 16\n")
    cfg, _ = C.load_and_validate([*recipe("grpo"), str(mine)], files, 1)
    assert cfg.data.train_batch_size == 16  # mine
    assert cfg.actor_rollout_ref.model.dtype == "float32" and cfg.actor_rollout_ref.rollout.name == "hf"  # cpu.yaml
    assert cfg.actor_rollout_ref.actor.kl_loss_coef == 0.001 and cfg.actor_rollout_ref.rollout.n == 5  # grpo.yaml
    quickstart, _ = C.load_and_validate(QUICKSTART, files, 1)
    assert quickstart.data.train_batch_size == 32 and quickstart.actor_rollout_ref.actor.use_kl_loss is False


def test_a_recipe_name_stands_for_the_shipped_file(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anywhere: an installed dsrl finds its recipes in the package
    by_name = C.load_config(["grpo", "cpu"], files)
    by_path = C.load_config(recipe("grpo"), files)
    assert C.to_dict(by_name) == C.to_dict(by_path)
    (tmp_path / "grpo").mkdir()  # a path that exists is a path, never a recipe name
    with pytest.raises(C.ConfigError, match=r"config file grpo: not a regular file \(a directory\)"):
        C.load_config(["grpo"], files)
    shipped = r"shipped recipe \(calculator_cpu, cpu, dapo, distill, distill_cpu, grpo, "
    with pytest.raises(C.ConfigError, match=r"config file nope: cannot be read .*" + shipped):
        C.load_config(["nope"], files)


def test_unknown_override_key_suggests_the_closest():
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["actor_rollout_ref.actor.ppo_mini_batchsize=4", "data.train_batchsize=4"])
    assert err.value.violations == [
        "actor_rollout_ref.actor.ppo_mini_batchsize=4: unknown key; fix: did you mean "
        "actor_rollout_ref.actor.ppo_mini_batch_size?",
        "data.train_batchsize=4: unknown key; fix: did you mean data.train_batch_size?",
    ]


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  adv_estimater: grpo\nactor_rollout_ref:\n  rollout:\n    temprature: 0.7\n")
    with pytest.raises(C.ConfigError) as err:
        C.load_config(str(path), [])
    assert (
        "algorithm.adv_estimater=grpo: unknown key; fix: did you mean algorithm.adv_estimator?" in err.value.violations
    )
    assert any("did you mean actor_rollout_ref.rollout.temperature?" in v for v in err.value.violations)


@pytest.mark.parametrize(
    "override, wanted",
    [
        (
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.deepspeed_config: zero3_offload",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            "actor_rollout_ref.actor.deepspeed_config: zero3_offload",
        ),
        (
            "actor_rollout_ref.ref.fsdp_config.param_offload=true",
            "actor_rollout_ref.ref.deepspeed_config: zero3_offload_inference",
        ),
        ("critic.model.fsdp_config.param_offload=true", "critic.deepspeed_config: zero3_offload"),
        (
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",
            "actor_rollout_ref.actor.deepspeed_config",
        ),
        ("critic.zero_stage=3", "critic.deepspeed_config: zero2 (stage 2) | zero3 (stage 3) | zero3_offload"),
        ("actor_rollout_ref.ref.offload=true", "actor_rollout_ref.ref.deepspeed_config"),
        ("actor_rollout_ref.rollout.response_length=512", "set data.max_response_length"),
        ("actor_rollout_ref.rollout.prompt_length=512", "set data.max_prompt_length"),
        ("actor_rollout_ref.actor.optim.total_training_steps=10", "trainer.total_training_steps"),
        ("critic.optim.zero_indexed_step=false", "remove it"),
        ("data.return_raw_chat=true", "remove it (the prompt the model sees is the same)"),
        (
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        ),
        ("reward_model.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
        ("trainer.n_gpus_per_node=8", "deepspeed --num_gpus N"),
        ("trainer.nnodes=2", "--hostfile FILE"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
        ("actor_rollout_ref.model.use_fused_kernels=false", "actor_rollout_ref.actor.use_fused_kernels"),
        ("actor_rollout_ref.actor.compute_sum_pi_squared=true", "actor_rollout_ref.actor.calculate_sum_pi_squared"),
        ("actor_rollout_ref.actor.engine.pad_to_length=true", "use_remove_padding=true packs"),
        ("actor_rollout_ref.actor.engine.pad_to_length_bucket=256", "remove it"),
    ],
)
def test_verl_only_keys_name_the_dsrl_equivalent(override, wanted):
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, [override])
    [violation] = err.value.violations
    assert violation.startswith(override + ": ")
    assert wanted in violation.split("; fix: ")[1]


def test_fsdp_section_in_yaml_reports_each_key(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  actor:\n    fsdp_config:\n      param_offload: true\n      optimizer_offload: true\n"
    )
    with pytest.raises(C.ConfigError) as err:
        C.load_config(str(path), [])
    assert [v.split(":")[0] for v in err.value.violations] == [
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    ]
    assert all("actor_rollout_ref.actor.deepspeed_config: zero3_offload" in v for v in err.value.violations)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.train_batch_size=abc", "data.train_batch_size=abc: expected an integer"),
        ("data.train_batch_size=null", "data.train_batch_size=null: expected an integer"),
        ("actor_rollout_ref.actor.clip_ratio=wide", "actor_rollout_ref.actor.clip_ratio=wide: expected a number"),
        ("data.val_batch_size=x", "data.val_batch_size=x: expected an integer or null"),
        (
            "actor_rollout_ref.actor.optim.betas=[0.9,x]",
            "actor_rollout_ref.actor.optim.betas=[0.9,x]: expected a list of numbers",
        ),
        ("trainer.logger=console", "trainer.logger=console: expected a list of strings"),
        ("data.shuffle=maybe", "data.shuffle=maybe: expected true or false"),
        ("actor_rollout_ref.actor.optim=3", "actor_rollout_ref.actor.optim=3: expected a mapping of lr, weight_decay"),
    ],
)
def test_type_errors_are_violations(override, expected):
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, [override])
    [violation] = err.value.violations
    assert violation.startswith(expected)


def test_malformed_overrides_and_files(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("data: [unclosed\n")
    with pytest.raises(C.ConfigError) as err:
        C.load_config(str(bad_yaml), ["data.train_batch_size", "data.val_files=[a,"])
    found = err.value.violations
    assert len(found) == 3
    assert found[0].startswith(f"config file {bad_yaml}: not valid YAML")
    assert found[1].startswith("override data.train_batch_size: not key=value")
    assert found[2].startswith("data.val_files=[a,: not a valid value")
    with pytest.raises(C.ConfigError, match="cannot be read"):
        C.load_config(str(tmp_path / "absent.yaml"), [])


def test_bad_interpolation_is_a_violation():
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["trainer.experiment_name=${trainer.nope}"])
    [violation] = err.value.violations
    assert violation.startswith("trainer.experiment_name=${trainer.nope}: cannot be resolved")


# ---------------------------------------------------------------- the shipped YAMLs


def test_every_algorithm_has_a_config():
    assert set(CONFIGS) == {"ppo", "grpo", "rloo", "reinforce_pp", "opo", "otb", "tir_otb", "dapo", "grpo_lora",
                            "grpo_moe", "distill", "ppo_rm"}  # fmt: skip


@pytest.mark.parametrize("world_size", [8, 4, 2, 1])
@pytest.mark.parametrize("name", CONFIGS)
def test_each_recipe_runs_as_written_on_8_4_2_and_1_gpus(name, world_size, gsm8k_checkout):
    _, notes = C.load_and_validate(str(REPO / "configs" / f"{name}.yaml"), [], world_size)
    assert notes == []  # nothing for dsrl to switch on: the recipes say it all
    assert (REPO / "configs" / f"{name}.yaml").read_text().startswith("# ")  # what it is, and the paper


@pytest.mark.parametrize("world_size", [2, 1])
@pytest.mark.parametrize("name", CONFIGS)
def test_each_recipe_runs_under_the_cpu_overlay(name, world_size, files):
    cfg, _ = C.load_and_validate(recipe(name), files, world_size)
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.actor_rollout_ref.model.dtype == "float32"


def test_the_docs_gpu_command_validates_as_written(gsm8k_checkout):
    """docs/getting-started.md: deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml (after prepare_data.py --task
    gsm8k)."""
    page = (REPO / "docs" / "getting-started.md").read_text()
    assert "deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml\n" in page
    result = subprocess.run(
        [sys.executable, TRAIN, str(REPO / "configs" / "opo.yaml"), "--validate-only", "--world-size", "8"],
        capture_output=True,
        text=True,
        cwd=gsm8k_checkout,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["actor_rollout_ref"]["rollout"]["name"] == "vllm"


def test_recipes_point_at_qwen_and_the_gsm8k_files_prepare_data_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh checkout: the data is not prepared yet
    for name in CONFIGS:
        cfg = C.load_config(str(REPO / "configs" / f"{name}.yaml"), [])
        moe = name == "grpo_moe"  # the mixture-of-experts recipe
        assert cfg.actor_rollout_ref.model.path == ("Qwen/Qwen3-30B-A3B" if moe else "Qwen/Qwen2.5-0.5B-Instruct")
        assert cfg.data.train_files == "outputs/data/gsm8k/train.parquet"
        assert cfg.data.val_files == "outputs/data/gsm8k/test.parquet"
        violations = C.validate(cfg, 8)
        assert about(violations, "data.train_files")[0].endswith("python scripts/prepare_data.py --task gsm8k")
        assert about(violations, "actor_rollout_ref.model.path") == []  # a hub id


def test_the_cpu_overlay_points_at_the_tiny_model_and_arithmetic_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh checkout: the model and data are not built yet
    cfg = C.load_config(recipe("ppo"), [])
    assert cfg.actor_rollout_ref.model.path == "./outputs/tiny_model"
    assert C.to_dict(cfg)["critic"]["model"]["path"] == "./outputs/tiny_model"  # the recipe's critic follows
    assert cfg.data.train_files == "outputs/data/arithmetic/train.parquet"
    assert cfg.data.val_files == "outputs/data/arithmetic/test.parquet"
    violations = C.validate(cfg, 1)
    assert about(violations, "data.train_files")[0].endswith("python scripts/prepare_data.py --task arithmetic")
    assert "python scripts/make_tiny_model.py" in about(violations, "actor_rollout_ref.model.path")[0]


GPU_NODE = {  # every recipe: what an 8-GPU node runs
    "actor_rollout_ref.model.dtype": "bfloat16",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.deepspeed_config": "zero3",
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.enable_sleep_mode": True,
    "actor_rollout_ref.rollout.sleep_level": 2,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
}
RECOMMENDED = {
    "ppo": {
        "algorithm.adv_estimator": "gae",
        "algorithm.gamma": 1.0,
        "algorithm.lam": 1.0,
        "actor_rollout_ref.actor.clip_ratio": 0.2,
        "critic.cliprange_value": 0.5,
        "critic.model.path": "Qwen/Qwen2.5-0.5B-Instruct",
        "data.train_batch_size": 256,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
        "critic.ppo_mini_batch_size": 64,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 512,
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "critic.optim.lr": 1e-5,
    },
    "grpo": {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
        "actor_rollout_ref.actor.kl_loss_coef": 0.001,
        "actor_rollout_ref.rollout.n": 5,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "critic.model.path": None,
    },
    "rloo": {
        "algorithm.adv_estimator": "rloo",
        "algorithm.use_kl_in_reward": True,
        "actor_rollout_ref.rollout.n": 5,
        "critic.model.path": None,
    },
    "reinforce_pp": {
        "algorithm.adv_estimator": "reinforce_plus_plus",
        "actor_rollout_ref.actor.kl_loss_type": "mse",
        "actor_rollout_ref.rollout.n": 5,
    },
    "opo": {
        "algorithm.adv_estimator": "opo",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1024,
        "data.train_batch_size": 1024,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.kl_loss_coef": 0.0,
        "algorithm.use_kl_in_reward": False,
    },
    "otb": {
        "algorithm.adv_estimator": "optimal_token_baseline",
        "actor_rollout_ref.actor.calculate_sum_pi_squared": True,
        "actor_rollout_ref.rollout.n": 8,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 24576,
        "algorithm.use_kl_in_reward": False,
        "actor_rollout_ref.actor.use_fused_kernels": False,
    },
    "dapo": {  # the paper's and verl's DAPO script's numbers (the batch sizes are verl's, unscaled)
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.clip_ratio_low": 0.2,
        "actor_rollout_ref.actor.clip_ratio_high": 0.28,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.use_kl_loss": False,
        "algorithm.use_kl_in_reward": False,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.rollout.n": 16,
        "data.train_batch_size": 512,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 10,
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.max_num_gen_batches": 10,
        "reward_model.reward_manager": "dapo",
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable": True,
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": 1.0,
        "critic.model.path": None,
    },
}


@pytest.mark.parametrize("name", sorted(RECOMMENDED))
def test_shipped_config_has_the_recommended_settings(name):
    cfg = C.to_dict(C.load_config(str(REPO / "configs" / f"{name}.yaml"), []))
    for key, value in {**GPU_NODE, **RECOMMENDED[name]}.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == value, key


# ---------------------------------------------------------------- rules


def test_all_violations_are_reported_at_once(files):
    found = problems(
        "grpo",
        files
        + [
            "data.train_batch_size=abc",
            "algorithm.adv_estimatr=grpo",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.clip_ratio_c=0.5",
            "data.truncation=middle",
            "trainer.logger=[console,wandb]",
        ],
    )
    assert [v.split("=")[0] for v in found] == [
        "data.train_batch_size",
        "algorithm.adv_estimatr",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.clip_ratio_c",
        "data.truncation",
        "trainer.logger",
    ]
    for violation in found:
        assert "\n" not in violation and "; fix: " in violation


def test_missing_required_values():
    violations = C.validate(C.load_config(None, []), 1)
    assert about(violations, "data.train_files")[0].startswith(
        "data.train_files=???: required; fix: set data.train_files"
    )
    assert about(violations, "actor_rollout_ref.model.path")[0].startswith("actor_rollout_ref.model.path=???: required")


def test_train_batch_size_must_split_over_ranks(files):
    [v] = about(
        problems("grpo", files + ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"], 4),
        "data.train_batch_size",
    )
    assert v.startswith("data.train_batch_size=6: must be divisible by the world size 4") and "e.g. 8" in v


def test_mini_batch_must_split_over_ranks(files):
    [v] = about(
        problems("grpo", files + ["actor_rollout_ref.actor.ppo_mini_batch_size=2"], 4),
        "actor_rollout_ref.actor.ppo_mini_batch_size",
    )
    assert "divisible by the world size 4" in v


def test_mini_batch_must_divide_the_batch(files):
    [v] = about(
        problems("grpo", files + ["actor_rollout_ref.actor.ppo_mini_batch_size=3"]),
        "actor_rollout_ref.actor.ppo_mini_batch_size",
    )
    assert "must divide data.train_batch_size=8" in v


def test_micro_batch_must_divide_the_per_rank_mini_batch(files):
    # grpo.yaml on the CPU overlay: 8 prompts per mini-batch x 5 responses over 2 ranks = 20 sequences per rank
    [v] = about(
        problems("grpo", files + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"], 2),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    )
    assert "8*5/2 = 20 sequences" in v and "e.g. 5" in v
    assert problems("grpo", files + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=20"], 2) == []


def test_dynamic_batch_size_replaces_the_micro_batch_rule_by_a_token_budget(files):
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"]
    assert problems("grpo", files + dynamic) == []
    [v] = problems("grpo", files + dynamic + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"])
    assert (
        v.startswith("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100: must hold one whole sequence")
        and "at least 144" in v
    )


@pytest.mark.parametrize(
    "key",
    [
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_epochs",
        "data.max_response_length",
        "data.val_batch_size",
    ],
)
def test_sizes_must_be_positive(files, key):
    assert about(problems("grpo", files + [f"{key}=0"]), key)


def test_critic_batch_geometry_is_checked_for_gae_only(files):
    bad = ["critic.ppo_mini_batch_size=3", "critic.ppo_micro_batch_size_per_gpu=5"]
    found = problems("ppo", files + critic_path(files) + bad)
    assert [v.split("=")[0] for v in found] == ["critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu"]
    found = problems("ppo", files + critic_path(files) + ["critic.ppo_micro_batch_size_per_gpu=3"])
    assert about(found, "critic.ppo_micro_batch_size_per_gpu")[0].count("= 8 sequences") == 1
    assert problems("grpo", files + bad) == []  # no critic is built


@pytest.mark.parametrize("estimator", C.GROUP_ESTIMATORS)
def test_group_estimators_need_several_responses(files, estimator):
    found = problems("opo", files + [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"])
    [v] = about(found, "actor_rollout_ref.rollout.n")
    assert f"{estimator} compares the responses to the same prompt" in v


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "remax"])
def test_other_estimators_run_with_one_response(files, estimator):
    assert problems("opo", files + [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"]) == []


def test_gae_needs_a_critic(files):
    [v] = problems("ppo", files + ["critic.model.path=null"])
    assert v.startswith("critic.model.path=null: gae learns a value function")


def test_critic_free_estimators_refuse_a_critic(files):
    found = problems("grpo", files + critic_path(files) + ["trainer.critic_warmup=2"])
    [v] = about(found, "critic.model.path")
    assert "grpo uses no critic, so none would be trained; fix: set critic.model.path=null" in v
    assert about(found, "trainer.critic_warmup")


@pytest.mark.parametrize("estimator", C.SUM_PI_SQUARED_ESTIMATORS)
def test_otb_turns_on_sum_pi_squared_and_says_so(files, estimator):
    cfg, notes = C.load_and_validate(
        recipe("otb"),
        files + [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.calculate_sum_pi_squared=false"],
        1,
    )
    assert cfg.actor_rollout_ref.actor.calculate_sum_pi_squared is True
    assert notes == [
        f"actor_rollout_ref.actor.calculate_sum_pi_squared set to true: {estimator} needs sum_pi_squared "
        "(its token weights 1 - 2*pi + sum pi^2)"
    ]
    assert "calculate_sum_pi_squared: true" in C.to_yaml(cfg)


@pytest.mark.parametrize("estimator", ["grpo", *C.SUM_PI_SQUARED_ESTIMATORS])
def test_the_fused_head_validates_for_every_estimator(files, estimator):
    fused = [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.use_fused_kernels=true"]
    assert problems("otb" if estimator != "grpo" else "grpo", files + fused) == []


def test_opo_refuses_off_policy_training_unless_allowed(files):
    off_policy = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=2"]
    found = problems("opo", files + off_policy)
    assert [v.split("=")[0] for v in found] == [
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_epochs",
    ]
    assert all("opo trains exactly on-policy" in v and "opo_allow_off_policy=true" in v for v in found)
    assert problems("opo", files + off_policy + ["algorithm.opo_allow_off_policy=true"]) == []


def test_dual_clip_bound_must_exceed_one(files):
    [v] = problems("grpo", files + ["actor_rollout_ref.actor.clip_ratio_c=1.0"])
    assert v.startswith("actor_rollout_ref.actor.clip_ratio_c=1.0: must be > 1")


def test_clip_ratio_low_and_high_fall_back_to_clip_ratio(files):
    cfg, _ = C.load_and_validate(
        None,
        files
        + critic_path(files)
        + ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28"],
        1,
    )
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.3
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    printed = yaml.safe_load(C.to_yaml(cfg))["actor_rollout_ref"]["actor"]
    assert (printed["clip_ratio_low"], printed["clip_ratio_high"]) == (0.3, 0.28)


@pytest.mark.parametrize(
    "key, value, names",
    [
        ("algorithm.adv_estimator", "ppo", C.ADV_ESTIMATORS),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "dapo", C.POLICY_LOSS_MODES),
        ("actor_rollout_ref.actor.loss_agg_mode", "mean", C.LOSS_AGG_MODES),
        ("critic.loss_agg_mode", "mean", C.LOSS_AGG_MODES),
        ("actor_rollout_ref.actor.kl_loss_type", "k4", C.KL_KINDS),
        ("algorithm.kl_penalty", "k4", C.KL_KINDS),
        ("algorithm.kl_ctrl.type", "pid", C.KL_CTRL_TYPES),
        ("data.truncation", "middle", C.TRUNCATION_MODES),
        ("actor_rollout_ref.rollout.name", "sglang", C.ROLLOUT_NAMES),
        ("actor_rollout_ref.model.dtype", "float16", C.MODEL_DTYPES),
    ],
)
def test_unknown_names_list_the_known_ones(files, key, value, names):
    [v] = about(problems("grpo", files + [f"{key}={value}"]), key)
    assert v.startswith(f"{key}={value}: ") and v.endswith(", ".join(names))


def test_known_names():
    assert set(C.KL_KINDS) == {
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
        "kl+",
        "k1+",
        "abs+",
        "mse+",
        "k2+",
        "low_var_kl+",
        "k3+",
    }
    assert set(C.GROUP_ESTIMATORS) < set(C.ADV_ESTIMATORS) and set(C.SUM_PI_SQUARED_ESTIMATORS) < set(
        C.GROUP_ESTIMATORS
    )


def test_straight_through_kl_kinds_are_accepted(files):
    assert (
        problems("grpo", files + ["actor_rollout_ref.actor.kl_loss_type=low_var_kl+", "algorithm.kl_penalty=k1+"]) == []
    )


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_penalty"])
def test_full_kl_is_refused_with_the_reason(files, key):
    [v] = problems("grpo", files + [f"{key}=full"])
    assert v.startswith(f"{key}=full: ") and "sampled-token log-probs" in v


def test_adaptive_kl_controller_needs_a_horizon(files):
    found = problems("rloo", files + ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"])
    assert [v.split("=")[0] for v in found] == ["algorithm.kl_ctrl.horizon"]
    assert problems("rloo", files + ["algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.horizon=0"]) == []


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.optim.lr=0",
        "actor_rollout_ref.actor.optim.betas=[0.9]",
        "actor_rollout_ref.actor.optim.weight_decay=-1",
        "actor_rollout_ref.actor.grad_clip=-1",
        "actor_rollout_ref.actor.clip_ratio=0",
        "actor_rollout_ref.actor.clip_ratio_low=1.0",
        "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.top_p=0",
        "actor_rollout_ref.rollout.gpu_memory_utilization=1.5",
        "algorithm.gamma=1.1",
        "actor_rollout_ref.actor.kl_loss_coef=-0.1",
        "trainer.save_freq=0",
        "trainer.total_epochs=0",
        "trainer.total_training_steps=0",
        "algorithm.lam=-0.1",
        "algorithm.kl_ctrl.kl_coef=-1",
        "actor_rollout_ref.actor.clip_ratio_high=0",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=linear",
        "actor_rollout_ref.actor.optim.warmup_style=wsd",
        "actor_rollout_ref.actor.optim.min_lr_ratio=2",
        "actor_rollout_ref.actor.optim.num_cycles=0",
        "actor_rollout_ref.actor.optim.clip_grad=-1",
        "actor_rollout_ref.rollout.top_k=0",
        "actor_rollout_ref.rollout.val_kwargs.n=0",
        "actor_rollout_ref.rollout.val_kwargs.temperature=-1",
        "data.prompt_key=''",
        "trainer.experiment_name=''",
    ],
)
def test_numbers_out_of_range(files, override):
    key = override.split("=")[0]
    [v] = problems("grpo", files + [override])
    assert v.startswith(key + "=")  # the value as stored: 0 -> 0.0 for a float key


def test_critic_numbers_are_checked_for_gae(files):
    found = problems(
        "ppo",
        files + critic_path(files) + ["critic.optim.lr=0", "critic.optim.clip_grad=-1", "critic.cliprange_value=0"],
    )
    assert [v.split("=")[0] for v in found] == ["critic.optim.lr", "critic.optim.clip_grad", "critic.cliprange_value"]


def test_tensor_parallel_rollout(files):
    assert about(
        problems("grpo", files + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], 2),
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    )[0].endswith("or tensor_model_parallel_size=1")
    assert about(
        problems(
            "grpo",
            files + ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            2,
        ),
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    )
    assert (
        problems(
            "grpo",
            files + ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            2,
        )
        == []
    )


def test_data_files_must_exist(files, tmp_path):
    found = problems(
        "grpo",
        files
        + [
            f"data.train_files=[{tmp_path / 'train.parquet'},{tmp_path / 'gone.parquet'}]",
            f"data.val_files={tmp_path / 'absent.parquet'}",
        ],
    )
    assert [v.split(": ")[0] for v in found] == [
        f"data.train_files={tmp_path / 'gone.parquet'}",
        f"data.val_files={tmp_path / 'absent.parquet'}",
    ]
    assert all("file does not exist; fix: " in v for v in found)
    assert problems("grpo", files + ["data.val_files=null"]) == []


def test_custom_reward_file_must_exist(files, tmp_path):
    [v] = problems("grpo", files + [f"custom_reward_function.path={tmp_path / 'reward.py'}"])
    assert v.startswith("custom_reward_function.path=") and "file does not exist" in v
    (tmp_path / "reward.py").write_text("def compute_score(*args):\n    return 0.0\n")
    assert problems("grpo", files + [f"custom_reward_function.path={tmp_path / 'reward.py'}"]) == []


@pytest.mark.parametrize(
    "path, ok",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("./Qwen/Qwen2.5-0.5B-Instruct", False),
        ("/no/such/model", False),
        ("no_such_model", False),
    ],
)
def test_model_path_is_a_directory_or_a_hub_id(files, path, ok):
    found = problems("grpo", files + [f"actor_rollout_ref.model.path={path}"])
    assert (found == []) == ok
    if not ok:
        assert found[0].startswith(f"actor_rollout_ref.model.path={path}: no such model directory")


def test_deepspeed_configs_resolve(files, tmp_path):
    assert C.deepspeed_config_path("zero3") == C.DS_CONFIG_DIR / "zero3.json"
    assert C.deepspeed_config_path("my/ds.json") == Path("my/ds.json")
    [v] = problems("grpo", files + ["actor_rollout_ref.actor.deepspeed_config=zero4"])
    assert (
        v.startswith("actor_rollout_ref.actor.deepspeed_config=zero4: no DeepSpeed config at") and "zero3_offload" in v
    )
    (tmp_path / "ds.json").write_text('{"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}')
    assert problems("grpo", files + [f"actor_rollout_ref.actor.deepspeed_config={tmp_path / 'ds.json'}"]) == []


def test_deepspeed_configs_are_checked_for_the_engines_that_are_built(files):
    assert about(
        problems("grpo", files + ["actor_rollout_ref.ref.deepspeed_config=zero4"]),
        "actor_rollout_ref.ref.deepspeed_config",
    )
    assert (
        problems("opo", files + ["actor_rollout_ref.ref.deepspeed_config=zero4", "critic.deepspeed_config=zero4"]) == []
    )


def test_resume_keys_follow_verl(files, tmp_path):
    assert problems("grpo", files + ["trainer.resume_mode=disable"]) == []
    assert problems("grpo", files + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}"]) == []
    [v] = problems("grpo", files + ["trainer.resume_mode=latest"])
    assert v.startswith("trainer.resume_mode=latest: must be one of auto, disable, resume_path")
    # dsrl's former form, a directory in resume_mode, points to verl's two keys
    [v] = problems("grpo", files + [f"trainer.resume_mode={tmp_path}"])
    assert f"fix: set trainer.resume_mode=resume_path trainer.resume_from_path={tmp_path}" in v
    [v] = problems("grpo", files + ["trainer.resume_mode=resume_path"])
    assert v.startswith("trainer.resume_from_path=null: resume_mode=resume_path needs an existing checkpoint directory")
    [v] = problems("grpo", files + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'gone'}"])
    assert "needs an existing checkpoint directory" in v
    [v] = problems("grpo", files + [f"trainer.resume_from_path={tmp_path}"])  # ignored under auto: refused
    assert "is read only with trainer.resume_mode=resume_path (now auto)" in v


def test_checkpoint_keys(files):
    ok = "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"
    assert problems("grpo", files + [ok, "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=1"]) == []
    [v] = problems("grpo", files + ["actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"])
    assert "always hold model, optimizer and extra" in v
    [v] = problems("grpo", files + ["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,weights]"])
    assert "entries must be among model, optimizer, extra, hf_model" in v
    [v] = problems("grpo", files + ["trainer.max_actor_ckpt_to_keep=0"])
    assert v.startswith("trainer.max_actor_ckpt_to_keep=0: must be null (keep all) or >= 1")
    [v] = problems("grpo", files + ["trainer.max_consecutive_skips=0"])
    assert v.startswith("trainer.max_consecutive_skips=0: must be >= 1")


def test_resume_harmless_keys_name_real_keys():
    """Each pattern of the keys that may change on resume matches at least one key of the schema."""
    import re

    for pattern in C.RESUME_HARMLESS_KEYS:
        assert any(re.fullmatch(pattern, key) for key in C.SCHEMA), pattern


def test_logger_entries(files):
    [v] = problems("grpo", files + ["trainer.logger=[console,wandb]"])
    assert v.startswith("trainer.logger=[console,wandb]: dsrl logs to console and mlflow only")
    assert "mlflow ui" in v


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"])
def test_strategy_is_deepspeed(files, role):
    assert problems("grpo", files + [f"{role}.strategy=deepspeed"]) == []
    [v] = problems("grpo", files + [f"{role}.strategy=fsdp2"])
    assert (
        v.startswith(f"{role}.strategy=fsdp2: dsrl trains with DeepSpeed ZeRO only") and f"{role}.deepspeed_config" in v
    )


def test_verl_override_prefixes_and_free_form_chat_template_arguments(files):
    cfg, _ = C.load_and_validate(
        recipe("grpo"),
        files
        + [
            "+data.apply_chat_template_kwargs.enable_thinking=false",
            "++trainer.balance_batch=false",
            "+actor_rollout_ref.actor.optim.clip_grad=0.5",
        ],
        1,
    )
    assert dict(cfg.data.apply_chat_template_kwargs) == {"enable_thinking": False}
    assert cfg.trainer.balance_batch is False and cfg.actor_rollout_ref.actor.optim.clip_grad == 0.5


def test_run_length_and_validation_only_keys(files):
    [v] = problems("grpo", files + ["trainer.val_only=true", "data.val_files=null"])
    assert v.startswith("trainer.val_only=true: validation-only needs validation prompts")
    [v] = problems("grpo", files + ["data.val_max_samples=0"])
    assert v.startswith("data.val_max_samples=0: must be >= 1, or -1 for all rows")


def test_validated_config_is_read_only(files):
    cfg, _ = C.load_and_validate(None, files + critic_path(files), 1)
    with pytest.raises(ReadonlyConfigError):
        cfg.data.train_batch_size = 16
    with pytest.raises(ReadonlyConfigError):
        cfg.actor_rollout_ref.actor.optim.lr = 1.0
    with pytest.raises(ReadonlyConfigError):
        cfg.trainer.logger.append("mlflow")


# ---------------------------------------------------------------- scripts/train.py


def run_train(args, world_size="1"):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": world_size}  # rank 0 of a launched world
    return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)


def test_validate_only_prints_the_resolved_config_and_exits_0(files):
    start = time.monotonic()
    result = run_train(
        [
            "--local_rank=0",
            "configs/otb.yaml",
            "configs/cpu.yaml",
            *files,
            "actor_rollout_ref.actor.calculate_sum_pi_squared=false",
            "--validate-only",
        ]
    )
    assert time.monotonic() - start < 10
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "# note: actor_rollout_ref.actor.calculate_sum_pi_squared set to true: optimal_token_baseline"
    )
    printed = yaml.safe_load(result.stdout)
    assert printed["actor_rollout_ref"]["actor"]["calculate_sum_pi_squared"] is True
    assert printed["actor_rollout_ref"]["actor"]["clip_ratio_low"] == 0.2
    assert printed["trainer"]["default_local_dir"] == "checkpoints/dsrl/otb"


def test_the_printed_config_hides_secrets(files):
    """A key that names a secret, and a value equal to a secret environment variable's, print as ***."""
    result = subprocess.run(
        [
            sys.executable,
            TRAIN,
            "configs/grpo.yaml",
            "configs/cpu.yaml",
            *files,
            "+data.apply_chat_template_kwargs.api_key=sk-planted-0123456789",
            "trainer.experiment_name=hf_abcdefgh12345",
            "--validate-only",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "WORLD_SIZE": "1", "MY_SERVICE_TOKEN": "hf_abcdefgh12345"},
    )
    assert result.returncode == 0, result.stderr
    assert "sk-planted-0123456789" not in result.stdout and "hf_abcdefgh12345" not in result.stdout
    printed = yaml.safe_load(result.stdout)
    assert printed["data"]["apply_chat_template_kwargs"]["api_key"] == "***"
    assert printed["trainer"]["experiment_name"] == "***"


def test_invalid_config_exits_2_with_every_problem_and_no_traceback(files):
    result = run_train(
        [
            "configs/grpo.yaml",
            "configs/cpu.yaml",
            *files,
            "data.train_batch_size=abc",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "--validate-only",
        ]
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "3 problem(s)" in result.stderr
    for key in (
        "data.train_batch_size=abc",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.rollout.n=1",
    ):
        assert f"  {key}: " in result.stderr


def test_world_size_comes_from_the_environment(files):
    result = run_train(["configs/grpo.yaml", "configs/cpu.yaml", *files, "--validate-only"], world_size="3")
    assert result.returncode == 2
    assert "data.train_batch_size=8: must be divisible by the world size 3" in result.stderr


def test_validation_imports_nothing_heavy(files):
    args = ["--local_rank", "0", "configs/grpo.yaml", "configs/cpu.yaml", *files, "--validate-only"]
    result = run_train_without_torch(args)
    assert result.returncode == 0, result.stderr


def test_main_hands_the_validated_config_to_the_trainer(files, monkeypatch):
    trained = []
    trainer = types.SimpleNamespace(
        train=lambda cfg, signals, cluster: trained.append(cfg), TrainingStopped=RuntimeError
    )
    monkeypatch.setitem(sys.modules, "dsrl.trainer.loop", trainer)
    monkeypatch.setenv("WORLD_SIZE", "1")
    main = runpy.run_path(TRAIN)["main"]
    assert main([*recipe("grpo"), *files, "data.train_batch_size=16"]) == 0
    [cfg] = trained
    assert cfg.data.train_batch_size == 16 and cfg.algorithm.adv_estimator == "grpo"


def test_an_unexpected_error_is_reported_with_its_rank_and_host(files, monkeypatch, capsys):
    """On any rank, not only rank 0: the one line that says where, then the traceback; exit code 1."""
    import socket

    def train(cfg, signals, cluster):
        raise KeyError("a bug")

    monkeypatch.setitem(
        sys.modules, "dsrl.trainer.loop", types.SimpleNamespace(train=train, TrainingStopped=RuntimeError)
    )
    monkeypatch.setattr(
        os, "environ", {**os.environ, "RANK": "3", "WORLD_SIZE": "4"}
    )  # what the CLI fills in stays here
    monkeypatch.setattr(
        "dsrl.commands.train.checked_cluster", lambda *args: object()
    )  # the other three ranks are not started
    main = runpy.run_path(TRAIN)["main"]
    assert main([*recipe("grpo"), *files]) == 1
    err = capsys.readouterr().err
    assert f"dsrl: rank 3 on {socket.gethostname()}: the run failed with an unexpected error:\nTraceback" in err
    assert err.rstrip().endswith("KeyError: 'a bug'")


# ---------------------------------------------------------------- vllm rollout keys and rollout correction (issue 4)


def test_vllm_keys_default_to_the_model_and_the_data():
    cfg = C.load_config(None, [])
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.dtype is None and rollout.max_model_len is None  # = model.dtype, prompt + response length
    assert rollout.enable_sleep_mode is None and rollout.sleep_level == 2 and rollout.enforce_eager is False
    assert rollout.name is None and rollout.per_prompt_seeds is False and rollout.micro_batch_size == 64
    corr = cfg.algorithm.rollout_correction
    assert corr.rollout_is is None and corr.rollout_rs is None and corr.rollout_is_threshold == 2.0


def test_the_default_engine_is_vllm_where_a_gpu_and_vllm_are(tmp_path, monkeypatch):
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    assert C.default_rollout_name(gpus) == "hf"  # the driver lists no device
    (gpus / "0000:18:00.0").mkdir()
    assert C.default_rollout_name(gpus) == "vllm"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert C.default_rollout_name(gpus) == "hf"  # none visible to this process
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    assert C.default_rollout_name(gpus) == "hf"  # no vllm package


def test_an_unset_engine_is_resolved_with_a_note_and_validated_as_that_engine(files, monkeypatch):
    unset = ["actor_rollout_ref.rollout.name=null"]
    monkeypatch.setattr(loading, "default_rollout_name", lambda: "vllm")
    cfg, notes = C.load_and_validate(
        recipe("grpo"), files + unset + ["actor_rollout_ref.rollout.enable_sleep_mode=true"], 1
    )
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert notes == ["actor_rollout_ref.rollout.name set to vllm: a CUDA device and the vllm package are present"]
    monkeypatch.setattr(loading, "default_rollout_name", lambda: "hf")
    [v] = problems("grpo", files + unset + ["actor_rollout_ref.rollout.enable_sleep_mode=true"])
    assert "the hf rollout has none" in v


def test_validation_sampling_that_cannot_run_is_refused_before_models_load(files):
    [v] = problems("grpo", files + ["actor_rollout_ref.rollout.val_kwargs.do_sample=true"])  # temperature 0
    assert v.startswith("actor_rollout_ref.rollout.val_kwargs.temperature=0.0: val_kwargs.do_sample=true samples")
    [v] = problems("grpo", files + ["actor_rollout_ref.rollout.val_kwargs.n=4"])  # greedy
    assert v.startswith("actor_rollout_ref.rollout.val_kwargs.n=4: greedy decoding")
    sampled = [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    ]
    assert problems("grpo", files + sampled + ["actor_rollout_ref.rollout.val_kwargs.n=4"]) == []
    # ReMax's greedy baseline does not come from val_kwargs: n>1 there is fine.
    remax = ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=4"]
    assert problems("grpo", files + remax + sampled + ["actor_rollout_ref.rollout.val_kwargs.n=4"]) == []


def test_the_critic_geometry_follows_the_actor_unless_set(files):
    actor = {
        "ppo_mini_batch_size": 4,
        "ppo_epochs": 2,
        "shuffle": False,
        "loss_agg_mode": "seq-mean-token-mean",
        "use_dynamic_bsz": True,
    }
    overrides = [f"actor_rollout_ref.actor.{key}={show(value)}" for key, value in actor.items()]
    cfg, _ = C.load_and_validate(recipe("ppo"), files + overrides, 1)
    assert {key: cfg.critic[key] for key in actor} == actor  # as verl: a script that sets the actor's sets both
    cfg, _ = C.load_and_validate(recipe("ppo"), files + overrides + ["critic.ppo_mini_batch_size=8"], 1)
    assert cfg.critic.ppo_mini_batch_size == 8 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert C.to_dict(cfg)["critic"]["ppo_epochs"] == 2  # resolved for MLflow params and the checkpoint state


def test_gradient_checkpointing_is_on_by_default_for_both_models():
    cfg = C.load_config(None, [])
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing and cfg.critic.model.enable_gradient_checkpointing


def test_hf_generation_chunks_must_hold_a_prompt(files):
    [v] = problems("grpo", files + ["actor_rollout_ref.rollout.micro_batch_size=0"])
    assert v.startswith("actor_rollout_ref.rollout.micro_batch_size=0: must be >= 1")


def test_sleep_mode_needs_the_vllm_rollout(files):
    [v] = problems("grpo", files + ["actor_rollout_ref.rollout.enable_sleep_mode=true"])
    assert v.startswith("actor_rollout_ref.rollout.enable_sleep_mode=true: sleep mode")
    assert "set actor_rollout_ref.rollout.name=vllm" in v
    on = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enable_sleep_mode=true"]
    assert problems("grpo", files + on + ["actor_rollout_ref.rollout.sleep_level=2"]) == []
    assert problems("grpo", files + ["actor_rollout_ref.rollout.enable_sleep_mode=false"]) == []


def test_offloading_on_a_cpu_needs_the_hf_rollout_and_an_engine_with_states_to_offload(files):
    on = files + ["actor_rollout_ref.rollout.offload_states_on_cpu=true"]
    key = "actor_rollout_ref.rollout.offload_states_on_cpu=true"
    [v] = problems("grpo", on)  # the CPU overlay's zero3_offload: DeepSpeed refuses to offload its states
    assert v.startswith(f"{key}: every trained engine offloads its parameters") and "deepspeed_config=zero3" in v
    zero3 = ["actor_rollout_ref.actor.deepspeed_config=zero3"]
    assert problems("grpo", on + zero3) == []
    [v] = problems("grpo", on + zero3 + ["actor_rollout_ref.rollout.name=vllm"])
    assert v.startswith(f"{key}: the vllm rollout keeps its memory on a CPU")
    # PPO: the critic's states are enough
    assert problems("ppo", on + critic_path(files) + ["critic.deepspeed_config=zero2"]) == []


def test_lora_adapter_pushes_to_vllm_need_sleep_level_1(files):
    """A level-2 sleep drops the base weights; adapter pushes (lora.merge=false) never bring them back."""
    adapters = files + [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora.merge=false",
    ]
    [v] = problems("grpo", adapters)  # sleep mode null (on where vLLM has it), level 2 by default
    assert v.startswith("actor_rollout_ref.rollout.sleep_level=2: a level-2 sleep drops vLLM's base weights")
    assert "set actor_rollout_ref.rollout.sleep_level=1" in v and "actor_rollout_ref.model.lora.merge=true" in v
    assert problems("grpo", adapters + ["actor_rollout_ref.rollout.sleep_level=1"]) == []
    assert problems("grpo", adapters + ["actor_rollout_ref.rollout.enable_sleep_mode=false"]) == []
    assert problems("grpo", adapters[:-1]) == []  # merged pushes (the default) refill them
    assert problems("grpo", files + ["actor_rollout_ref.rollout.name=vllm"]) == []  # no LoRA
    assert problems("grpo", files + ["actor_rollout_ref.model.lora_rank=8"]) == []  # the HF rollout has no sleep


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.rollout.sleep_level=3",
        "actor_rollout_ref.rollout.dtype=float16",
        "actor_rollout_ref.rollout.max_model_len=100",
        "algorithm.rollout_correction.rollout_is=geometric",
        "algorithm.rollout_correction.rollout_is_threshold=1.0",
        "actor_rollout_ref.rollout.temperature=2.5",
        "actor_rollout_ref.rollout.val_kwargs.temperature=3",
    ],
)
def test_vllm_and_rollout_correction_values_out_of_range(files, override):
    [v] = problems("grpo", files + ["actor_rollout_ref.rollout.name=vllm", override])
    assert v.startswith(override.split("=")[0] + "=")


def test_max_model_len_must_hold_a_whole_sequence(files):
    lengths = ["data.max_prompt_length=64", "data.max_response_length=32"]
    [v] = problems("grpo", files + lengths + ["actor_rollout_ref.rollout.max_model_len=95"])
    assert "= 96" in v and v.endswith("at least 96")
    assert problems("grpo", files + lengths + ["actor_rollout_ref.rollout.max_model_len=96"]) == []


def test_rejection_thresholds_must_accept_an_on_policy_token(files):
    prefix = "algorithm.rollout_correction"
    rs = [f"{prefix}.rollout_rs=seq_sum_k1"]
    assert problems("grpo", files + rs + [f"{prefix}.rollout_rs_threshold=0.5_3.0"]) == []
    assert problems("grpo", files + rs + [f"{prefix}.rollout_rs_threshold=3"]) == []  # L = 1/3
    for bad in ("0.9", "1.5_3.0", "3.0_0.5", "x", "1.5,2"):  # ratio 1 outside; not a number; too many
        assert about(
            problems("grpo", files + rs + [f"{prefix}.rollout_rs_threshold={bad}"]), f"{prefix}.rollout_rs_threshold"
        ), bad
    k3 = [f"{prefix}.rollout_rs=token_k3,seq_max_k2"]
    assert problems("grpo", files + k3 + [f"{prefix}.rollout_rs_threshold=0.01"]) == []
    assert problems("grpo", files + k3 + [f"{prefix}.rollout_rs_threshold=0.01,0.1"]) == []
    [v] = problems("grpo", files + k3 + [f"{prefix}.rollout_rs_threshold=0.5_2.0"])
    assert "token_k3: '0.5_2.0' is an interval" in v
    assert about(
        problems("grpo", files + [f"{prefix}.rollout_rs=seq", f"{prefix}.rollout_rs_threshold=2.0"]),
        f"{prefix}.rollout_rs",
    )


def test_older_rejection_levels_name_the_new_option(files):
    prefix = "algorithm.rollout_correction"
    [v] = problems("grpo", files + [f"{prefix}.rollout_rs=sequence", f"{prefix}.rollout_rs_threshold=2.0"])
    assert v.startswith(f"{prefix}.rollout_rs=sequence:") and "for 'sequence' write seq_sum_k1" in v


@pytest.mark.parametrize(
    "value, ok", [(2.0, True), ("'0.5_5.0'", True), (1.0, False), ("'1.5_5.0'", False), ("x", False)]
)
def test_is_threshold_is_tis_or_icepop(files, value, ok):
    key = "algorithm.rollout_correction.rollout_is_threshold"
    found = problems("grpo", files + ["algorithm.rollout_correction.rollout_is=token", f"{key}={value}"])
    assert (found == []) == ok and (ok or about(found, key))


def test_rejection_thresholds_without_rejection_are_refused(files):
    prefix = "algorithm.rollout_correction"
    [v] = problems("grpo", files + [f"{prefix}.rollout_is=token", f"{prefix}.rollout_rs_threshold=3"])
    assert v.startswith(f"{prefix}.rollout_rs_threshold=3: has no effect while rollout_rs is null")
    [v] = problems("grpo", files + [f"{prefix}.rollout_is_batch_normalize=true"])
    assert v.startswith(f"{prefix}.rollout_is_batch_normalize=true: has no effect while rollout_is is null")


BYPASS = ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", "algorithm.rollout_correction.bypass_mode=true"]
LOSS_CORR = "actor_rollout_ref.actor.policy_loss.rollout_correction"


def test_bypass_mode_is_set_on_both_sides(files):
    assert problems("grpo", files + BYPASS) == []
    [v] = problems("grpo", files + BYPASS[:1])
    assert v.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode: bypass_mode takes the rollout")
    assert "set algorithm.rollout_correction.bypass_mode=true" in v
    [v] = problems("grpo", files + BYPASS[1:])
    assert v.startswith(
        "algorithm.rollout_correction.bypass_mode=true: bypass mode trains with the bypass_mode policy loss"
    )
    assert "set actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode" in v


def test_bypass_settings_agree_on_both_sides_and_are_refused_without_bypass(files):
    reinforce = [f"{LOSS_CORR}.loss_type=reinforce", f"{LOSS_CORR}.rollout_is=sequence"]
    [v1, v2] = problems("grpo", files + BYPASS + reinforce)
    assert v1.startswith(
        "algorithm.rollout_correction.loss_type=ppo_clip: in bypass mode verl's loss takes its settings"
    )
    assert v2.startswith("algorithm.rollout_correction.rollout_is=null:") and "set both keys to the same value" in v2
    same = ["algorithm.rollout_correction.loss_type=reinforce", "algorithm.rollout_correction.rollout_is=sequence"]
    assert problems("grpo", files + BYPASS + reinforce + same) == []
    found = problems("grpo", files + [f"{LOSS_CORR}.rollout_rs=token_k1", f"{LOSS_CORR}.rollout_rs_threshold=2.0"])
    assert [v.split(":")[0] for v in found] == [
        f"{LOSS_CORR}.rollout_rs=token_k1",
        f"{LOSS_CORR}.rollout_rs_threshold=2.0",
    ]
    assert all("configures the bypass_mode loss, not vanilla" in v for v in found)
    [v] = problems("grpo", files + ["algorithm.rollout_correction.loss_type=reinforce"])
    assert v.startswith("algorithm.rollout_correction.loss_type=reinforce: has no effect without bypass mode")
    [v] = problems("grpo", files + BYPASS + [f"{LOSS_CORR}.loss_type=pg", "algorithm.rollout_correction.loss_type=pg"])[
        :1
    ]
    assert "unknown loss type" in v


def test_bypass_mode_refuses_what_needs_the_old_log_prob_pass(files):
    [v] = problems("grpo", files + BYPASS + ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"])
    assert v.startswith(
        "actor_rollout_ref.actor.calculate_sum_pi_squared=true: sum_pi_squared from the old-log-prob pass"
    )


def test_the_no_grad_passes_have_token_budgets_of_their_own(files):
    """verl's keys: the old-log-prob pass (rollout.log_prob_*), the reference (ref.log_prob_*) and the critic's
    values (critic.forward_*) default to the training settings; each budget set apart must hold a sequence."""
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300"]
    cfg, _ = C.load_and_validate(recipe("ppo"), files + critic_path(files) + dynamic, 1)
    rollout, ref, critic = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
    assert rollout.log_prob_use_dynamic_bsz and ref.log_prob_use_dynamic_bsz
    assert rollout.log_prob_max_token_len_per_gpu == ref.log_prob_max_token_len_per_gpu == 300
    assert critic.forward_max_token_len_per_gpu == critic.ppo_max_token_len_per_gpu
    assert critic.forward_micro_batch_size_per_gpu == critic.ppo_micro_batch_size_per_gpu
    small = [
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=101",
        "critic.forward_max_token_len_per_gpu=102",
    ]
    found = problems("ppo", files + critic_path(files) + dynamic + ["critic.use_dynamic_bsz=true"] + small)
    assert [v.partition("=")[0] for v in found] == [
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu",
    ]
    assert all("must hold one whole sequence" in v for v in found)
    # Without a token budget for the pass, its budget is not read, so not checked.
    assert problems("ppo", files + critic_path(files) + small) == []


MODEL = "actor_rollout_ref.model.path"


def test_every_command_in_the_recipe_headers_validates_on_eight_ranks(files):
    """The GPU commands each recipe's header gives (the recipe as shipped, the Qwen3-8B scaling, and DAPO's
    Qwen2.5-7B at 20,480-token responses): every override is a known key and the geometry holds on 8 ranks."""
    commands = 0
    for name in CONFIGS:
        header = (REPO / "configs" / f"{name}.yaml").read_text()
        for command in re.findall(r"^#   deepspeed --num_gpus 8 scripts/train\.py (.*)$", header, re.M):
            config, *overrides = command.split()
            assert config == f"configs/{name}.yaml"
            model = [o for o in overrides if o.startswith("actor_rollout_ref.model.path=")]
            assert model in ([], ["actor_rollout_ref.model.path=Qwen/Qwen3-8B"], [f"{MODEL}=Qwen/Qwen2.5-7B-Instruct"])
            kept = [o for o in overrides if o not in model]  # the stub model of `files` stands in for the hub id
            C.load_and_validate([str(REPO / config)], files + kept, 8)
            commands += 1
    assert commands == 2 * len(CONFIGS)  # two a recipe, a third in DAPO's, one in grpo_moe's


def test_the_loss_variants_in_the_grpo_header_validate_with_both_commands(files):
    """Each variant line of configs/grpo.yaml (verl's SAPO, GSPO and DAPO clip-higher settings) validates on 8
    ranks appended to the recipe as shipped."""
    header = (REPO / "configs" / "grpo.yaml").read_text()
    variants = re.findall(r"^#   (SAPO|GSPO|DAPO)[^:]*: (.*)$", header, re.M)
    assert [name for name, _ in variants] == ["SAPO", "GSPO", "DAPO"]
    for _, overrides in variants:
        cfg, _ = C.load_and_validate([str(REPO / "configs" / "grpo.yaml")], files + overrides.split(), 8)
        for override in overrides.split():
            key, value = override.split("=")
            assert functools.reduce(getattr, key.split("."), cfg) == yaml.safe_load(value), override


# ---------------------------------------------------------------- policy loss parameters

LOSS = "actor_rollout_ref.actor.policy_loss"


@pytest.mark.parametrize(
    "mode, override, key, message",
    [
        ("dro", None, f"{LOSS}.dro_beta", "null: must be > 0 with loss_mode=dro: the weight of the quadratic"),
        ("dro", "-0.5", f"{LOSS}.dro_beta", "-0.5: must be > 0 with loss_mode=dro"),
        (
            "sapo",
            "0",
            "actor_rollout_ref.actor.tau_pos",
            "0.0: must be > 0: the gate's temperature; fix: set it to 1.0",
        ),
        ("sapo", "-1", "actor_rollout_ref.actor.tau_neg", "-1.0: must be > 0"),
        ("clip_cov", "0", f"{LOSS}.clip_cov_ratio", "0.0: must be in (0, 1]"),
        ("clip_cov", "0.5", f"{LOSS}.clip_cov_ub", "0.5: must be > clip_cov_lb (1.0)"),
        ("kl_cov", "2", f"{LOSS}.kl_cov_ratio", "2.0: must be in (0, 1]"),
        ("kl_cov", "-0.1", f"{LOSS}.ppo_kl_coef", "-0.1: must be >= 0"),
    ],
)
def test_a_loss_parameter_out_of_range_is_refused(files, mode, override, key, message):
    overrides = [f"{LOSS}.loss_mode={mode}"] + ([] if override is None else [f"{key}={override}"])
    [line] = problems("grpo", files + overrides)
    assert line.startswith(f"{key}={message}"), line


@pytest.mark.parametrize(
    "mode, settings, expected",
    [
        ("dro", [f"{LOSS}.dro_beta=0.1"], {"dro_beta": 0.1}),
        ("sapo", ["actor_rollout_ref.actor.tau_neg=2"], {"tau_pos": 1.0, "tau_neg": 2.0}),
        ("clip_cov", [f"{LOSS}.clip_cov_lb=0.5"], {"clip_cov_ratio": 0.0002, "clip_cov_lb": 0.5, "clip_cov_ub": 5.0}),
        ("kl_cov", [f"{LOSS}.ppo_kl_coef=1.0"], {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0}),
        ("dppo_tv", ["actor_rollout_ref.actor.clip_ratio_c=20"], {}),  # clip_ratio_c: every loss's input
    ],
)
def test_each_loss_takes_its_parameters_from_verls_keys(files, mode, settings, expected):
    cfg, _ = C.load_and_validate(recipe("grpo"), files + [f"{LOSS}.loss_mode={mode}", *settings], 1)
    assert C.policy_loss_param_values(cfg, C.POLICY_LOSS_PARAMS.get(mode, ())) == expected


def test_a_parameter_set_for_a_loss_that_does_not_read_it_is_refused(files):
    [line] = problems("grpo", files + [f"{LOSS}.loss_mode=sapo", f"{LOSS}.clip_cov_ratio=0.001"])
    assert line == (
        f"{LOSS}.clip_cov_ratio=0.001: a parameter of the clip_cov loss, which loss_mode=sapo does not read: it "
        f"would do nothing; fix: remove it, or set {LOSS}.loss_mode=clip_cov"
    )
    [line] = problems("grpo", files + ["actor_rollout_ref.actor.tau_neg=1.05"])  # the default, but set: refused
    assert line.startswith(
        "actor_rollout_ref.actor.tau_neg=1.05: a parameter of the sapo loss, which loss_mode=vanilla"
    )
    assert problems("grpo", files) == []  # unset, the defaults are no one's choice


def test_policy_loss_params_are_a_user_losss_own_parameters(files, tmp_path):
    module = tmp_path / "my_loss.py"
    module.write_text(
        "from dsrl.algorithms import register_policy_loss\n"
        "@register_policy_loss('test_cfg_scaled', params={'scale': 2.0, 'tau_pos': 1.0})\n"
        "def scaled(*, log_probs, scale, tau_pos, **_):\n"
        "    return -scale * log_probs, {}\n"
    )
    base = files + [f"algorithm.import_modules=[{module}]", f"{LOSS}.loss_mode=test_cfg_scaled"]
    try:
        cfg, _ = C.load_and_validate(
            recipe("grpo"), base + [f"{LOSS}.params={{scale: 0.5}}", "actor_rollout_ref.actor.tau_pos=3"], 1
        )
        assert C.policy_loss_param_values(cfg, ["scale", "tau_pos"]) == {"scale": 0.5, "tau_pos": 3.0}
        cfg, _ = C.load_and_validate(recipe("grpo"), base, 1)
        assert C.policy_loss_param_values(cfg, ["scale", "tau_pos"]) == {"tau_pos": 1.0}  # scale: the loss's default
        assert about(problems("grpo", base + [f"{LOSS}.params={{scales: 0.5}}"]), f"{LOSS}.params.scales") == [
            f"{LOSS}.params.scales=0.5: loss_mode=test_cfg_scaled declares no parameter scales; fix: remove it "
            "(the parameters of test_cfg_scaled set here: scale)"
        ]
        assert about(problems("grpo", base + [f"{LOSS}.params={{tau_pos: 2}}"]), f"{LOSS}.params.tau_pos") == [
            f"{LOSS}.params.tau_pos=2: tau_pos has a key of its own; fix: set actor_rollout_ref.actor.tau_pos instead"
        ]
    finally:
        from dsrl.algorithms import losses

        losses._POLICY_LOSSES.pop("test_cfg_scaled", None)


# ---------------------------------------------------------------- estimator options: gdpo, length weighting, PF-PPO


def test_gdpo_needs_its_reward_keys_and_one_weight_per_key(files):
    gdpo = ["algorithm.adv_estimator=gdpo"]
    [v] = problems("grpo", files + gdpo)
    assert v.startswith("algorithm.gdpo_reward_keys=null: gdpo normalises each reward component separately")
    assert v.endswith("e.g. [acc,format]")
    keys = ["algorithm.gdpo_reward_keys=[acc,format]"]
    assert problems("grpo", files + gdpo + keys) == []
    assert problems("grpo", files + gdpo + keys + ["algorithm.gdpo_reward_weights=[1.0,0.5]"]) == []
    [v] = problems("grpo", files + gdpo + keys + ["algorithm.gdpo_reward_weights=[1.0]"])
    assert v.startswith(
        "algorithm.gdpo_reward_weights=[1.0]: needs one weight per algorithm.gdpo_reward_keys entry (2)"
    )
    [v] = problems("grpo", files + gdpo + keys + ["algorithm.use_kl_in_reward=true"])
    assert v.startswith(
        "algorithm.use_kl_in_reward=true: gdpo computes its advantages from the reward components alone"
    )


@pytest.mark.parametrize("key", ["gdpo_reward_keys=[acc]", "gdpo_reward_weights=[1.0]"])
def test_gdpo_keys_are_refused_for_another_estimator(files, key):
    [v] = problems("grpo", files + [f"algorithm.{key}"])
    name = key.split("=")[0]
    assert v.startswith(f"algorithm.{name}=")
    assert "only gdpo reads it, and algorithm.adv_estimator is grpo" in v
    assert v.endswith(f"set algorithm.adv_estimator=gdpo, or algorithm.{name}=null")


def test_length_weighted_baseline_only_where_there_is_a_baseline_to_weigh(files):
    on = ["algorithm.length_weighted_baseline=true"]
    assert problems("rloo", files + on) == []
    assert problems("grpo", files + on + ["algorithm.adv_estimator=reinforce_plus_plus_baseline"]) == []
    [v] = problems("opo", files + on)
    assert v.startswith(
        "algorithm.length_weighted_baseline=true: only rloo, rloo_vectorized, reinforce_plus_plus_baseline"
    )
    assert "algorithm.adv_estimator is opo" in v


def test_pf_ppo_rules(files):
    ppo = files + critic_path(files)
    on = ["algorithm.use_pf_ppo=true"]
    assert problems("ppo", ppo + on + ["algorithm.pf_ppo.reweight_method=max_min"]) == []
    [v] = problems("grpo", files + on)
    assert v.startswith("algorithm.use_pf_ppo=true: verl resamples the batch after GAE's advantages only")
    [v] = problems("ppo", ppo + on + ["algorithm.pf_ppo.reweight_method=median"])
    assert v.startswith("algorithm.pf_ppo.reweight_method=median: unknown method") and "pow, max_min, max_random" in v
    for bad in ("0", "-1.0"):
        [v] = problems("ppo", ppo + on + [f"algorithm.pf_ppo.weight_pow={bad}"])
        assert v.startswith(f"algorithm.pf_ppo.weight_pow={float(bad)}: must be > 0")


@pytest.mark.parametrize("key", ["reweight_method=max_min", "weight_pow=3.0"])
def test_pf_ppo_settings_without_pf_ppo_are_refused(files, key):
    ppo = files + critic_path(files)
    [v] = problems("ppo", ppo + [f"algorithm.pf_ppo.{key}"])
    assert v.startswith(f"algorithm.pf_ppo.{key}: has no effect while algorithm.use_pf_ppo is false")
    assert problems("ppo", ppo + ["algorithm.pf_ppo.reweight_method=pow", "algorithm.pf_ppo.weight_pow=2.0"]) == []
