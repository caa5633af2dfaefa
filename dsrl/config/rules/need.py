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


def ref_used(cfg: Config) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
