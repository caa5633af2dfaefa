"""The run configuration: one typed tree with verl's key names, DeepSpeed in place of FSDP.

A run is one or more YAML files merged onto the defaults of the tree, left to right (a recipe, then e.g. the CPU
overlay configs/cpu.yaml), then dotted overrides from the command line
(``data.train_batch_size=16``, lists as ``[a,b]``, ``null``; verl's Hydra prefixes ``+key=`` and
``++key=`` are accepted), with OmegaConf's dotlist semantics.
``load_and_validate`` reports every problem at once -- unknown keys (with "did you mean"), verl's
FSDP-only keys (with the DeepSpeed key to use instead), wrong types, and the rules in ``validate`` --
each as one line: dotted key, value, rule, fix. The config it returns is resolved and read-only.

This package must not import torch: it runs before anything heavy so a bad config fails in a second.

- ``schema``: the typed tree (one dataclass per section; every key's default and documentation); ``keys``:
  ``SCHEMA`` (every dotted key, read off the tree) and ``value_at``; ``problems``: the one line a problem is
  reported as (``violation``); ``layout``: the folders dsrl ships and the names inside a run folder;
  ``resume_keys``: the keys a resumed run may change.
- ``names``: the names each key may take, which the rules check against; some restate ``dsrl.algorithms``' registries.
- ``verl_keys``: keys the tree does not know: verl's FSDP/Megatron-only keys with the dsrl key to use
  instead, "did you mean" for the rest.
- ``loading``: the YAML layers and overrides merged onto the defaults, interpolation checks, ``resolve``
  (values that follow from others), the files a config names, ``to_dict``/``to_yaml``.
- ``rules``: the rules a config must meet, one module per concern (geometry, algorithm, rollout, paths, run).
- ``validate``: ``validate``, which runs every group of rules, and ``load_and_validate``.
- ``files``: the checks of the files a config names that read only headers (parquet data, model paths and
  directories), and ``parquet_paths`` (a directory of data stands for its ``*.parquet`` files).
- ``deepspeed_json``: a role's DeepSpeed JSON checked and its "auto" keys filled from the run config, for
  validation and for the engines alike.
- ``user_code``: ``algorithm.import_modules``, the user's modules that register estimators and losses.
- ``reference``: ``describe_keys``, every key with its type, default and help (``dsrl-train --show-keys``).
"""

from __future__ import annotations

from dsrl.config.deepspeed_json import DeepSpeedJsonError, fill_ds_json
from dsrl.config.files import parquet_paths
from dsrl.config.keys import SCHEMA, KeyInfo
from dsrl.config.layout import DS_CONFIG_DIR, RECIPE_DIR
from dsrl.config.loading import (
    ConfigError,
    ConfigFiles,
    config_file_path,
    deepspeed_config_path,
    default_rollout_name,
    load_config,
    policy_loss_param_values,
    resolve,
    rollout_name,
    to_dict,
    to_yaml,
)
from dsrl.config.names import (
    ADV_ESTIMATORS,
    BYPASS_LOSS_TYPES,
    ESTIMATOR_NEEDS,
    GROUP_ESTIMATORS,
    KL_CTRL_TYPES,
    KL_KINDS,
    LENGTH_WEIGHTED_ESTIMATORS,
    LOSS_AGG_MODES,
    MODEL_DTYPES,
    PF_PPO_METHODS,
    POLICY_LOSS_MODES,
    POLICY_LOSS_PARAMS,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_NAMES,
    ROLLOUT_RS_OPTIONS,
    SUM_PI_SQUARED_ESTIMATORS,
    TRUNCATION_MODES,
)
from dsrl.config.reference import describe_keys
from dsrl.config.resume_keys import RESUME_HARMLESS_KEYS
from dsrl.config.rules import load_and_validate, validate
from dsrl.config.schema import (
    LOGGED_SAMPLES,
    Config,
    lora_enabled,
    prompts_per_round,
    pushes_lora_adapters,
    reward_model_length,
    reward_model_scores_alone,
)
from dsrl.config.user_code import import_user_modules

__all__ = [
    # names
    "ADV_ESTIMATORS",
    "ESTIMATOR_NEEDS",
    "BYPASS_LOSS_TYPES",
    "GROUP_ESTIMATORS",
    "KL_CTRL_TYPES",
    "KL_KINDS",
    "LENGTH_WEIGHTED_ESTIMATORS",
    "LOSS_AGG_MODES",
    "MODEL_DTYPES",
    "PF_PPO_METHODS",
    "POLICY_LOSS_MODES",
    "POLICY_LOSS_PARAMS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "ROLLOUT_NAMES",
    "SUM_PI_SQUARED_ESTIMATORS",
    "TRUNCATION_MODES",
    # schema
    "DS_CONFIG_DIR",
    "LOGGED_SAMPLES",
    "RECIPE_DIR",
    "RESUME_HARMLESS_KEYS",
    "SCHEMA",
    "Config",
    "KeyInfo",
    # loading
    "ConfigError",
    "ConfigFiles",
    "config_file_path",
    "default_rollout_name",
    "deepspeed_config_path",
    "load_config",
    "lora_enabled",
    "policy_loss_param_values",
    "prompts_per_round",
    "pushes_lora_adapters",
    "resolve",
    "reward_model_length",
    "reward_model_scores_alone",
    "rollout_name",
    "to_dict",
    "to_yaml",
    # files
    "parquet_paths",
    # validate
    "load_and_validate",
    "validate",
    # deepspeed_json, user_code, reference
    "DeepSpeedJsonError",
    "fill_ds_json",
    "import_user_modules",
    "describe_keys",
]
