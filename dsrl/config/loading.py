"""Reading a run's configuration: the YAML layers (paths or shipped recipe names) and the dotted overrides
merged onto the typed defaults one key at a time, with every problem collected; interpolation checks;
``resolve`` (values that follow from others); the files a config names; the config as a dict or YAML."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union, cast, get_args, get_origin

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsrl.config.files import not_regular
from dsrl.config.keys import LEAF_KEYS, SCHEMA, value_at
from dsrl.config.layout import DS_CONFIG_DIR, RECIPE_DIR
from dsrl.config.problems import show, violation
from dsrl.config.schema import Config
from dsrl.config.user_code import estimator_needs
from dsrl.config.verl_keys import unknown_key
from dsrl.runtime.redaction import secret_environment

# verl's older names of a setting, each with the key that names it now: set alone, the older name is used (as in
# verl); set in the layers together with the current key to a different value, it is refused.
OLDER_NAMES = {
    f"{role}.{old}": f"{role}.{new}"
    for role in ("actor_rollout_ref.actor", "critic")
    for old, new in (("optim.warmup_style", "optim.lr_scheduler_type"), ("grad_clip", "optim.clip_grad"))
}


class ConfigError(ValueError):
    """Every problem found in a configuration or in the files it names (data, model); ``violations`` holds one
    line per problem."""

    def __init__(self, violations: list[str]):
        self.violations = violations
        super().__init__("\n".join(violations))


_TYPE_NAMES = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "booleans"),
    str: ("a string", "strings"),
    type(None): ("null", "nulls"),
}


def _type_name(tp: Any) -> str:
    """How a user would say the type: 'an integer or null', 'a list of numbers, e.g. [a,b]'."""
    if get_origin(tp) is Union:
        return " or ".join(_type_name(arg) for arg in get_args(tp))
    if get_origin(tp) is list:
        return f"a list of {_TYPE_NAMES[get_args(tp)[0]][1]}, e.g. [a,b]"
    if dataclasses.is_dataclass(tp):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    return _TYPE_NAMES[tp][0]


def _merge(cfg: DictConfig, user: dict, prefix: str, violations: list[str], given: set[str]) -> None:
    """Set each of the user's values on the typed tree, one key at a time, so every bad key is reported; ``given``
    gains the keys set."""
    for name, value in user.items():
        key = f"{prefix}{name}"
        info = SCHEMA.get(key)
        if info is None:
            if isinstance(value, dict) and value:
                _merge(
                    cfg, value, key + ".", violations, given
                )  # report each leaf: fsdp_config.param_offload has its own fix
            else:
                violations.append(unknown_key(key, value))
        elif dataclasses.is_dataclass(info.type) and isinstance(value, dict):
            _merge(cfg, value, key + ".", violations, given)
        elif value == MISSING:
            violations.append(violation(key, value, "??? marks a value still to be given", f"set {key} ({info.help})"))
        else:
            try:
                OmegaConf.update(cfg, key, value, merge=info.type is dict)  # a free-form dict gains keys
                given.add(key)
            except OmegaConfBaseException:
                expected = _type_name(info.type)
                violations.append(violation(key, value, f"expected {expected}", f"set {key} to {expected}"))


ConfigFiles = str | Path | list | tuple | None  # one YAML path, several (merged left to right), or none


def config_file_path(name: str) -> Path:
    """The YAML file ``name`` stands for: a path, or the name of a shipped recipe (``grpo``, ``cpu``:
    configs/<name>.yaml)."""
    path = Path(name).expanduser()
    recipe = RECIPE_DIR / f"{name}.yaml"
    return recipe if not path.exists() and path.suffix == "" and recipe.is_file() else path


def tool_config_file(name: str) -> str:
    """The tool YAML ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` stands for: a path, or the name of a
    shipped one (``calculator``: configs/tools/calculator.yaml, found from any directory)."""
    shipped = RECIPE_DIR / "tools" / f"{name}.yaml"
    return (
        str(shipped) if not Path(name).expanduser().exists() and Path(name).suffix == "" and shipped.is_file() else name
    )


def split_files_and_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """The leading config files and the ``key=value`` overrides after them."""
    files = []
    for item in items:
        if "=" in item:
            break
        files.append(item)
    overrides = items[len(files) :]
    misplaced = [item for item in overrides if "=" not in item]
    if misplaced:
        raise ValueError(f"{misplaced[0]}: config files come before the key=value overrides")
    return files, overrides


def _read_layer(name: str, violations: list[str]) -> DictConfig | None:
    path = config_file_path(name)
    recipes = ", ".join(sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
    if problem := not_regular(path):
        violations.append(f"config file {name}: {problem}; fix: pass a YAML file or a shipped recipe ({recipes})")
        return None
    try:
        layer = OmegaConf.load(path)
    except OSError as err:
        violations.append(
            f"config file {name}: cannot be read ({err.strerror}); fix: pass an existing YAML file or a shipped recipe "
            f"({recipes})"
        )
        return None
    except yaml.MarkedYAMLError as err:  # where the parser gave up, and what it was reading then
        at = lambda mark: f"line {mark.line + 1}, column {mark.column + 1}"  # noqa: E731
        where = f" at {at(err.problem_mark)}" if err.problem_mark else ""
        context = f" ({err.context} at {at(err.context_mark)})" if err.context and err.context_mark else ""
        violations.append(
            f"config file {name}: not valid YAML{where}: {err.problem}{context}; fix: correct the YAML syntax there"
        )
        return None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        violations.append(f"config file {name}: not valid YAML ({show(err)}); fix: correct the YAML syntax")
        return None
    if not isinstance(layer, DictConfig):
        violations.append(
            f"config file {name}: the top level is a list, not a mapping of keys; fix: write key: value lines"
        )
        return None
    return layer


def load_layers(files: ConfigFiles, overrides: list[str]) -> tuple[DictConfig, list[str], set[str]]:
    """The typed tree with the YAML files (left to right) and the overrides applied, the problems met on the way,
    and the keys the files and overrides set.

    A file that cannot be read stops there: ConfigError with the files' problems and the overrides' syntax errors
    only, since without the file the defaults it would have replaced (required keys, the default estimator's
    critic) would be reported as if the user had set them."""
    cfg = OmegaConf.structured(Config)
    violations: list[str] = []
    names = [] if files is None else [files] if isinstance(files, (str, Path)) else list(files)
    layers = [layer for name in names if (layer := _read_layer(str(name), violations)) is not None]
    unreadable = len(layers) < len(names)
    for item in overrides:
        item = item.lstrip("+")  # verl's Hydra "+key=value" (add) and "++key=value" (force): every dsrl key exists
        key, eq, value = item.partition("=")
        if not eq or not key:
            violations.append(
                f"override {item}: not key=value; fix: write it as dotted.key=value, e.g. data.train_batch_size=16"
            )
            continue
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except (yaml.YAMLError, OmegaConfBaseException) as err:
            violations.append(
                f"{key}={value}: not a valid value ({show(err)}); fix: lists as [a,b], quote strings with special "
                "characters"
            )
    if unreadable:
        raise ConfigError(violations)
    given: set[str] = set()
    for layer in layers:
        _merge(cfg, _as_dict(layer), "", violations, given)
    for key in LEAF_KEYS:  # an interpolation like ${trainer.project_name} must resolve to a value of the key's type
        try:
            value_at(cfg, key, throw_on_missing=False)
        except OmegaConfBaseException as err:
            parent, _, name = key.rpartition(".")
            raw = _as_dict(value_at(cfg, parent))[name]
            violations.append(
                violation(key, raw, f"cannot be resolved ({str(err).splitlines()[0]})", "fix the ${...} reference")
            )
            OmegaConf.update(cfg, key, SCHEMA[key].default, merge=False)
    for old, new in OLDER_NAMES.items():  # an older name at its default, null, is not set
        old_value, new_value = value_at(cfg, old), value_at(cfg, new)
        if {old, new} <= given and old_value is not None and old_value != new_value:
            violations.append(
                violation(
                    old,
                    old_value,
                    f"is verl's older name of {new}, which the config sets to {show(new_value)}: two values for one "
                    "setting",
                    f"set only {new} (to {show(old_value)} if that is the value you meant)",
                )
            )
    return cfg, violations, given


def load_config(files: ConfigFiles, overrides: list[str]) -> Config:
    """Defaults <- the YAML ``files`` (paths or recipe names, left to right) <- ``overrides`` (``key=value``).
    Raises ConfigError."""
    cfg, violations, _ = load_layers(files, overrides)
    if violations:
        raise ConfigError(violations)
    return cfg  # type: ignore[return-value]  # a DictConfig typed by Config: attribute access as on the dataclass


def policy_loss_param_key(name: str) -> str | None:
    """The key a policy loss's parameter ``name`` is read from: actor_rollout_ref.actor.policy_loss.<name>, else
    actor_rollout_ref.actor.<name> (where verl keeps them); None when neither exists (a user loss's own parameter,
    set in actor_rollout_ref.actor.policy_loss.params)."""
    actor = "actor_rollout_ref.actor"
    candidates = (f"{actor}.policy_loss.{name}", f"{actor}.{name}")
    return next((key for key in candidates if key in SCHEMA and key != f"{actor}.policy_loss.params"), None)


def policy_loss_param_values(cfg: Config, names: Iterable[str]) -> dict[str, Any]:
    """The config's values of the policy loss parameters ``names`` (``dsrl.algorithms.policy_loss_params(mode)``),
    by name, to pass to ``policy_loss``: each from its key (a section as a plain dict); a name without a key from
    actor_rollout_ref.actor.policy_loss.params when set there, else left to the loss's default."""
    own = cfg.actor_rollout_ref.actor.policy_loss.params
    values = {}
    for name in names:
        key = policy_loss_param_key(name)
        if key is None and name not in own:
            continue
        value = own[name] if key is None else value_at(cfg, key)
        values[name] = (
            OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
        )
    return values


def resolve(cfg: Config) -> list[str]:
    """Fill in the values that follow from others; returns a note for each setting dsrl changed.

    clip_ratio_low/high null -> clip_ratio; rollout.name null -> this machine's engine (``default_rollout_name``). An
    estimator that needs sum_pi_squared from the actor forward (OTB) turns ``actor.calculate_sum_pi_squared`` on
    rather than fail after the first rollout.
    """
    actor = cfg.actor_rollout_ref.actor
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    notes = []
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name is None:
        rollout.name = default_rollout_name()
        why = (
            "a CUDA device and the vllm package are present"
            if rollout.name == "vllm"
            else "no CUDA device with vllm here"
        )
        notes.append(f"actor_rollout_ref.rollout.name set to {rollout.name}: {why}")
    estimator = cfg.algorithm.adv_estimator
    if "sum_pi_squared" in estimator_needs(estimator) and not actor.calculate_sum_pi_squared:
        actor.calculate_sum_pi_squared = True
        notes.append(
            f"actor_rollout_ref.actor.calculate_sum_pi_squared set to true: {estimator} needs sum_pi_squared (its "
            "token weights 1 - 2*pi + sum pi^2)"
        )
    return notes


def secret_notes(cfg: Config) -> list[str]:
    """A note for each key whose value holds the value of a secret environment variable (``dsrl.runtime.redaction``), as
    ``${oc.env:NAME}`` or typed in: what dsrl shows has *** in its place, but a file or folder it names does not."""
    secrets = secret_environment()
    notes = []
    for key in LEAF_KEYS:
        value = value_at(cfg, key)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        names = sorted(name for name, secret in secrets.items() if secret in str(value))
        if names:
            notes.append(
                f"{key} holds the value of the secret environment variable {' and '.join(names)}, which the console "
                "and MLflow show as ***; a file or folder it names holds the value itself on disk"
            )
    return notes


def deepspeed_config_path(name: str) -> Path:
    """The JSON file a ``deepspeed_config`` value names: the path itself if it ends in .json, else
    ds_configs/<name>.json."""
    path = Path(name).expanduser()
    return path if path.suffix == ".json" else DS_CONFIG_DIR / f"{name}.json"


def default_rollout_name(gpus: Path = Path("/proc/driver/nvidia/gpus")) -> str:
    """The engine ``actor_rollout_ref.rollout.name: null`` stands for: vllm where an NVIDIA device is visible
    and the vllm package is installed, hf elsewhere. Decided without importing torch or vllm (the driver's
    device list ``gpus`` and the package's presence), so validation stays fast."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")
    has_cuda = visible and gpus.is_dir() and any(gpus.iterdir())
    return "vllm" if has_cuda and importlib.util.find_spec("vllm") is not None else "hf"


def rollout_name(cfg: Config) -> str:
    """The rollout engine the run uses (``actor_rollout_ref.rollout.name``, or its default on this machine)."""
    return cfg.actor_rollout_ref.rollout.name or default_rollout_name()


def to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts, interpolations resolved (for MLflow params and artifacts)."""
    return _as_dict(cfg, resolve=True)


def _as_dict(section: object, resolve: bool = False) -> dict:
    """A config section (a DictConfig at run time, typed as its dataclass) as plain nested dicts."""
    container = OmegaConf.to_container(cast(DictConfig, section), resolve=resolve)
    assert isinstance(container, dict)  # a DictConfig's container is a dict
    return container


def to_yaml(cfg: Config) -> str:
    """The config as YAML, interpolations resolved."""
    return OmegaConf.to_yaml(cfg, resolve=True)
