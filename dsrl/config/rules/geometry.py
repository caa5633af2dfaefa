"""The batch geometry against the world size: prompts per step and per generation round, the trained roles' mini- and
micro-batches, the no-grad passes' micro-batches and token budgets; and each role's DeepSpeed JSON, filled with that
geometry."""

from __future__ import annotations

from typing import Any

from dsrl.config.deepspeed_json import DeepSpeedJsonError, clip_grad, fill_ds_json
from dsrl.config.keys import value_at
from dsrl.config.rules.need import Need, critic_used, ref_used
from dsrl.config.schema import Config


def _sequence_parallel_size(cfg: Config, role: str) -> int:
    """The sequence-parallel group size of ``role``'s passes (the reference runs with the actor's groups)."""
    section = cfg.critic if role == "critic" else cfg.actor_rollout_ref.actor
    return max(1, section.ulysses_sequence_parallel_size)


def _holds_a_sequence(need: Need, key: str, budget: int, cfg: Config, role: str) -> None:
    """A token budget per rank holds one whole sequence; in a sequence-parallel group, the group's budget does."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    group = _sequence_parallel_size(cfg, role)
    rule = ("times ulysses_sequence_parallel_size " if group > 1 else "") + "must hold one whole sequence"
    need(budget * group >= longest, key, rule + " (max_prompt_length + max_response_length)",
         f"set it to at least {-(-longest // group)}")  # fmt: skip


def _sequence_parallel_rules(cfg: Config, world_size: int, need: Need) -> None:
    actor_key, critic_key = (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size",
    )
    roles = [(actor_key, cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size, "actor_rollout_ref.model")]
    if critic_used(cfg):
        roles.append((critic_key, cfg.critic.ulysses_sequence_parallel_size, "critic.model"))
    for key, sp, model in roles:
        need(sp >= 1, key, "must be >= 1 (1: no sequence parallelism)", "set it to 1, or to 2, 4, 8 ranks per row")
        if sp <= 1:
            continue
        need(
            value_at(cfg, model).use_remove_padding,
            key,
            "splits packed rows into sequence shards (a padded row's left padding would be attended across the shards)",
            f"set {model}.use_remove_padding=true",
        )
        need(world_size % sp == 0, key, f"does not divide the {world_size} ranks", "launch a multiple of it")
    sizes = {sp for _, sp, _ in roles if sp > 1}
    need(
        len(sizes) <= 1,
        critic_key,
        f"differs from {actor_key} (DeepSpeed keeps one sequence-parallel group size per process)",
        "set both to the same size, or one of them to 1",
    )
    need(
        not (cfg.actor_rollout_ref.actor.measure_grad_variance and roles[0][1] > 1),
        "actor_rollout_ref.actor.measure_grad_variance",
        "a micro-batch's gradient is spread over the sequence-parallel ranks, so no rank sees its norm",
        f"set it to false, or {actor_key}=1",
    )


def batch_rules(cfg: Config, world_size: int, need: Need) -> None:
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    model = cfg.actor_rollout_ref.model
    need(
        not (model.shared_prompt_forward and model.enable_gradient_checkpointing),
        "actor_rollout_ref.model.shared_prompt_forward",
        "needs the prompts' KV cache under autograd, which gradient checkpointing turns off",
        "set actor_rollout_ref.model.enable_gradient_checkpointing=false or shared_prompt_forward=false",
    )
    need(
        not (model.use_remove_padding and model.shared_prompt_forward),
        "actor_rollout_ref.model.use_remove_padding",
        "a packed forward takes no KV cache, and shared_prompt_forward runs the responses on the prompts' cache",
        "set actor_rollout_ref.model.shared_prompt_forward=false or use_remove_padding=false",
    )
    need(
        model.use_remove_padding or not cfg.actor_rollout_ref.actor.use_prefix_grouper,
        "actor_rollout_ref.actor.use_prefix_grouper",
        "dsrl runs a prompt once ahead of its responses inside packed rows (verl's grouper works on padded ones); "
        "padded forwards share prompts through a KV cache with shared_prompt_forward",
        "set actor_rollout_ref.model.use_remove_padding=true",
    )
    _sequence_parallel_rules(cfg, world_size, need)
    need(data.train_batch_size > 0, "data.train_batch_size", "must be > 0 (prompts per step)", "set it to e.g. 8")
    if data.train_batch_size > 0:
        _sharded_rule("data.train_batch_size", data.train_batch_size, world_size, need)
        _gen_batch_rules(cfg, world_size, need)
    need(
        rollout.n >= 1,
        "actor_rollout_ref.rollout.n",
        "must be >= 1 (responses per prompt)",
        "set it to 1, or 4-16 for group estimators",
    )
    need(
        data.val_batch_size is None or data.val_batch_size > 0,
        "data.val_batch_size",
        "must be > 0 or null",
        "set it to null (whole set) or a positive count",
    )
    need(
        data.max_prompt_length > 0,
        "data.max_prompt_length",
        "must be > 0",
        "set it to the longest prompt in tokens, e.g. 512",
    )
    need(data.max_response_length > 0, "data.max_response_length", "must be > 0", "set it to e.g. 512")
    actor = cfg.actor_rollout_ref.actor
    no_grad_passes: list[tuple[str, str, Any]] = [
        ("actor_rollout_ref.rollout", "log_prob_", actor),
        ("actor_rollout_ref.ref", "log_prob_", actor),
    ]
    if critic_used(cfg):
        no_grad_passes.append(("critic", "forward_", cfg.critic))
    for role, prefix, trained in no_grad_passes:
        section = value_at(cfg, role)
        micro, budget = f"{prefix}micro_batch_size_per_gpu", f"{prefix}max_token_len_per_gpu"
        need(section[micro] > 0, f"{role}.{micro}", "must be > 0 (sequences per forward)", "set it to e.g. 8")
        dynamic = section.use_dynamic_bsz if role == "critic" else section.log_prob_use_dynamic_bsz
        # The training budget it defaults to is checked with the training rules: one problem, one line.
        checked = trained.use_dynamic_bsz and section[budget] == trained.ppo_max_token_len_per_gpu
        if dynamic and not checked:
            _holds_a_sequence(need, f"{role}.{budget}", section[budget], cfg, role)
    _mini_batch_rules(cfg, "actor_rollout_ref.actor", world_size, need)
    if critic_used(cfg):
        _mini_batch_rules(cfg, "critic", world_size, need)


def _mini_batch_rules(cfg: Config, role: str, world_size: int, need: Need) -> None:
    """ppo_mini_batch_size and ppo_micro_batch_size_per_gpu of ``role`` (actor or critic) against the batch."""
    section = value_at(cfg, role)
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
    need(
        mini > 0,
        f"{role}.ppo_mini_batch_size",
        "must be > 0 (prompts per optimizer step)",
        "set it to a divisor of data.train_batch_size",
    )
    need(micro > 0, f"{role}.ppo_micro_batch_size_per_gpu", "must be > 0", "set it to e.g. 4")
    need(section.ppo_epochs >= 1, f"{role}.ppo_epochs", "must be >= 1", "set it to 1")
    need(
        section.ppo_max_token_len_per_gpu > 0,
        f"{role}.ppo_max_token_len_per_gpu",
        "must be > 0",
        "set it to e.g. 16384",
    )
    if mini <= 0 or micro <= 0 or batch <= 0:
        return
    need(
        mini % world_size == 0,
        f"{role}.ppo_mini_batch_size",
        f"must be divisible by the world size {world_size} (each rank trains on its share of every mini-batch)",
        f"use a multiple of {world_size}",
    )
    need(
        batch % mini == 0,
        f"{role}.ppo_mini_batch_size",
        f"must divide data.train_batch_size={batch} (one optimizer step per mini-batch)",
        f"use a divisor of {batch}",
    )
    if section.use_dynamic_bsz:
        key, budget = f"{role}.ppo_max_token_len_per_gpu", section.ppo_max_token_len_per_gpu
        _holds_a_sequence(need, key, budget, cfg, role)
    elif mini % world_size == 0 and n > 0:
        per_rank = mini * n // world_size
        need(
            per_rank % micro == 0,
            f"{role}.ppo_micro_batch_size_per_gpu",
            f"must divide the per-rank mini-batch ppo_mini_batch_size*n/world_size = {mini}*{n}/{world_size} = "
            f"{per_rank} sequences",
            f"use a divisor of {per_rank}, e.g. {_divisor_at_most(per_rank, micro)}, or use_dynamic_bsz=true",
        )


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def _sharded_rule(key: str, prompts: int, world_size: int, need: Need) -> None:
    """A count of prompts that the ranks split: each takes its share and generates their n responses itself."""
    name = key.rpartition(".")[2]
    need(
        prompts % world_size == 0,
        key,
        f"must be divisible by the world size {world_size} (each rank takes {name}/world_size prompts "
        f"and generates their n responses itself, so {name}*n splits evenly too)",
        f"use a multiple of {world_size}, e.g. {-(-prompts // world_size) * world_size}",
    )


def _gen_batch_rules(cfg: Config, world_size: int, need: Need) -> None:
    """``data.gen_batch_size`` (null = train_batch_size): the prompts of a round of dynamic sampling, so it differs
    from train_batch_size only with algorithm.filter_groups; at least a step's prompts, split as they are."""
    gen, train = cfg.data.gen_batch_size, cfg.data.train_batch_size
    filtering = cfg.algorithm.filter_groups.enable
    if gen is None or gen == train:
        return
    need(
        filtering,
        "data.gen_batch_size",
        f"differs from data.train_batch_size={train} but sizes only the rounds of dynamic sampling "
        "(algorithm.filter_groups); without it each step generates and trains on train_batch_size prompts (verl's "
        "main trainer would read and train on gen_batch_size prompts a step)",
        f"set it to null (or {train}), or algorithm.filter_groups.enable=true",
    )
    need(
        not filtering or gen >= train,
        "data.gen_batch_size",
        f"must be >= data.train_batch_size={train}: a round draws at least a step's prompts (a smaller round "
        "would take several even when every group is informative)",
        f"set it to null (= train_batch_size) or more, e.g. {3 * train} (verl's DAPO script's 3x)",
    )
    if filtering and gen >= train:
        _sharded_rule("data.gen_batch_size", gen, world_size, need)


