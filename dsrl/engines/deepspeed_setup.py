"""DeepSpeed plumbing shared by the actor, critic and reference engines.

- ``init_distributed``: the process group every engine and the weight sync run on; without the
  ``deepspeed`` launcher it fills in a world-size-1 launcher environment first.
- ``build_ds_config``: a JSON from ``ds_configs/`` (or a path) with dsrl's run values filled in.
  Keys whose value is ``"auto"`` (or that are absent) get the value derived from the run config;
  a concrete value that disagrees with the run config is refused, never silently replaced.
- ``load_pretrained``: loads a transformers model so that under ZeRO-3 each rank only ever holds
  its partition (``HfDeepSpeedConfig`` makes ``from_pretrained`` build under ``deepspeed.zero.Init``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

# Importing model classes inside `deepspeed.zero.Init` fails with a signature-mismatch TypeError,
# so the auto classes (and with them the model registry) are imported here, before any Init.
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: F401
from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup
from transformers.integrations import HfDeepSpeedConfig

from dsrl.config import DS_CONFIG_DIR, deepspeed_config_path

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def init_distributed() -> None:
    """Join (or create) the default process group; idempotent.

    Under the ``deepspeed`` launcher the environment names rank and world. Without it
    (``python scripts/train.py ...``) this fills in a world of one on localhost, since
    ``deepspeed.init_distributed`` would otherwise look for MPI and fail.
    """
    if dist.is_initialized():
        return
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    # One device per rank (a no-op on CPU): the rollout copy and the engines then share it.
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))


def load_ds_config(name_or_path: str, key: str) -> dict[str, Any]:
    """The JSON ``ds_configs/<name>.json``, or the file itself when ``name_or_path`` ends in ``.json``."""
    path = deepspeed_config_path(name_or_path)
    if not path.is_file():
        shipped = sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))
        raise ValueError(
            f"{key}={name_or_path!r}: no DeepSpeed config at {path}; use one of {shipped} or a path to a .json file"
        )
    with path.open() as f:
        return json.load(f)


def _fill(section: dict, name: str, value: Any, *, where: str, decided_by: str) -> None:
    """Set ``section[name]`` to ``value`` unless the JSON already holds a different concrete value."""
    current = section.get(name, "auto")
    if current == "auto":
        section[name] = value
    elif current != value:
        raise ValueError(
            f"{where}.{name}={current!r} disagrees with the run config ({decided_by} gives {value!r}); "
            f'set it to "auto" in the JSON or change {decided_by}'
        )


def build_ds_config(
    name_or_path: str,
    *,
    key: str,
    micro_batch_size_per_gpu: int,
    gradient_accumulation_steps: int,
    dtype: str,
    optim: Any | None = None,
    grad_clip: float | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """A complete DeepSpeed config dict for one engine.

    ``train_batch_size = micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``
    (DeepSpeed checks that identity). ``optim`` (lr, betas, weight_decay) and ``grad_clip`` are given
    for training engines; an engine without them (the reference) must have no ``optimizer`` section.
    ``prefix`` is the dotted config path of the role (e.g. ``actor_rollout_ref.actor``) for messages.
    """
    ds = copy.deepcopy(load_ds_config(name_or_path, key))
    where = f"{key}={name_or_path!r}"
    world = dist.get_world_size()
    if dtype not in DTYPES:
        raise ValueError(f"actor_rollout_ref.model.dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    if ds.get("fp16", {}).get("enabled") is True:
        raise ValueError(f"{where}: fp16 is not supported; remove the fp16 section and set actor_rollout_ref.model.dtype")
    decided = f"{prefix} micro-batch geometry"
    _fill(ds, "train_micro_batch_size_per_gpu", micro_batch_size_per_gpu, where=where, decided_by=decided)
    _fill(ds, "gradient_accumulation_steps", gradient_accumulation_steps, where=where, decided_by=decided)
    _fill(
        ds, "train_batch_size", micro_batch_size_per_gpu * gradient_accumulation_steps * world, where=where, decided_by=decided
    )
    ds.setdefault("bf16", {})
    _fill(ds["bf16"], "enabled", dtype == "bfloat16", where=f"{where} bf16", decided_by="actor_rollout_ref.model.dtype")

    if optim is None:
        if "optimizer" in ds:
            raise ValueError(
                f"{where}: this engine never trains, so its DeepSpeed config must have no optimizer section; "
                "use zero3_offload_inference or remove the section"
            )
        return ds
    if "optimizer" not in ds:
        raise ValueError(f'{where}: a training engine needs an "optimizer" section (see ds_configs/zero3_offload.json)')
    if "scheduler" in ds:
        raise ValueError(f"{where}: remove the scheduler section; dsrl schedules lr per training step from {prefix}.optim")
    params = ds["optimizer"].setdefault("params", {})
    optim_where = f"{where} optimizer.params"
    _fill(params, "lr", float(optim.lr), where=optim_where, decided_by=f"{prefix}.optim.lr")
    _fill(params, "betas", [float(b) for b in optim.betas], where=optim_where, decided_by=f"{prefix}.optim.betas")
    _fill(params, "weight_decay", float(optim.weight_decay), where=optim_where, decided_by=f"{prefix}.optim.weight_decay")
    _fill(ds, "gradient_clipping", float(grad_clip), where=where, decided_by=f"{prefix}.optim.clip_grad")
    # ZeRO discards optimizer steps whose gradient norm is not finite; dsrl relies on it (training.py).
    if zero_stage(ds) not in (1, 2, 3):
        raise ValueError(
            f"{where}: zero_optimization.stage={zero_stage(ds)}: a training engine needs ZeRO stage 1, 2 or 3 "
            "(dsrl relies on its check that skips steps with a non-finite gradient norm); use zero2 or zero3"
        )
    if ds["zero_optimization"].get("compute_grad_norm") is False:
        raise ValueError(
            f"{where}: zero_optimization.compute_grad_norm=false turns off the gradient norm and its non-finite "
            "check; remove the key"
        )
    if ds["bf16"].get("check_grad_overflow") is False:
        raise ValueError(
            f"{where}: bf16.check_grad_overflow=false would apply optimizer steps with a non-finite gradient norm; "
            "remove the key or set it to true"
        )
    return ds


def zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def load_pretrained(ds_config: dict[str, Any], load: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Run ``load()`` (a ``from_pretrained`` call) so that ZeRO-3 partitions the weights while loading.

    While an ``HfDeepSpeedConfig`` is alive, transformers builds models under ``deepspeed.zero.Init``
    and rank 0 streams the checkpoint into the partitions. It is dropped right after: alive, it would
    also partition the plain rollout copy and make ``generate`` default to ``synced_gpus=True``.
    """
    if zero_stage(ds_config) != 3:
        return load()
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_ds_config = HfDeepSpeedConfig(ds_config)
    try:
        return load()
    finally:
        del hf_ds_config
        unset_hf_deepspeed_config()


