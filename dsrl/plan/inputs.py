"""What the memory plan reads: the device's memory (``--device-memory``, ``nvidia-smi``, or the machine's on a CPU)
and, from a validated config and its roles' DeepSpeed JSON files, every setting a term depends on (``PlanInputs``).
Nothing here counts what a phase holds; the plan's fixes are tried by replacing fields of a ``PlanInputs``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsrl.config.deepspeed_json import read_ds_json, zero_stage
from dsrl.config.loading import rollout_name
from dsrl.config.names import ADV_ESTIMATORS
from dsrl.config.schema import lora_enabled, prompts_per_round, reward_model_length
from dsrl.config.user_code import estimator_needs
from dsrl.plan.shape import DTYPE_BYTES, ModelShape, read_shape

# DeepSpeed's defaults for the ZeRO keys the plan reads, where the JSON leaves them out.
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}


# ---- the device ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """The memory one rank's device has (``kind`` "cuda"), or the machine's memory all its ranks share ("cpu")."""

    kind: str
    bytes: int
    source: str  # how it was found, for the header


def parse_size(text: str) -> int:
    """Bytes of a size such as ``141GiB``, ``80GB``, ``512MiB`` (a bare number is GiB); raises ValueError."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r}: not a size; write e.g. 141GiB, 80GB or 512MiB")
    number, unit = float(match[1]), (match[2] or "GiB").upper().rstrip("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    if int(number * scale) < 1:
        raise ValueError(f"{text!r}: a device's memory is more than 0 bytes; write e.g. 141GiB, 80GB or 512MiB")
    return int(number * scale)


def detect_device() -> Device | None:
    """This machine's accelerator, without torch: the smallest GPU ``nvidia-smi`` lists; with ``DS_ACCELERATOR=cpu``
    the CPU, whose memory is the machine's (``MemTotal``); None when neither (a machine without GPUs that may be
    checking a config for one: the plan then needs ``--device-memory``)."""
    if os.environ.get("DS_ACCELERATOR", "") == "cpu":
        meminfo = Path("/proc/meminfo").read_text()
        total_kib = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo)[1])
        return Device("cpu", total_kib * 1024, "DS_ACCELERATOR=cpu: the machine's memory")
    if shutil.which("nvidia-smi"):
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        sizes = [int(line) for line in result.stdout.split() if line.strip().isdigit()]
        if result.returncode == 0 and sizes:
            return Device("cuda", min(sizes) * 2**20, "nvidia-smi")
    return None


# ---- what the plan reads of the config -------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroSetup:
    """A role's ZeRO setup, as its DeepSpeed JSON gives it."""

    stage: int
    offload_param: bool
    offload_optimizer: bool
    pinned: bool
    reduce_bucket: int
    prefetch_bucket: int
    max_live_parameters: int
    grad_accum_dtype: str | None
    sub_group_size: int = ZERO_DEFAULTS["sub_group_size"]  # ZeRO-3 steps the optimizer this many elements at a time

    @classmethod
    def from_json(cls, ds: dict[str, Any]) -> ZeroSetup:
        zero = {**ZERO_DEFAULTS, **ds.get("zero_optimization", {})}

        def offloaded(name: str) -> bool:
            return (zero.get(name) or {}).get("device", "none") not in ("none", None)

        pinned = any(
            offloaded(name) and zero[name].get("pin_memory", False) for name in ("offload_param", "offload_optimizer")
        )
        return cls(
            stage=zero_stage(ds),
            offload_param=offloaded("offload_param"),
            offload_optimizer=offloaded("offload_optimizer"),
            pinned=pinned,
            reduce_bucket=int(zero["reduce_bucket_size"]),
            prefetch_bucket=int(zero["stage3_prefetch_bucket_size"]),
            max_live_parameters=int(zero["stage3_max_live_parameters"]),
            grad_accum_dtype=ds.get("data_types", {}).get("grad_accum_dtype"),
            sub_group_size=int(zero["sub_group_size"]),
        )

    def describe(self) -> str:
        offload = [name for name, on in (("params", self.offload_param), ("optimizer", self.offload_optimizer)) if on]
        return f"ZeRO-{self.stage}" + (f", {' + '.join(offload)} offloaded" if offload else "")


