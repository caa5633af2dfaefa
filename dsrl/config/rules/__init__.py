"""The rules a loaded config must meet, one module per concern, and the driver that runs them: ``validate``
(every group over a loaded config) and ``load_and_validate`` (load, validate, resolve, freeze). Each group is a
function ``<group>_rules(cfg, ..., need)`` recording each violation with ``need(ok, key, rule, fix)`` (``need.Need``).

- ``geometry``: the batch sizes against the world size, and each role's DeepSpeed JSON.
- ``algorithm``: the estimator and its options, the losses and their parameters, KL, the optimizers, group filtering.
- ``rollout``: the engine and vLLM's keys, rollout correction, the mismatch stop, multi-turn, LoRA.
- ``paths``: the data, reward and model files, and the run folder.
- ``run``: the reward workers, the reward manager, and the trainer.
- ``models``: the reward model and the distillation teacher.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any, cast

from omegaconf import MISSING, ListConfig, OmegaConf

from dsrl.config.keys import LEAF_KEYS, SCHEMA, value_at
from dsrl.config.loading import ConfigError, ConfigFiles, load_layers, resolve, secret_notes
from dsrl.config.problems import show, violation
from dsrl.config.rules import algorithm, geometry, models, paths, rollout, run
from dsrl.config.rules.need import is_missing
from dsrl.config.schema import Config
from dsrl.config.user_code import import_user_modules

_VALUE_AT_KEY = object()


def validate(cfg: Config, world_size: int, given: Collection[str] = frozenset()) -> list[str]:
    """Every violation of the rules in ``dsrl.config.rules``, one line each (dotted key, value, rule, fix); [] if none.

    ``given``: the keys the config's files and overrides set (``load_and_validate`` passes them); a policy loss
    parameter given for a loss that does not read it is refused (at its default it is not known to be set).

    Checks that numbers are finite, the batch geometry against ``world_size``, estimator requirements,
    loss and KL settings, names against the known ones, that the files the run needs exist, are regular files
    and look complete (``dsrl.config.files``: headers only), that no data file is listed twice, and that the run
    folder can be written. Runs on the config as loaded, before ``resolve``
    fills in derived values; reads nothing heavy.
    """
    violations: list[str] = []
    nonfinite = [key for key in LEAF_KEYS if not is_missing(cfg, key) and _nonfinite(value_at(cfg, key))]

    def need(ok: Any, key: str, rule: str, fix: str, value: Any = _VALUE_AT_KEY) -> None:
        """Record a violation at ``key`` unless ``ok``; it shows the value at ``key`` unless given one. A key
        holding inf or nan has its one violation already (nan fails every comparison)."""
        if not ok and key not in nonfinite:
            if value is _VALUE_AT_KEY:
                value = MISSING if is_missing(cfg, key) else value_at(cfg, key)
            violations.append(violation(key, value, rule, fix))

    for key in LEAF_KEYS:
        need(not is_missing(cfg, key), key, "required", f"set {key} ({SCHEMA[key].help})")
    for key in nonfinite:
        rule = "must be finite (inf and nan are not numbers a run can use)"
        fix = f"set it to a finite number (the default is {show(SCHEMA[key].default)})"
        violations.append(violation(key, value_at(cfg, key), rule, fix))
    geometry.batch_rules(cfg, world_size, need)
    violations += import_user_modules(cfg.algorithm.import_modules)  # before the name checks: they register names
    algorithm.estimator_rules(cfg, need)
    algorithm.estimator_option_rules(cfg, need)
    algorithm.loss_rules(cfg, need)
    algorithm.loss_param_rules(cfg, given, need)
    rollout.rollout_rules(cfg, world_size, need)
    rollout.vllm_rules(cfg, need)
    rollout.offload_on_cpu_rules(cfg, need)
    rollout.router_replay_rules(cfg, need)
    rollout.rollout_correction_rules(cfg, need)
    rollout.rollout_mismatch_rules(cfg, need)
    algorithm.filter_groups_rules(cfg, need)
    rollout.multi_turn_rules(cfg, need)
    rollout.lora_rules(cfg, given, need)
    paths.file_rules(cfg, need)
    geometry.deepspeed_rules(cfg, world_size, need)
    run.reward_rules(cfg, need)
    run.reward_manager_rules(cfg, need)
    run.trainer_rules(cfg, need)
    run.partial_rollout_rules(cfg, need)
    models.reward_model_rules(cfg, need)
    models.distillation_rules(cfg, need)
    return violations


def _nonfinite(value: Any) -> bool:
    """Whether ``value`` is, or is a list holding, an inf or a nan."""
    values = list(value) if isinstance(value, ListConfig) else [value]
    return any(isinstance(v, float) and not math.isfinite(v) for v in values)


def load_and_validate(
    files: ConfigFiles, overrides: list[str], world_size: int, *, reads: Callable[[str], bool] | None = None
) -> tuple[Config, list[str]]:
    """Load (as ``load_config``), resolve and validate; returns the read-only config and the notes: what dsrl set
    itself, and the keys that hold the value of a secret.

    Raises ConfigError listing every problem: unknown or mistyped keys and every rule violated. ``reads``: for a
    command that reads only some keys of a run config (``dsrl-eval``), whether it reads a dotted key; problems at
    the known keys it does not read are left out (a training config's missing train_files, say).
    """
    loaded, violations, given = load_layers(files, overrides)
    cfg = cast(Config, loaded)  # the structured DictConfig, read through its dataclass's attributes
    violations += validate(cfg, world_size, given)
    if reads is not None:  # a problem's line starts with its key: key=value: rule; fix: ...
        violations = [line for line in violations if (key := line.partition("=")[0]) not in SCHEMA or reads(key)]
    if violations:
        raise ConfigError(violations)
    notes = resolve(cfg) + rollout.adapter_notes(cfg) + secret_notes(cfg)
    OmegaConf.set_readonly(loaded, True)
    return cfg, notes
