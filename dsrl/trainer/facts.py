"""What the console's summaries (``dsrl.tracking.console.startup_summary``, ``final_summary``) and MLflow's tags say
about a run, gathered from a built trainer: its engines' setup, the rollout, the batch geometry, where its
checkpoints, model and MLflow run are."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from dsrl.checkpoint.save import adapter_dir
from dsrl.config import Config, reward_model_length
from dsrl.engines.lora import ADAPTER, trainable_parameter_count


def rollout_engine_name(cfg: Config, tool_names: list[str] | None = None) -> str:
    """The engine, and with multi-turn (``tool_names``) the tools and the turn limit."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm":
        name = f"vllm (tensor parallel {rollout.tensor_model_parallel_size}, sleep level {rollout.sleep_level})"
    else:
        name = "hf (transformers generate)"
    if tool_names is None:
        return name
    turns = rollout.multi_turn.max_assistant_turns
    return f"{name}, multi-turn with tools {', '.join(tool_names)}, {turns or 'unlimited'} turns at most"


def engine_facts(role, dtype: str) -> dict:
    """ZeRO stage, offload, dtype, parameter count, sequence-parallel group size and activation checkpointing of a
    DeepSpeed role; LoRA's rank, alpha and trainable parameters for a LoRA actor; ``adapters_off`` for the reference
    that is one."""
    if not hasattr(role, "ds_config"):  # AdapterOffReference: no engine of its own
        return {"adapters_off": True}
    zero = role.ds_config.get("zero_optimization", {})
    offloaded = lambda section: zero.get(section, {}).get("device", "none") not in ("none", None)  # noqa: E731
    module = role.engine.module
    facts = {
        "zero_stage": zero.get("stage", 0),
        "offload_params": offloaded("offload_param"),
        "offload_optimizer": offloaded("offload_optimizer"),
        "dtype": dtype,
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),  # full size under ZeRO-3
    }
    sp = getattr(role, "sp", None)  # the reward model has none: its forward runs no sequence parallelism
    if sp is not None:
        facts["sequence_parallel"] = sp.size
    if hasattr(role, "lr_scheduler"):  # a trained role
        backbone = getattr(module, "backbone", module)
        facts["gradient_checkpointing"] = bool(getattr(backbone, "is_gradient_checkpointing", False))
    if getattr(role, "lora", False):
        facts["lora"] = lora_facts(module)
    return facts


def reward_model_facts(cfg: Config, engine) -> dict[str, Any]:
    """The reward model's engine (``engine_facts``; it loads in the actor's dtype, as the reference), checkpoint,
    micro-batches (a count or, with ``use_dynamic_bsz``, a token budget per rank) and the longest sequence it reads."""
    rm = cfg.reward_model
    return {
        **engine_facts(engine, cfg.actor_rollout_ref.model.dtype),
        "path": rm.model.path,
        "micro_batch_size": rm.micro_batch_size_per_gpu,
        "max_token_len": rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
        "max_length": reward_model_length(cfg),
    }


def distillation_facts(cfg: Config, teacher) -> dict[str, Any]:
    """The teacher's engine, checkpoint and micro-batches (the reference's keys), and how its log-probs train the
    student: the loss mode, as a policy-gradient reward or a supervised loss, alone or beside the task's (coef)."""
    ref, loss = cfg.actor_rollout_ref.ref, cfg.distillation.distillation_loss
    return {
        "teacher": {
            **engine_facts(teacher, cfg.actor_rollout_ref.model.dtype),
            "path": cfg.distillation.teacher_models.teacher_model.model_path,
            "micro_batch_size": ref.log_prob_micro_batch_size_per_gpu,
            "max_token_len": ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
        },
        "loss_mode": loss.loss_mode,
        "use_policy_gradient": loss.use_policy_gradient,
        "use_task_rewards": loss.use_task_rewards,
        "coef": loss.distillation_loss_coef,
    }


def lora_facts(module) -> dict[str, Any]:
    """A LoRA actor's adapter (a ``PeftModel``) as PEFT resolved it: rank, alpha, the adapted module names
    (``all-linear`` expanded) and the number of trainable parameters. Shown at start-up, logged as MLflow params."""
    settings = module.peft_config[ADAPTER]
    targets = settings.target_modules
    return {
        "rank": settings.r,
        "alpha": settings.lora_alpha,
        "target_modules": targets if isinstance(targets, str) else ",".join(sorted(targets)),
        "trainable": trainable_parameter_count(module),
    }


