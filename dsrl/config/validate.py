"""The rules a loaded config must meet (``validate``, one group of rules per concern) and ``load_and_validate``,
which loads, validates, resolves and freezes a run's config."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from collections.abc import Collection
from typing import Any, Callable

from omegaconf import MISSING, ListConfig, OmegaConf

from dsrl.config.loading import (
    ConfigError,
    ConfigFiles,
    load_layers,
    resolve,
    secret_notes,
)
from dsrl.config.user_code import import_user_modules
from dsrl.config.rules import algorithm, geometry, paths, rollout
from dsrl.config.rules.need import Need, is_missing
from dsrl.config.names import (
    CHECKPOINT_CONTENTS,
    LOGGERS,
    MEMORY_PLAN_CHECKS,
    MODEL_DTYPES,
    REWARD_MANAGERS,
    REQUIRED_CHECKPOINT_CONTENTS,
    RESUME_MODES,
    TRUNCATION_MODES,
)
from dsrl.config.schema import (
    LEAF_KEYS,
    SCHEMA,
    Config,
    show,
    violation,
)


_VALUE_AT_KEY = object()


def validate(cfg: Config, world_size: int, given: Collection[str] = frozenset()) -> list[str]:
    """Every violation of the rules below, one line each (dotted key, value, rule, fix); [] when valid.

    ``given``: the keys the config's files and overrides set (``load_and_validate`` passes them); a policy loss
    parameter given for a loss that does not read it is refused (at its default it is not known to be set).

    Checks that numbers are finite, the batch geometry against ``world_size``, estimator requirements,
    loss and KL settings, names against the known ones, that the files the run needs exist, are regular files
    and look complete (``dsrl.config.files``: headers only), that no data file is listed twice, and that the run
    folder can be written. Runs on the config as loaded, before ``resolve``
    fills in derived values; reads nothing heavy.
    """
    violations: list[str] = []
    nonfinite = [key for key in LEAF_KEYS if not is_missing(cfg, key) and _nonfinite(OmegaConf.select(cfg, key))]

    def need(ok: Any, key: str, rule: str, fix: str, value: Any = _VALUE_AT_KEY) -> None:
        """Record a violation at ``key`` unless ``ok``; it shows the value at ``key`` unless given one. A key
        holding inf or nan has its one violation already (nan fails every comparison)."""
        if not ok and key not in nonfinite:
            if value is _VALUE_AT_KEY:
                value = MISSING if is_missing(cfg, key) else OmegaConf.select(cfg, key)
            violations.append(violation(key, value, rule, fix))

    for key in LEAF_KEYS:
        need(not is_missing(cfg, key), key, "required", f"set {key} ({SCHEMA[key].help})")
    for key in nonfinite:
        rule = "must be finite (inf and nan are not numbers a run can use)"
        fix = f"set it to a finite number (the default is {show(SCHEMA[key].default)})"
        violations.append(violation(key, OmegaConf.select(cfg, key), rule, fix))
    geometry.batch_rules(cfg, world_size, need)
    violations += import_user_modules(cfg.algorithm.import_modules)  # before the name checks: they register names
    algorithm.estimator_rules(cfg, need)
    algorithm.estimator_option_rules(cfg, need)
    algorithm.loss_rules(cfg, need)
    algorithm.loss_param_rules(cfg, given, need)
    rollout.rollout_rules(cfg, world_size, need)
    rollout.vllm_rules(cfg, need)
    rollout.rollout_correction_rules(cfg, need)
    rollout.rollout_mismatch_rules(cfg, need)
    algorithm.filter_groups_rules(cfg, need)
    rollout.multi_turn_rules(cfg, need)
    rollout.lora_rules(cfg, given, need)
    paths.file_rules(cfg, need)
    geometry.deepspeed_rules(cfg, world_size, need)
    _reward_rules(cfg, need)
    _reward_manager_rules(cfg, need)
    _trainer_rules(cfg, need)
    return violations


def _nonfinite(value: Any) -> bool:
    """Whether ``value`` is, or is a list holding, an inf or a nan."""
    values = list(value) if isinstance(value, ListConfig) else [value]
    return any(isinstance(v, float) and not math.isfinite(v) for v in values)


def _reward_rules(cfg: Config, need: Need) -> None:
    """reward.* (the worker pool of dsrl.rewards.RewardScorer) and custom_reward_function.batch."""
    reward, custom = cfg.reward, cfg.custom_reward_function
    need(
        reward.num_workers is None or reward.num_workers >= 1,
        "reward.num_workers",
        "must be >= 1, or null for the CPU count (at most 16)",
        "set it to null or e.g. 8",
    )
    need(reward.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds", "set it to e.g. 10")
    need(
        reward.max_failed_steps >= 0,
        "reward.max_failed_steps",
        "must be >= 0 (steps in a row whose every reward call failed; 0 = never stop for that)",
        "set it to 3",
    )
    need(
        reward.memory_limit_mb == 0 or reward.memory_limit_mb >= 256,
        "reward.memory_limit_mb",
        "must be 0 (no limit) or >= 256 MB (a Python worker holds about 25 MB before it loads the reward file, "
        "and the libraries a reward imports need more)",
        "set it to 4096, or 0 for no limit",
    )
    need(reward.log_max_mb >= 0, "reward.log_max_mb", "must be >= 0 MB (0 = no limit)", "set it to 64")
    need(
        reward.batch_chunk_size is None or reward.batch_chunk_size >= 1,
        "reward.batch_chunk_size",
        "must be >= 1, or null for the batch split evenly over the workers",
        "set it to null",
    )
    need(
        reward.batch_chunk_size is None or custom.batch,
        "reward.batch_chunk_size",
        "is read only with custom_reward_function.batch=true (a function of lists)",
        "set custom_reward_function.batch=true, or reward.batch_chunk_size=null",
    )
    need(
        not custom.batch or custom.path is not None,
        "custom_reward_function.batch",
        "needs custom_reward_function.path (the built-in scorers take one row at a time)",
        "set custom_reward_function.path to a file defining a batch function, or batch=false",
    )
    sources = list(reward.math_verify_sources)
    if not sources:
        return
    need(
        all(isinstance(s, str) and s for s in sources),
        "reward.math_verify_sources",
        "entries must be data_source names",
        "set it to e.g. [lighteval/MATH,HuggingFaceH4/MATH-500]",
    )
    need(
        custom.path is None,
        "reward.math_verify_sources",
        "has no effect while custom_reward_function.path is set (that function scores every data source)",
        "call dsrl.rewards.mathverify.compute_score(solution_str, ground_truth) from your function, or set it to []",
    )
    need(
        importlib.util.find_spec("math_verify") is not None,
        "reward.math_verify_sources",
        "needs the math-verify package, which is not installed",
        "pip install 'dsrl[math]' (or pip install math-verify), or set it to []",
    )


def _reward_manager_rules(cfg: Config, need: Need) -> None:
    """reward_model.*: the manager's name, and DAPO's overlong punishment set only where it applies, with a
    buffer inside the length it ends at (verl asserts the same at start-up)."""
    manager, kwargs = cfg.reward_model.reward_manager, cfg.reward_model.reward_kwargs
    buffer, prefix = kwargs.overlong_buffer_cfg, "reward_model.reward_kwargs"
    need(manager in REWARD_MANAGERS, "reward_model.reward_manager", "unknown reward manager", f"use one of {', '.join(REWARD_MANAGERS)}")
    if not buffer.enable:
        defaults = (("len", 0), ("penalty_factor", 0.0), ("log", False))
        for name, default in defaults:
            need(
                OmegaConf.select(buffer, name) == default,
                f"{prefix}.overlong_buffer_cfg.{name}",
                f"has no effect while {prefix}.overlong_buffer_cfg.enable is false",
                f"set {prefix}.overlong_buffer_cfg.enable=true, or remove it (the default is {show(default)})",
            )
        need(
            kwargs.max_resp_len is None,
            f"{prefix}.max_resp_len",
            f"is read only by the overlong punishment, and {prefix}.overlong_buffer_cfg.enable is false",
            f"set {prefix}.overlong_buffer_cfg.enable=true, or remove it",
        )
        return
    need(
        manager == "dapo",
        f"{prefix}.overlong_buffer_cfg.enable",
        f"only the dapo reward manager applies the overlong punishment, and reward_model.reward_manager is {manager}",
        "set reward_model.reward_manager=dapo, or overlong_buffer_cfg.enable=false",
    )
    max_len = cfg.data.max_response_length if kwargs.max_resp_len is None else kwargs.max_resp_len
    need(
        kwargs.max_resp_len is None or kwargs.max_resp_len >= 1,
        f"{prefix}.max_resp_len",
        "must be >= 1 tokens, or null for data.max_response_length",
        "set it to null (data.max_response_length)",
    )
    need(
        max_len < 1 or 0 < buffer.len <= max_len,  # a max_resp_len below 1 has its own violation
        f"{prefix}.overlong_buffer_cfg.len",
        f"the buffer must hold > 0 and <= max_resp_len ({max_len}) tokens: the punishment starts len tokens before "
        "max_resp_len and grows by penalty_factor / len per token",
        f"set it to e.g. {max(1, max_len // 5)} (DAPO: 4096 of 20480)",
    )
    need(
        buffer.penalty_factor >= 0,
        f"{prefix}.overlong_buffer_cfg.penalty_factor",
        "must be >= 0: a negative factor would reward responses for running into the buffer",
        "set it to 1.0 (DAPO's value)",
    )


def _trainer_rules(cfg: Config, need: Need) -> None:
    trainer, data = cfg.trainer, cfg.data
    need(
        data.truncation in TRUNCATION_MODES,
        "data.truncation",
        "unknown truncation",
        f"use one of {', '.join(TRUNCATION_MODES)}",
    )
    need(data.prompt_key, "data.prompt_key", "must name a column", "set it to prompt")
    for key in ("train_max_samples", "val_max_samples"):
        need(data[key] == -1 or data[key] >= 1, f"data.{key}", "must be >= 1, or -1 for all rows", "set it to -1")
    need(trainer.log_val_generations >= 0, "trainer.log_val_generations", "must be >= 0", "set it to 0 (none) or e.g. 16")
    need(
        trainer.log_samples_freq == -1 or trainer.log_samples_freq >= 1,
        "trainer.log_samples_freq",
        "must be >= 1, or -1 for never",
        "set it to e.g. 10, or -1",
    )
    need(
        not trainer.val_only or data.val_files is not None,
        "trainer.val_only",
        "validation-only needs validation prompts",
        "set data.val_files, or trainer.val_only=false",
    )
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        need(
            OmegaConf.select(cfg, f"{role}.strategy") == "deepspeed",
            f"{role}.strategy",
            "dsrl trains with DeepSpeed ZeRO only (no FSDP or Megatron)",
            f"remove it and choose the ZeRO setup with {role}.deepspeed_config: zero3_offload | zero3 | zero2 or a JSON path",
        )
    need(
        cfg.actor_rollout_ref.model.dtype in MODEL_DTYPES,
        "actor_rollout_ref.model.dtype",
        "unsupported training precision",
        f"use one of {', '.join(MODEL_DTYPES)}",
    )
    need(
        all(name in LOGGERS for name in trainer.logger),
        "trainer.logger",
        f"dsrl logs to {' and '.join(LOGGERS)} only (no wandb, tensorboard or swanlab)",
        "set it to [console,mlflow] and open the runs with `mlflow ui`, or [console]",
    )
    need(trainer.total_epochs >= 1, "trainer.total_epochs", "must be >= 1", "set it to 1")
    need(
        trainer.memory_plan_check in MEMORY_PLAN_CHECKS,
        "trainer.memory_plan_check",
        f"must be one of {', '.join(MEMORY_PLAN_CHECKS)}",
        "set it to warn to see the plan's excess without refusing, or ignore",
    )
    need(
        trainer.total_training_steps is None or trainer.total_training_steps >= 1,
        "trainer.total_training_steps",
        "must be >= 1 or null",
        "set it to null (= total_epochs worth)",
    )
    for key in ("trainer.save_freq", "trainer.test_freq"):
        need(
            OmegaConf.select(cfg, key) == -1 or OmegaConf.select(cfg, key) >= 1,
            key,
            "must be -1 (never) or >= 1 (every that many steps)",
            "set it to -1 or e.g. 10",
        )
    need(trainer.critic_warmup >= 0, "trainer.critic_warmup", "must be >= 0", "set it to 0")
    need(trainer.project_name, "trainer.project_name", "must not be empty (the MLflow experiment)", "set it to a name")
    need(
        trainer.experiment_name,
        "trainer.experiment_name",
        "must not be empty (the MLflow run name)",
        "set it to a name",
    )
    mode = trainer.resume_mode
    if mode not in RESUME_MODES:
        fix = "set it to auto, disable or resume_path"
        if Path(mode).expanduser().is_dir():
            fix = f"set trainer.resume_mode=resume_path trainer.resume_from_path={mode}"
        need(False, "trainer.resume_mode", f"must be one of {', '.join(RESUME_MODES)}", fix)
    path = trainer.resume_from_path
    if mode == "resume_path":
        need(
            path is not None and Path(path).expanduser().is_dir(),
            "trainer.resume_from_path",
            "resume_mode=resume_path needs an existing checkpoint directory",
            "set it to a checkpoint such as checkpoints/dsrl/default/global_step_10",
        )
    else:
        need(
            path is None,
            "trainer.resume_from_path",
            f"is read only with trainer.resume_mode=resume_path (now {mode})",
            "set trainer.resume_mode=resume_path, or remove it",
        )
    for key in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"):
        kept = OmegaConf.select(cfg, key)
        need(kept is None or kept >= 1, key, "must be null (keep all) or >= 1", "set it to null or e.g. 3")
    need(
        trainer.max_consecutive_skips >= 1,
        "trainer.max_consecutive_skips",
        "must be >= 1",
        "set it to 5",
    )
    need(
        cfg.actor_rollout_ref.nccl_timeout > 0,
        "actor_rollout_ref.nccl_timeout",
        "must be > 0 seconds (how long a collective waits for every rank)",
        "set it to 600",
    )
    contents = list(cfg.actor_rollout_ref.actor.checkpoint.save_contents)
    key = "actor_rollout_ref.actor.checkpoint.save_contents"
    need(
        all(item in CHECKPOINT_CONTENTS for item in contents),
        key,
        f"entries must be among {', '.join(CHECKPOINT_CONTENTS)}",
        "set it to [model,optimizer,extra] or [model,optimizer,extra,hf_model]",
    )
    need(
        all(item in contents for item in REQUIRED_CHECKPOINT_CONTENTS),
        key,
        "dsrl checkpoints always hold model, optimizer and extra (ZeRO keeps the weights inside the optimizer "
        "partitions, and resuming needs all three)",
        "set it to [model,optimizer,extra], adding hf_model for a loadable model in every checkpoint",
    )


def load_and_validate(
    files: ConfigFiles, overrides: list[str], world_size: int, *, reads: Callable[[str], bool] | None = None
) -> tuple[Config, list[str]]:
    """Load (as ``load_config``), resolve and validate; returns the read-only config and the notes: what dsrl set
    itself, and the keys that hold the value of a secret.

    Raises ConfigError listing every problem: unknown or mistyped keys and every rule violated. ``reads``: for a
    command that reads only some keys of a run config (``dsrl-eval``), whether it reads a dotted key; problems at
    the known keys it does not read are left out (a training config's missing train_files, say).
    """
    cfg, violations, given = load_layers(files, overrides)
    violations += validate(cfg, world_size, given)
    if reads is not None:  # a problem's line starts with its key: key=value: rule; fix: ...
        violations = [line for line in violations if (key := line.partition("=")[0]) not in SCHEMA or reads(key)]
    if violations:
        raise ConfigError(violations)
    notes = resolve(cfg) + secret_notes(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg, notes
