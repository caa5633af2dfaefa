"""The run's own rules: the reward worker pool and the custom reward function, the reward manager (DAPO's overlong
punishment), and the trainer (data columns and limits, loggers, precision, checkpoints, resuming, step counts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dsrl.config.keys import value_at
from dsrl.config.names import (
    CHECKPOINT_CONTENTS,
    LOGGERS,
    MEMORY_PLAN_CHECKS,
    MODEL_DTYPES,
    OFF_POLICY_STRATEGIES,
    REQUIRED_CHECKPOINT_CONTENTS,
    RESUME_MODES,
    REWARD_MANAGERS,
    TRAINER_MODES,
    TRUNCATION_MODES,
)
from dsrl.config.problems import show
from dsrl.config.rules.need import Need
from dsrl.config.schema import Config
from dsrl.config.user_code import estimator_needs
from dsrl.workers.sandbox_fusion import DEFAULT_RUN_TIMEOUT_S, url_problem


def reward_rules(cfg: Config, need: Need) -> None:
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
    sandbox_fusion_rules(cfg, need)
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


def sandbox_fusion_rules(cfg: Config, need: Need) -> None:
    """reward.sandbox_fusion.*: a server's URL, and a reward call long enough for the test cases it runs."""
    sandbox, prefix = cfg.reward.sandbox_fusion, "reward.sandbox_fusion"
    need(sandbox.max_concurrent >= 1, f"{prefix}.max_concurrent", "must be >= 1 request", "set it to 64")
    need(sandbox.memory_limit_mb >= 1, f"{prefix}.memory_limit_mb", "must be >= 1 MB", "set it to 1024")
    if sandbox.url is None:
        return
    problem = url_problem(sandbox.url)
    need(
        problem is None,
        f"{prefix}.url",
        problem,
        "set it to the server's /run_code URL, e.g. http://localhost:8080/run_code, or to null",
    )
    need(
        cfg.reward.timeout_s > DEFAULT_RUN_TIMEOUT_S,
        "reward.timeout_s",
        f"with {prefix}.url set, a code row runs its test cases on the server, each for up to "
        f"{DEFAULT_RUN_TIMEOUT_S:g} s (verl's limit); a reward call this short would be killed before a slow but "
        "correct solution is judged",
        "set reward.timeout_s=30",
    )


def reward_manager_rules(cfg: Config, need: Need) -> None:
    """reward_model.*: the manager's name, and DAPO's overlong punishment set only where it applies, with a
    buffer inside the length it ends at (verl asserts the same at start-up)."""
    manager, kwargs = cfg.reward_model.reward_manager, cfg.reward_model.reward_kwargs
    buffer, prefix = kwargs.overlong_buffer_cfg, "reward_model.reward_kwargs"
    need(
        manager in REWARD_MANAGERS,
        "reward_model.reward_manager",
        "unknown reward manager",
        f"use one of {', '.join(REWARD_MANAGERS)}",
    )
    if not buffer.enable:
        defaults = (("len", 0), ("penalty_factor", 0.0), ("log", False))
        for name, default in defaults:
            need(
                value_at(buffer, name) == default,
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


def trainer_rules(cfg: Config, need: Need) -> None:
    trainer, data = cfg.trainer, cfg.data
    need(
        data.truncation in TRUNCATION_MODES,
        "data.truncation",
        "unknown truncation",
        f"use one of {', '.join(TRUNCATION_MODES)}",
    )
    need(data.prompt_key, "data.prompt_key", "must name a column", "set it to prompt")
    for key in ("train_max_samples", "val_max_samples"):
        rows = getattr(data, key)
        need(rows == -1 or rows >= 1, f"data.{key}", "must be >= 1, or -1 for all rows", "set it to -1")
    need(
        trainer.log_val_generations >= 0, "trainer.log_val_generations", "must be >= 0", "set it to 0 (none) or e.g. 16"
    )
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
            value_at(cfg, f"{role}.strategy") == "deepspeed",
            f"{role}.strategy",
            "dsrl trains with DeepSpeed ZeRO only (no FSDP or Megatron)",
            f"remove it and choose the ZeRO setup with {role}.deepspeed_config: zero3_offload | zero3 | zero2 or a "
            "JSON path",
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
            value_at(cfg, key) == -1 or value_at(cfg, key) >= 1,
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
        kept = value_at(cfg, key)
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


def partial_rollout_rules(cfg: Config, need: Need) -> None:
    """verl V1's trainer modes (``trainer.v1``): sync, or partial rollout inside colocation. What carries a group
    across steps is a response's tokens, log-probs and conversation; what holds more than that (a recorded route, a
    greedy baseline) is refused until it is carried too."""
    v1 = cfg.trainer.v1
    key = "trainer.v1.trainer_mode"
    need(
        v1.trainer_mode in TRAINER_MODES,
        key,
        "unknown trainer mode (separate_async, verl's split placement, needs rollout-only ranks: dsrl has none)",
        f"use one of {', '.join(TRAINER_MODES)}",
    )
    sampler, colocate = v1.sampler, v1.colocate_async
    need(colocate.num_warmup_batches >= 0, "trainer.v1.colocate_async.num_warmup_batches", "must be >= 0",
         "set it to 1 (verl's default)")  # fmt: skip
    need(colocate.chunk_tokens is None or colocate.chunk_tokens >= 1, "trainer.v1.colocate_async.chunk_tokens",
         "must be >= 1 or null", "set it to null (data.max_response_length // 8)")  # fmt: skip
    need(sampler.max_off_policy_threshold is None or sampler.max_off_policy_threshold >= 1,
         "trainer.v1.sampler.max_off_policy_threshold", "must be >= 1 (a group spans at least one version) or null",
         "set it to 8 (verl's default)")  # fmt: skip
    need(sampler.max_off_policy_strategy in OFF_POLICY_STRATEGIES, "trainer.v1.sampler.max_off_policy_strategy",
         "unknown strategy", f"use one of {', '.join(OFF_POLICY_STRATEGIES)}")  # fmt: skip
    if v1.trainer_mode != "colocate_async":
        return
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    fix = "or trainer.v1.trainer_mode=sync"
    for refused, what, how in (
        ("greedy_baseline" in estimator_needs(algo.adv_estimator), "ReMax's greedy baselines", "another estimator"),
        (arr.rollout.enable_rollout_routing_replay, "recorded routes (R3)", "actor.router_replay.mode=R2"),
        (cfg.trainer.resume_allow_world_size_change, "a resume at another world size (the groups in flight are each "
         "rank's)", "trainer.resume_allow_world_size_change=false"),
    ):  # fmt: skip
        need(not refused, key, f"partial rollout does not carry {what} across steps yet", f"use {how}, {fix}")
