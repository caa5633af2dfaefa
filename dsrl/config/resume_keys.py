"""The keys a resumed run may change; the checkpoint holds every other key and resume compares them."""

from __future__ import annotations

# Keys (regular expressions over dotted keys) that may change when a run resumes: how long it runs, how
# often it validates and saves, where it logs. Every other key shapes the run and must match the checkpoint
# unless trainer.resume_allow_config_change is set.
RESUME_HARMLESS_KEYS = (
    r"trainer\.(total_epochs|total_training_steps|save_freq|test_freq|val_before_train|val_only|logger)",
    r"trainer\.(log_val_generations|log_samples_freq|log_model|memory_plan_check)",
    r"reward\.(num_workers|batch_chunk_size|max_failed_steps|memory_limit_mb|log_max_mb)",
    r"reward\.sandbox_fusion\.(url|max_concurrent)",
    r"trainer\.(project_name|experiment_name|default_local_dir|max_consecutive_skips)",
    r"trainer\.(resume_mode|resume_from_path|resume_allow_config_change|resume_allow_world_size_change)",
    r"trainer\.(max_actor_ckpt_to_keep|max_critic_ckpt_to_keep)",
    r"data\.(val_files|val_batch_size)",
    r"actor_rollout_ref\.rollout\.val_kwargs\..*",
    r"actor_rollout_ref\.actor\.checkpoint\..*",
    r"actor_rollout_ref\.nccl_timeout",
    # how ranks split each row, not what the run computes (the same numbers up to float rounding)
    r"(actor_rollout_ref\.actor|critic)\.ulysses_sequence_parallel_size",
    r"algorithm\.rollout_mismatch\..*",
)