def clip_grad(role_cfg: Any) -> float:
    """The role's gradient-norm clip: ``grad_clip`` (verl's older name) when set, else ``optim.clip_grad``."""
    return role_cfg.optim.clip_grad if role_cfg.grad_clip is None else role_cfg.grad_clip


def lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: Any, *, total_training_steps: int | None, prefix: str
) -> torch.optim.lr_scheduler.LambdaLR:
    """verl's schedule over training steps (the trainer steps it once per ``update``, as verl does).

    Linear warm-up from 0 over ``lr_warmup_steps`` (or ``lr_warmup_steps_ratio`` of the run), then
    constant or a cosine down to ``min_lr_ratio * lr``: transformers' schedules, whose formulas are
    verl's. ``total_training_steps`` is needed by the ratio and the cosine only.
    """
    kind = optim.warmup_style or optim.lr_scheduler_type
    warmup = optim.lr_warmup_steps
    needs_total = kind == "cosine" or (warmup <= 0 and optim.lr_warmup_steps_ratio > 0)
    if needs_total and total_training_steps is None:
        raise ValueError(f"{prefix}.optim: a cosine schedule or lr_warmup_steps_ratio needs the run's total training steps")
    if warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * total_training_steps) if needs_total else 0
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup, total_training_steps, num_cycles=optim.num_cycles, min_lr_rate=optim.min_lr_ratio
    )