def deepspeed_rules(cfg: Config, world_size: int, need: Need) -> None:
    """The DeepSpeed JSON of each role the run builds, checked and filled as its engine will do it
    (``deepspeed_json.fill_ds_json``), so a bad one fails before torch loads."""
    roles = ["actor_rollout_ref.actor"] + (["critic"] if critic_used(cfg) else [])
    roles += ["actor_rollout_ref.ref"] if ref_used(cfg) else []
    roles += ["reward_model"] if cfg.reward_model.enable else []
    roles += ["distillation.teacher_models.teacher_model"] if cfg.distillation.enabled else []
    frozen = {  # the forward-only roles: one forward per micro-batch, no accumulation
        "actor_rollout_ref.ref": cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
        "reward_model": cfg.reward_model.micro_batch_size_per_gpu,
        "distillation.teacher_models.teacher_model": cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
    }
    for role in roles:
        section, key = value_at(cfg, role), f"{role}.deepspeed_config"
        trains = role not in frozen
        if trains:
            micro, accumulation = _ds_geometry(section, cfg.actor_rollout_ref.rollout.n, world_size)
        else:
            micro, accumulation = frozen[role], 1
        try:
            fill_ds_json(
                section.deepspeed_config,
                key=key,
                prefix=role,
                world_size=world_size,
                micro_batch_size_per_gpu=micro if micro and micro > 0 else None,
                gradient_accumulation_steps=accumulation,
                dtype=cfg.actor_rollout_ref.model.dtype,
                optim=section.optim if trains else None,
                grad_clip=clip_grad(section) if trains else None,
            )
        except DeepSpeedJsonError as err:
            for rule, fix in err.problems:
                need(False, key, rule, fix)


def _ds_geometry(section: Any, n: int, world_size: int) -> tuple[int | None, int | None]:
    """(DeepSpeed micro-batch size, accumulation steps) of a trained role, as ``engines.training.mini_batch_geometry``
    derives them; (None, None) where the batch rules refuse the mini-batch already."""
    rows, micro = section.ppo_mini_batch_size * n, section.ppo_micro_batch_size_per_gpu
    if rows <= 0 or micro <= 0 or rows % world_size:
        return None, None
    per_rank = rows // world_size
    if section.use_dynamic_bsz:
        return 1, per_rank
    return (micro, per_rank // micro) if per_rank % micro == 0 else (None, None)
