"""A role's DeepSpeed JSON checked and completed from the run config, without torch: the one implementation that
validation (``rules``, each built role's ``deepspeed_config`` key, before torch loads) and
``dsrl.engines.deepspeed_setup.build_ds_config`` (the config each engine is built with) share.

Keys whose value is ``"auto"`` (or that are absent) get the value the run config decides: the batch geometry,
``bf16.enabled`` from ``actor_rollout_ref.model.dtype``, the optimizer's lr, betas and weight decay, and
``gradient_clipping``. A concrete value that disagrees is refused, never silently replaced. A training engine
needs an ``optimizer`` section and ZeRO stage 1-3 with its non-finite gradient check on (dsrl relies on it to
skip bad steps); the reference must have no optimizer. fp16 and a ``scheduler`` section are refused: dsrl trains
in bf16 or fp32 and steps the lr itself once per training step.
"""

from __future__ import annotations

import json
from typing import Any

from dsrl.config.files import not_regular
from dsrl.config.layout import DS_CONFIG_DIR
from dsrl.config.loading import deepspeed_config_path
from dsrl.config.names import MODEL_DTYPES
from dsrl.config.problems import violation

_SECTIONS = ("bf16", "fp16", "optimizer", "scheduler", "zero_optimization")  # each a JSON object when present


class DeepSpeedJsonError(ValueError):
    """Every problem of one role's DeepSpeed JSON: ``problems`` holds (rule, fix) pairs; the message is one line
    each, ``key=value: rule; fix: fix``."""

    def __init__(self, key: str, value: str, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(violation(key, value, rule, fix) for rule, fix in problems))