def run_tags(cfg: Config, world_size: int) -> dict[str, str]:
    """MLflow tags that tell runs apart: dsrl's version and git commit, algorithm, model, world size."""
    try:
        version = importlib.metadata.version("dsrl")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    tags = {
        "dsrl.version": version,
        "dsrl.algorithm": cfg.algorithm.adv_estimator,
        "dsrl.model": cfg.actor_rollout_ref.model.path,
        "dsrl.world_size": str(world_size),
    }
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / ".git").exists():  # a checkout, not an installed wheel
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
        if commit.returncode == 0:
            tags["dsrl.git_commit"] = commit.stdout.strip()
    return tags


def startup_facts(trainer) -> dict[str, Any]:
    """What ``dsrl.tracking.console.startup_summary`` shows about a built ``dsrl.trainer.loop.Trainer``."""
    cfg, actor = trainer.cfg, trainer.cfg.actor_rollout_ref.actor
    n = cfg.actor_rollout_ref.rollout.n
    rows_per_rank = cfg.data.train_batch_size * n // trainer.world_size
    roles = {"actor": trainer.actor, "reference": trainer.ref, "critic": trainer.critic}
    steps = {
        name: -(-rows_per_rank // role.rows_per_mini_batch) * epochs
        for name, role, epochs in (
            ("actor", trainer.actor, actor.ppo_epochs),
            ("critic", trainer.critic, cfg.critic.ppo_epochs),
        )
        if role is not None
    }
    algo = cfg.algorithm
    device = get_accelerator().device_name()
    if torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name()})"
    return {
        "world_size": trainer.world_size,
        "hosts": trainer.cluster.describe() if trainer.cluster is not None else None,
        "device": device,
        "roles": {
            name: None if role is None else engine_facts(role, cfg.actor_rollout_ref.model.dtype)
            for name, role in roles.items()
        },
        # the trainer builds these engines only when the config turns them on
        "reward_model": reward_model_facts(cfg, trainer.reward_model) if cfg.reward_model.enable else None,
        "distillation": distillation_facts(cfg, trainer.teacher) if cfg.distillation.enabled else None,
        "rollout": rollout_engine_name(cfg, None if trainer.tools is None else trainer.rollout.tool_names),
        "estimator": algo.adv_estimator,
        "policy_loss": actor.policy_loss.loss_mode,
        "loss_agg_mode": actor.loss_agg_mode,
        "kl_loss": {"type": actor.kl_loss_type, "coef": actor.kl_loss_coef} if actor.use_kl_loss else None,
        "kl_in_reward": {"penalty": algo.kl_penalty, "coef": algo.kl_ctrl.kl_coef, "ctrl": algo.kl_ctrl.type}
        if algo.use_kl_in_reward
        else None,
        "prompts_per_step": cfg.data.train_batch_size,
        "n": n,
        "optimizer_steps": {"actor": steps["actor"], "critic": steps.get("critic")},
        "micro_batch_size": actor.ppo_micro_batch_size_per_gpu,
        "max_token_len": actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        "prompts": trainer.prompt_stats,
        "total_steps": trainer.total_steps,
        "start_step": trainer.global_step,
        "resume_from": str(trainer.resume_from) if trainer.resume_from else None,
        "checkpoint_dir": str(trainer.checkpoint_root),
        "save_freq": cfg.trainer.save_freq,
        "mlflow": trainer.tracker.mlflow_facts(),
    }


def final_facts(trainer, *, status: str, wall_time_s: float) -> dict[str, Any]:
    """What ``dsrl.tracking.console.final_summary`` shows about a ``dsrl.trainer.loop.Trainer`` whose run ended with
    ``status``."""
    return {
        **trainer.tracker.console_facts(),
        "total_steps": trainer.total_steps,
        "initial_step": trainer.initial_step,
        "wall_time_s": wall_time_s,
        "status": status,
        "model_dir": str(trainer.model_dir) if trainer.model_dir else None,
        "adapter_dir": str(adapter) if (adapter := adapter_dir(trainer.model_dir)) else None,
        "checkpoint_dir": str(trainer.checkpoint_root),
        "last_checkpoint": str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
        "mlflow": trainer.tracker.mlflow_facts(),
        "cwd": os.getcwd(),
    }
