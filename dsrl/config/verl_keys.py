"""Keys the typed tree does not know: verl's FSDP/Megatron-only keys with the rule and the dsrl key to use
instead, and "did you mean" for the rest."""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any

from dsrl.config.keys import LEAF_KEYS, SCHEMA
from dsrl.config.problems import violation


def _ds_config_key(key: str) -> str:
    """The deepspeed_config key of the role (actor, ref, critic) a verl FSDP key belongs to."""
    if key.startswith("critic"):
        return "critic.deepspeed_config"
    if key.startswith("actor_rollout_ref.ref"):
        return "actor_rollout_ref.ref.deepspeed_config"
    return "actor_rollout_ref.actor.deepspeed_config"


# verl's LoRA keys of a model section (dsrl reads them on the actor's)
LORA_KEYS = ("lora_rank", "lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path")


def verl_only_key(key: str) -> tuple[str, str] | None:
    """(rule, fix) for a verl key that dsrl replaces or does not need; None for other keys."""
    ds = _ds_config_key(key)
    offloaded = "zero3_offload_inference" if ds.startswith("actor_rollout_ref.ref") else "zero3_offload"
    if fnmatch.fnmatchcase(key, "*fsdp_config.*offload*"):
        return (
            "verl FSDP key; dsrl shards with DeepSpeed ZeRO",
            f"set {ds}: {offloaded} to offload to CPU (zero3 keeps everything on the device)",
        )
    if ".fsdp_config" in key or ".megatron" in key:
        return (
            "verl FSDP/Megatron key; dsrl always trains with DeepSpeed ZeRO",
            f"remove it and choose the ZeRO setup with {ds}: zero3_offload | zero3 | zero2 or a path to a DeepSpeed "
            "JSON",
        )
    if key.endswith((".zero_stage", ".offload")):
        return (
            "verl DeepSpeed-engine key; dsrl picks the whole ZeRO setup by name",
            f"set {ds}: zero2 (stage 2) | zero3 (stage 3) | {offloaded} (stage 3, offloaded to CPU), or a DeepSpeed "
            "JSON path",
        )
    if key.endswith((".rollout.response_length", ".rollout.prompt_length")):
        which = key.rpartition(".")[2].replace("_length", "")
        return ("verl fills it from data.*", f"set data.max_{which}_length")
    if key == "data.return_raw_chat":
        return (
            "dsrl applies the chat template when loading and hands the rollout token ids; no raw chat reaches it",
            "remove it (the prompt the model sees is the same)",
        )
    if key.endswith(".optim.total_training_steps"):
        return ("verl fills it in from the trainer", "set trainer.total_training_steps (the lr schedule spans it)")
    if key.endswith(".optim.zero_indexed_step"):
        return ("dsrl's schedules count from step 0, verl's default (zero_indexed_step=true)", "remove it")
    if key == "actor_rollout_ref.ref.ulysses_sequence_parallel_size":
        return (
            "the reference runs with the actor's sequence-parallel groups (DeepSpeed keeps one size per process)",
            "remove it; set actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        )
    if key.endswith("ulysses_sequence_parallel_size"):
        return (
            "dsrl's sequence parallelism runs the actor, the reference and the critic",
            "remove it; set actor_rollout_ref.actor.ulysses_sequence_parallel_size (or critic.'s)",
        )
    if key in ("trainer.n_gpus_per_node", "trainer.nnodes"):
        return (
            "the deepspeed launcher decides the devices and nodes",
            "remove it; run deepspeed --num_gpus N [--hostfile FILE] scripts/train.py ...",
        )
    if key == "trainer.use_v1":
        return (
            "verl's switch to its V1 trainer; dsrl reads trainer.v1.* always",
            "remove it; trainer.v1.trainer_mode=colocate_async turns partial rollout on (sync is the default)",
        )
    if key.startswith(("trainer.v1.separate_async.", "trainer.v1.sampler.", "trainer.v1.sync")):
        return (
            "verl V1's split placement, its custom samplers and its sync refill of failed groups: dsrl's rollout runs "
            "on the training ranks, its sampler is the dataset's, and a failed reward scores reward.fallback_score",
            "remove it (trainer.v1.trainer_mode: sync | colocate_async; trainer.v1.sampler.max_off_policy_threshold "
            "and max_off_policy_strategy bound the staleness)",
        )
    if key.endswith((".ppo_micro_batch_size", ".log_prob_micro_batch_size")):
        return ("verl's deprecated global micro-batch size", f"set {key}_per_gpu (sequences per forward on one rank)")
    if key.rpartition(".")[2] in ("pad_to_length", "pad_to_length_bucket"):
        return (
            "verl pads packed rows to fixed buckets so compiled (XLA) graphs are reused; dsrl runs eager PyTorch and "
            "packs rows to their own length",
            "remove it (actor_rollout_ref.model.use_remove_padding=true packs)",
        )
    if key == "actor_rollout_ref.model.use_fused_kernels":
        return ("in dsrl this key lives under the actor", "set actor_rollout_ref.actor.use_fused_kernels")
    if key == "actor_rollout_ref.actor.compute_sum_pi_squared":
        return (
            "older verl name",
            "set actor_rollout_ref.actor.calculate_sum_pi_squared (optimal_token_baseline turns it on itself)",
        )
    if key.startswith(("sandbox_fusion.", "reward_model.sandbox_fusion.")):
        rule = (
            "verl 0.9.1's legacy place of reward.sandbox_fusion.*, which verl moves there at start-up; dsrl reads "
            "the new place only"
            if key.startswith("sandbox_fusion.")
            else "verl 0.4-0.6's place of reward.sandbox_fusion.* (verl 0.9.1 no longer reads it)"
        )
        return rule, f"set reward.sandbox_fusion.{key.rpartition('.')[2]}"
    if key.startswith(("reward.reward_manager", "reward.reward_kwargs")):
        older = (
            "reward_model.reward_manager"
            if key.startswith("reward.reward_manager")
            else "reward_model" + key[len("reward") :]
        )
        return ("verl 0.9.1's new place of a reward_model key; dsrl reads verl's reward_model.* names", f"set {older}")
    if key.startswith("critic.model.") and key.rpartition(".")[2] in LORA_KEYS:
        return (
            "the critic trains in full (LoRA is on the actor only: actor_rollout_ref.model.lora_rank)",
            "remove it; GRPO-family estimators need no critic at all",
        )
    return _model_key(key)


# verl's places of the reward model's switch and checkpoint, by the dsrl key that holds them
_RM_NAMES = {
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
}
_TOPK_KEYS = ("topk", "log_prob_min_clamp", "use_chunked_topk", "chunked_topk_chunk_size")


def _model_key(key: str) -> tuple[str, str] | None:
    """(rule, fix) for verl's reward-model and distillation keys that dsrl does not read."""
    if key in _RM_NAMES:
        return (
            "verl 0.9.1's new place of a reward_model key; dsrl reads verl's reward_model.* names",
            f"set {_RM_NAMES[key]}",
        )
    if key == "reward_model.model.input_tokenizer":
        return (
            "dsrl compares the reward model's tokenizer and chat template with the policy's and re-tokenises each "
            "conversation with the reward model's own where they differ",
            "remove it",
        )
    if key.startswith(("reward_model.", "reward.reward_model.")):
        return (
            "verl serves its reward model (vLLM/SGLang rollout, resource pool, workers); dsrl's is a DeepSpeed engine "
            "on the training ranks",
            "remove it (reward_model.deepspeed_config, micro_batch_size_per_gpu, use_dynamic_bsz and "
            "forward_max_token_len_per_gpu set that engine)",
        )
    if key.startswith("distillation.distillation_loss.") and key.rpartition(".")[2] in _TOPK_KEYS:
        return (
            "read only by verl's forward_kl_topk loss, which needs the student's logits inside the loss and is not "
            "built in dsrl",
            "remove it (loss_mode k1 | k2 | k3 | abs)",
        )
    if key.startswith(("distillation.n_gpus_per_node", "distillation.nnodes")) or key.startswith(
        (
            "distillation.teacher_models.teacher_model.num_replicas",
            "distillation.teacher_models.teacher_model.inference",
        )
    ):
        return (
            "verl serves its teacher in a resource pool of its own; dsrl's runs on the training ranks as a DeepSpeed "
            "engine, as the reference does",
            "remove it (distillation.teacher_models.teacher_model.deepspeed_config sets that engine)",
        )
    if key.startswith(("distillation.teacher_models.", "distillation.teacher_key")):
        return (
            "dsrl has one teacher and routes no rows between teachers",
            "remove it; set distillation.teacher_models.teacher_model.model_path",
        )
    return None


def unknown_key(key: str, value: Any) -> str:
    verl_only = verl_only_key(key)
    if verl_only is not None:
        return violation(key, value, *verl_only)
    close = difflib.get_close_matches(key, LEAF_KEYS, n=1, cutoff=0.6)
    if close:
        return violation(key, value, "unknown key", f"did you mean {close[0]}?")
    section = key.rpartition(".")[0]
    while section and section not in SCHEMA:  # the deepest section the key would sit in
        section = section.rpartition(".")[0]
    listing = f"python scripts/train.py --show-keys {section}".rstrip()
    return violation(key, value, "unknown key", f"remove it (no dsrl key is close; {listing} lists the keys)")