@dataclass(frozen=True)
class Pass:
    """One pass's micro-batch: ``rows`` sequences of ``prompt + response`` tokens (``rows`` already bounded by the
    rows a rank has in that pass), or ``budget`` tokens (``use_dynamic_bsz``) filled with full-length rows, as many
    as the ``rows`` a rank has."""

    rows: int
    budget: int | None = None

    def sequences(self, length: int) -> int:
        return min(self.rows, max(1, self.budget // length)) if self.budget is not None else self.rows


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads, taken from the config (``inputs_from_config``); fixes are tried by replacing
    fields of it."""

    shape: ModelShape
    world_size: int
    dtype_bytes: int
    prompt_length: int
    response_length: int
    actor: ZeroSetup
    actor_trained: int  # trained parameters: all, or LoRA's adapters
    actor_checkpointing: bool
    layout: str  # of the actor's and the reference's forwards: padded | shared_prompts | packed | dedup
    fused_head: bool  # their log-prob head: chunks of logits from the hidden states (use_fused_kernels)
    sequence_parallel: int  # ranks sharing each of their micro-batches (ulysses_sequence_parallel_size)
    update: Pass
    old_log_prob: Pass | None  # None when folded into the update
    ref: ZeroSetup | None  # the reference engine; None without a KL term or with LoRA
    ref_pass: Pass | None  # the reference forward (the actor's engine with LoRA); None without a KL term
    critic: ZeroSetup | None
    critic_checkpointing: bool
    critic_update: Pass | None
    critic_values: Pass | None
    critic_layout: str  # packed (critic.model.use_remove_padding) | padded
    critic_sequence_parallel: int  # critic.ulysses_sequence_parallel_size
    rollout: str  # vllm | hf
    rollout_dtype_bytes: int
    n: int
    prompts_per_rank: int
    gpu_memory_utilization: float
    tensor_parallel: int
    sleep_mode: bool
    sleep_level: int
    hf_micro_batch: int
    hf_kv_max_bytes: int | None
    # The frozen models beside the reference, each read from its own config.json, forward only like it.
    reward_model: ZeroSetup | None  # reward_model.enable; None without
    reward_shape: ModelShape | None  # a sequence-classification model: the backbone and a score head
    reward_pass: Pass | None  # reward_model.micro_batch_size_per_gpu, or forward_max_token_len_per_gpu
    reward_length: int  # tokens of a sequence it reads: reward_model.max_length (null: prompt + response)
    reward_in_generation: bool  # dynamic sampling scores each round inside the colocated generation
    teacher: ZeroSetup | None  # distillation.enabled; None without
    teacher_shape: ModelShape | None
    teacher_pass: Pass | None  # the reference's micro-batch keys (actor_rollout_ref.ref.log_prob_*)


def forward_layout(shared_prompt_forward: bool, use_remove_padding: bool, use_prefix_grouper: bool) -> str:
    """How the actor's and the reference's forwards lay out a micro-batch (``PlanInputs.layout``)."""
    if use_remove_padding:
        return "dedup" if use_prefix_grouper else "packed"
    return "shared_prompts" if shared_prompt_forward else "padded"


def _pass(rows: int, micro: int, dynamic: bool, budget: int) -> Pass:
    """A pass over ``rows`` rows a rank: micro-batches of ``micro`` rows, or of ``budget`` tokens (``dynamic``)."""
    if dynamic:
        return Pass(rows=max(1, rows), budget=budget)
    return Pass(rows=min(micro, max(1, rows)))


def _frozen_shape(path: str, key: str, actor_path: str, actor_shape: ModelShape) -> ModelShape:
    """The shape of a model beside the actor (the reward model, the teacher) from its own config.json; the actor's
    ``shape`` (which ``--model-config`` may give) when it is the actor's model."""
    return actor_shape if path == actor_path else read_shape(path, key=key)


def inputs_from_config(cfg: Any, world_size: int, shape: ModelShape, device: Device) -> PlanInputs:
    """The plan's inputs from a validated, resolved config at ``world_size`` ranks on ``device``; ``shape``: the
    actor's. The reward model's and the teacher's shapes are read from their own config.json (PlanError when it
    is not here)."""
    arr, data, algo = cfg.actor_rollout_ref, cfg.data, cfg.algorithm
    sp = arr.actor.ulysses_sequence_parallel_size  # a group's token budget is sp ranks' (verl's)
    model, actor, rollout = arr.model, arr.actor, arr.rollout
    n, N = rollout.n, world_size
    batch_rows = data.train_batch_size * n // N  # rows per rank in a step
    mini_rows = actor.ppo_mini_batch_size * n // N
    lora = lora_enabled(model)
    needs_kl = actor.use_kl_loss or algo.use_kl_in_reward
    needs_ref = needs_kl and not lora  # a LoRA actor is its own reference, with the adapters off
    needs = estimator_needs(algo.adv_estimator)
    trains_critic = "critic" in needs
    correction = algo.rollout_correction
    # Trainer.folds_old_log_prob: an exactly on-policy update whose step reads no old log-probs before it runs
    # the pass inside the update; the built-in estimators but those of sum_pi_squared read no policy.
    folds = correction.bypass_mode or (
        actor.ppo_mini_batch_size == data.train_batch_size
        and actor.ppo_epochs == 1
        and not algo.use_kl_in_reward
        and not (correction.rollout_is or correction.rollout_rs)
        and not actor.calculate_sum_pi_squared
        and algo.adv_estimator in ADV_ESTIMATORS
        and "sum_pi_squared" not in needs
        and not actor.mask_truncated_completions
    )
    name = rollout_name(cfg)
    sleep = rollout.enable_sleep_mode
    if sleep is None:
        sleep = device.kind == "cuda"
    critic = cfg.critic
    critic_sp = critic.ulysses_sequence_parallel_size
    rm, teacher = cfg.reward_model, cfg.distillation.teacher_models.teacher_model
    # Dynamic sampling scores each round of gen_batch_size prompts as it is generated (the config refuses the reward
    # model beside dynamic sampling under partial rollout, which would score groups as they complete).
    in_generation = algo.filter_groups.enable
    reward_rows = prompts_per_round(data) // N * n if in_generation else batch_rows
    ref_pass = _pass(  # the reference's micro-batch: its forward's and the teacher's
        batch_rows,
        arr.ref.log_prob_micro_batch_size_per_gpu,
        arr.ref.log_prob_use_dynamic_bsz,
        arr.ref.log_prob_max_token_len_per_gpu * sp,
    )
    return PlanInputs(
        shape=shape,
        world_size=N,
        dtype_bytes=DTYPE_BYTES[model.dtype],
        prompt_length=data.max_prompt_length,
        response_length=data.max_response_length,
        actor=ZeroSetup.from_json(read_ds_json(actor.deepspeed_config, "actor_rollout_ref.actor.deepspeed_config")),
        actor_trained=shape.lora_parameters(model.lora_rank, model.target_modules) if lora else shape.parameters(),
        actor_checkpointing=model.enable_gradient_checkpointing,
        layout=forward_layout(model.shared_prompt_forward, model.use_remove_padding, actor.use_prefix_grouper),
        fused_head=actor.use_fused_kernels,
        sequence_parallel=sp,
        update=_pass(
            mini_rows, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu * sp
        ),
        old_log_prob=None
        if folds
        else _pass(
            batch_rows,
            rollout.log_prob_micro_batch_size_per_gpu,
            rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu * sp,
        ),
        ref=ZeroSetup.from_json(read_ds_json(arr.ref.deepspeed_config, "actor_rollout_ref.ref.deepspeed_config"))
        if needs_ref
        else None,
        ref_pass=ref_pass if needs_kl else None,
        critic=ZeroSetup.from_json(read_ds_json(critic.deepspeed_config, "critic.deepspeed_config"))
        if trains_critic
        else None,
        critic_checkpointing=critic.model.enable_gradient_checkpointing,
        critic_update=_pass(
            critic.ppo_mini_batch_size * n // N,
            critic.ppo_micro_batch_size_per_gpu,
            critic.use_dynamic_bsz,
            critic.ppo_max_token_len_per_gpu * critic_sp,
        )
        if trains_critic
        else None,
        critic_values=_pass(
            batch_rows,
            critic.forward_micro_batch_size_per_gpu,
            critic.use_dynamic_bsz,
            critic.forward_max_token_len_per_gpu * critic_sp,
        )
        if trains_critic
        else None,
        critic_layout="packed" if critic.model.use_remove_padding else "padded",
        critic_sequence_parallel=critic_sp,
        rollout=name,
        rollout_dtype_bytes=DTYPE_BYTES[rollout.dtype or model.dtype],
        n=n,
        prompts_per_rank=prompts_per_round(data) // N,  # a generation round's
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        tensor_parallel=rollout.tensor_model_parallel_size,
        sleep_mode=bool(sleep) and name == "vllm",
        sleep_level=rollout.sleep_level,
        hf_micro_batch=rollout.micro_batch_size,
        hf_kv_max_bytes=None if rollout.kv_cache_max_gb is None else int(rollout.kv_cache_max_gb * 1e9),
        reward_model=ZeroSetup.from_json(read_ds_json(rm.deepspeed_config, "reward_model.deepspeed_config"))
        if rm.enable
        else None,
        reward_shape=_frozen_shape(rm.model.path, "reward_model.model.path", model.path, shape) if rm.enable else None,
        reward_pass=_pass(
            reward_rows, rm.micro_batch_size_per_gpu, rm.use_dynamic_bsz, rm.forward_max_token_len_per_gpu
        )
        if rm.enable
        else None,
        reward_length=reward_model_length(cfg),
        reward_in_generation=in_generation,
        teacher=ZeroSetup.from_json(
            read_ds_json(teacher.deepspeed_config, "distillation.teacher_models.teacher_model.deepspeed_config")
        )
        if cfg.distillation.enabled
        else None,
        teacher_shape=_frozen_shape(
            teacher.model_path, "distillation.teacher_models.teacher_model.model_path", model.path, shape
        )
        if cfg.distillation.enabled
        else None,
        teacher_pass=ref_pass if cfg.distillation.enabled else None,
    )
