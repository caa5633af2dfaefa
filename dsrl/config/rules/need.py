"""What the groups of rules share: ``Need``, the callable ``validate`` hands each group to record a violation with,
and the questions several groups ask of a config (is a key missing, does the run train a critic, use a reference)."""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import OmegaConf

from dsrl.config.keys import value_at
from dsrl.config.schema import Config
from dsrl.config.user_code import estimator_needs

Need = Callable[..., None]  # validate's need(ok, key, rule, fix, value=...), handed to each group of rules


def is_missing(cfg: Config, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    return OmegaConf.is_missing(value_at(cfg, parent), name)


def critic_used(cfg: Config) -> bool:
    return "critic" in estimator_needs(cfg.algorithm.adv_estimator)


def whole_forward_rules(cfg: Config, key: str, off: str, need: Need) -> None:
    """``key`` reads every router of a micro-batch's one forward over whole rows (a mixture of experts' aux loss, its
    routing replay): refused beside sequence parallelism and ``shared_prompt_forward``. ``off``: the fix's other way,
    turning ``key`` off."""
    arr = cfg.actor_rollout_ref
    need(
        arr.actor.ulysses_sequence_parallel_size <= 1,
        key,
        "the routers of a sequence-parallel rank see its shard of the rows only",
        f"set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1, or {off}",
    )
    need(
        not arr.model.shared_prompt_forward,
        key,
        "shared_prompt_forward runs a micro-batch in two forwards (the prompts, then the responses on their cache)",
        "set actor_rollout_ref.model.shared_prompt_forward=false (use_remove_padding=true packs instead)",
    )


def ref_used(cfg: Config) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