def read_ds_json(name_or_path: str, key: str) -> dict[str, Any]:
    """The JSON object ``ds_configs/<name>.json``, or the file itself when ``name_or_path`` ends in ``.json``;
    ``key`` is the config key that named it. Raises DeepSpeedJsonError."""
    path = deepspeed_config_path(name_or_path)
    if problem := not_regular(path):
        raise DeepSpeedJsonError(
            key, name_or_path, [(f"{path} is {problem}", "pass the path of a DeepSpeed JSON file")]
        )
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json")))
        fix = f"use a name in ds_configs/ ({known}) or a path to a DeepSpeed JSON file"
        raise DeepSpeedJsonError(key, name_or_path, [(f"no DeepSpeed config at {path}", fix)])
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        rule = f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
        raise DeepSpeedJsonError(key, name_or_path, [(rule, "correct the JSON syntax there")]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise DeepSpeedJsonError(
            key, name_or_path, [(f"{path} cannot be read ({err})", "pass a readable UTF-8 JSON file")]
        ) from None
    if not isinstance(ds, dict):
        rule = f"{path} holds a JSON {type(ds).__name__}, not an object of DeepSpeed settings"
        raise DeepSpeedJsonError(key, name_or_path, [(rule, "copy ds_configs/zero3.json, edit it and pass its path")])
    return ds


def zero_stage(ds_config: dict[str, Any]) -> Any:
    """``zero_optimization.stage`` (0 when absent); an int 0-3 once ``fill_ds_json`` accepted the config."""
    return ds_config.get("zero_optimization", {}).get("stage", 0)


def clip_grad(role_cfg: Any) -> float:
    """The role's gradient-norm clip: ``grad_clip`` (verl's older name) when set, else ``optim.clip_grad``."""
    return role_cfg.optim.clip_grad if role_cfg.grad_clip is None else role_cfg.grad_clip


def fill_ds_json(
    name_or_path: str,
    *,
    key: str,
    prefix: str,
    world_size: int,
    micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    dtype: str,
    optim: Any = None,
    grad_clip: float | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of the role at ``prefix`` (named by ``key``): the JSON with the run's values filled in.

    ``train_batch_size = micro_batch_size_per_gpu * gradient_accumulation_steps * world_size`` (DeepSpeed checks
    that identity); a None geometry (one the batch rules refused) is left unchecked. ``optim`` (lr, betas,
    weight_decay) and ``grad_clip`` are given for training engines only. Raises DeepSpeedJsonError listing every
    problem.
    """
    ds = read_ds_json(name_or_path, key)
    problems: list[tuple[str, str]] = []

    def fill(section: dict, path: str, value: Any, decided_by: str) -> None:
        """Set ``section[name]`` (``path`` in the JSON) to ``value`` unless it holds a different concrete value."""
        name = path.rpartition(".")[2]
        current = section.get(name, "auto")
        if current == "auto":
            section[name] = value
        elif current != value:
            rule = (
                f"{path}={json.dumps(current)} disagrees with the run config ({decided_by} gives {json.dumps(value)})"
            )
            problems.append((rule, f'set {path} to "auto" in the JSON, or change {decided_by}'))

    malformed = [name for name in _SECTIONS if not isinstance(ds.get(name, {}), dict)]
    if malformed or not isinstance(ds.get("optimizer", {}).get("params", {}), dict):
        names = ", ".join(malformed) or "optimizer.params"
        raise DeepSpeedJsonError(key, name_or_path, [(f"{names} must be a JSON object", "see ds_configs/zero3.json")])
    if ds.get("fp16", {}).get("enabled", False) is not False:
        problems.append(("fp16 is not supported", "remove the fp16 section and set actor_rollout_ref.model.dtype"))
    stage = zero_stage(ds)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        problems.append((f"zero_optimization.stage={json.dumps(stage)}: must be 0, 1, 2 or 3", "use zero2 or zero3"))
    offload = ds.get("zero_optimization", {}).get("offload_param") or {}
    if isinstance(offload, dict) and offload.get("device", "none") not in ("none", None) and stage != 3:
        problems.append(
            (
                f"zero_optimization.offload_param moves parameters under ZeRO stage 3 only; stage {json.dumps(stage)} "
                "ignores it",
                "set zero_optimization.stage to 3 (as in ds_configs/zero3_offload.json) or remove offload_param",
            )
        )
    if micro_batch_size_per_gpu is not None and gradient_accumulation_steps is not None:
        decided = f"the {prefix} batch geometry at world size {world_size}"
        fill(ds, "train_micro_batch_size_per_gpu", micro_batch_size_per_gpu, decided)
        fill(ds, "gradient_accumulation_steps", gradient_accumulation_steps, decided)
        fill(ds, "train_batch_size", micro_batch_size_per_gpu * gradient_accumulation_steps * world_size, decided)
    bf16 = ds.setdefault("bf16", {})
    if dtype in MODEL_DTYPES:
        fill(bf16, "bf16.enabled", dtype == "bfloat16", "actor_rollout_ref.model.dtype")

    if optim is None:
        if "optimizer" in ds:
            problems.append(
                (
                    "this engine never trains, so its DeepSpeed config must have no optimizer section",
                    "use zero3_offload_inference or remove the section",
                )
            )
    else:
        if "optimizer" not in ds:
            problems.append(
                ('a training engine needs an "optimizer" section', "copy it from ds_configs/zero3_offload.json")
            )
        else:
            params = ds["optimizer"].setdefault("params", {})
            fill(params, "optimizer.params.lr", float(optim.lr), f"{prefix}.optim.lr")
            fill(params, "optimizer.params.betas", [float(b) for b in optim.betas], f"{prefix}.optim.betas")
            fill(params, "optimizer.params.weight_decay", float(optim.weight_decay), f"{prefix}.optim.weight_decay")
        if "scheduler" in ds:
            problems.append(
                (
                    f"a DeepSpeed scheduler is refused: dsrl steps the lr once per training step from {prefix}.optim",
                    f"remove the scheduler section and set {prefix}.optim.lr_scheduler_type / lr_warmup_steps",
                )
            )
        assert grad_clip is not None, "a training engine's config is filled with its optim and grad_clip together"
        fill(ds, "gradient_clipping", float(grad_clip), f"{prefix}.optim.clip_grad")
        # ZeRO discards optimizer steps whose gradient norm is not finite; dsrl relies on it (engines/training.py).
        if stage == 0:
            problems.append(
                (
                    "zero_optimization.stage=0: a training engine needs ZeRO stage 1, 2 or 3 (dsrl relies on its check "
                    "that skips steps with a non-finite gradient norm)",
                    "use zero2 or zero3",
                )
            )
        if ds.get("zero_optimization", {}).get("compute_grad_norm") is False:
            problems.append(
                (
                    "zero_optimization.compute_grad_norm=false turns off the gradient norm and its non-finite check",
                    "remove the key",
                )
            )
        if bf16.get("check_grad_overflow") is False:
            problems.append(
                (
                    "bf16.check_grad_overflow=false would apply optimizer steps with a non-finite gradient norm",
                    "remove the key or set it to true",
                )
            )
    if problems:
        raise DeepSpeedJsonError(key, name_or_path, problems)
    return ds
