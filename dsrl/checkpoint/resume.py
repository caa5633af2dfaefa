"""Resuming a run: which checkpoint, whether it can be resumed from, and the trainer's state in it.

Everything a resume reads is checked before any model loads, and what dsrl wrote itself is not trusted
blindly:

- ``checkpoint_to_resume``: the checkpoint ``trainer.resume_mode`` asks for (``auto``: the newest under
  ``trainer.default_local_dir``; ``resume_path``: ``trainer.resume_from_path``) whose state checks out
  (``dsrl.checkpoint.save.state_problem``: unchanged since written, this format and step, every file there with
  its size; ``fields_problem``: every field of the trainer's state of the expected type), whose files'
  SHA-256 match the manifest and whose torch files load as data (``pickled_code_problems``: each rank checks a
  share). ``auto`` falls back to the previous checkpoint and says why; an explicit path is refused with the
  reason.
- ``check_settings``: the same world size (unless ``trainer.resume_allow_world_size_change``: ``restore``
  then loads through ``dsrl.checkpoint.universal``), and the settings that shape the run unchanged (unless
  ``trainer.resume_allow_config_change``).
- ``check_train_data``: the training files as they were (size and SHA-256 of each, in order), since the
  saved sampler position means other prompts in other data; checked once the prompts have loaded, still
  before any model.
- ``trainer_state`` and ``restore``: the trainer's part of a checkpoint (sampler position, KL coefficient,
  skip counters, LR schedules, MLflow run, config and data identity, the frozen parameters' checksum) and
  putting it back; a LoRA actor's checkpoint holds its adapters alone, so ``restore`` first checks that the
  base loaded from ``actor_rollout_ref.model.path`` is the one they were trained on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dsrl.checkpoint.save import (
    CheckpointError,
    complete_steps,
    config_differences,
    config_hash,
    file_problems,
    frozen_checksum,
    load_checkpoint,
    pickled_code_problems,
    sha256_file,
    state_config,
    state_problem,
    step_dir,
)
from dsrl.checkpoint.universal import load_at_new_world_size
from dsrl.config import Config
from dsrl.config.files import parquet_paths

logger = logging.getLogger("dsrl")

_FIX_PATH = "fix: point it at a global_step_N directory written by dsrl, or set trainer.resume_mode=auto"


# ---- the trainer's part of a checkpoint ---------------------------------------------------------


def data_identity(files) -> list[dict[str, Any]]:
    """Each training file (``data.train_files``, directories expanded) as path, size and SHA-256, in order."""
    paths = [Path(p).expanduser() for p in parquet_paths(files)]
    return [{"path": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]


def trainer_state(
    *,
    sampler,
    kl_coef: float,
    roles: dict,
    mlflow_run_id,
    save_contents: list[str],
    config: dict[str, Any],
    train_data: list[dict[str, Any]],
) -> dict[str, Any]:
    """The trainer's fields of a checkpoint state (``dsrl.checkpoint.save.save_checkpoint`` adds the rest). Collective
    (``frozen_checksum``)."""
    return {
        "sampler": sampler.state_dict(),
        "kl_coef": kl_coef,
        "skips": {name: role.skips.state_dict() for name, role in roles.items()},
        "lr_schedulers": {name: role.lr_scheduler.state_dict() for name, role in roles.items()},
        "frozen_checksums": {name: frozen_checksum(role.engine.module) for name, role in roles.items()},
        "mlflow_run_id": mlflow_run_id,
        "save_contents": save_contents,
        "config": config,
        "config_hash": config_hash(config),
        "train_data": train_data,
    }


def _count(minimum: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# Each field of a state and what its value must be: a check, or the checks of its keys.
_FIELDS = {
    "global_step": _count(0),
    "world_size": _count(1),
    "sampler": {"epoch": _count(0), "index": _count(0)},
    "kl_coef": _finite_number,
    "skips": lambda v: (
        isinstance(v, dict)
        and all(
            isinstance(s, dict) and _count(0)(s.get("total")) and _count(0)(s.get("consecutive")) for s in v.values()
        )
    ),
    "lr_schedulers": lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values()),
    "frozen_checksums": lambda v: (
        isinstance(v, dict) and all(s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in v.values())
    ),
    "mlflow_run_id": lambda v: v is None or isinstance(v, str),
    "save_contents": lambda v: isinstance(v, list) and all(isinstance(item, str) for item in v),
    "config": lambda v: isinstance(v, dict),
    "config_hash": lambda v: isinstance(v, str),
    "train_data": lambda v: (
        isinstance(v, list)
        and all(
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and _count(0)(f.get("bytes"))
            and isinstance(f.get("sha256"), str)
            for f in v
        )
    ),
}


def fields_problem(state: dict[str, Any], roles: Sequence[str]) -> str | None:
    """Why the trainer's fields of ``state`` cannot be restored (a field missing or of the wrong type, the
    config not matching its hash, a trained role without its state), or None."""
    for name, check in _FIELDS.items():
        value = state.get(name)
        checks = check.items() if isinstance(check, dict) else [(None, check)]
        for key, ok in checks:
            part = value.get(key) if key is not None and isinstance(value, dict) else value
            if name not in state or (key is not None and not isinstance(value, dict)) or not ok(part):
                shown = f"{name}.{key}" if key is not None else name
                return f"trainer_state.json: {shown} is missing or not what dsrl writes there ({part!r})"
    if config_hash(state["config"]) != state["config_hash"]:
        return "trainer_state.json: config does not match its config_hash"
    for field in ("skips", "lr_schedulers", "frozen_checksums"):
        missing = [role for role in roles if role not in state[field]]
        if missing:
            return f"trainer_state.json: {field} has no state of {', '.join(missing)}"
    return None


def restore(
    directory: Path,
    state: dict[str, Any],
    *,
    roles: dict,
    sampler,
    kl_ctrl,
    rank: int,
    root: Path,
    seed: int,
    stall_s: float,
) -> None:
    """Load every trained role's engine (weights, optimizer, LR scheduler, step counters) and this rank's RNG,
    then the trainer's state: sampler position, KL coefficient, skip counters and LR schedules. A checkpoint of
    another world size (``check_settings`` let it through) is loaded through its universal form under ``root``
    (``dsrl.checkpoint.universal``; ``seed``: ``trainer.seed``, for ranks it did not have; ``stall_s``: how long
    ranks wait for its conversion to change). Collective."""
    start = time.perf_counter()
    for name, role in roles.items():
        saved, now = state["frozen_checksums"][name], frozen_checksum(role.engine.module)
        if saved != now:
            raise CheckpointError(
                f"{directory}: the {name}'s frozen weights (the base model under its LoRA adapters, loaded from "
                f"actor_rollout_ref.model.path) are not those the checkpoint was trained on (checksum {saved} then, "
                f"{now} now), and its checkpoint holds the adapters alone; fix: point actor_rollout_ref.model.path at "
                "the model the run started from (the same files), or trainer.resume_mode=disable to start over"
            )
    engines = {name: role.engine for name, role in roles.items()}
    if state["world_size"] == dist.get_world_size():
        load_checkpoint(directory, engines, rank)
    else:
        load_at_new_world_size(directory, state, engines, root=root, seed=seed, rank=rank, stall_s=stall_s)
    sampler.load_state_dict(state["sampler"])
    kl_ctrl.value = state["kl_coef"]
    for name, role in roles.items():
        role.skips.load_state_dict(state["skips"][name])
        role.lr_scheduler.load_state_dict(state["lr_schedulers"][name])
        for group, lr in zip(role.lr_scheduler.optimizer.param_groups, role.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # the lr of the next step, whatever the optimizer state held
    seconds = time.perf_counter() - start
    logger.info(f"resumed from {directory} (step {state['global_step']}; loaded in {seconds:.2f} s)")


# ---- which checkpoint, and whether it can be resumed from ------------------------------------------


def checkpoint_to_resume(cfg: Config, root: Path, roles: Sequence[str]) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from and its state, or (None, None) to start fresh (module doc). Collective:
    rank 0 reads the states, every rank hashes a share of each candidate's files and loads its torch files as data."""
    trainer = cfg.trainer
    if trainer.resume_mode == "disable":
        return None, None
    rank, world = dist.get_rank(), dist.get_world_size()
    explicit = trainer.resume_mode == "resume_path"
    candidates = [Path(trainer.resume_from_path)] if explicit else None
    if candidates is None:
        listed = [[step_dir(root, step) for step in sorted(complete_steps(root), reverse=True)] if rank == 0 else None]
        dist.broadcast_object_list(listed, src=0)  # every rank takes the same candidates in the same order
        candidates = listed[0]
    for path in candidates:
        decision: list = [None, None]
        if rank == 0:
            state, problem = state_problem(path)
            problem = problem or fields_problem(state, roles)
            decision = [None if problem else state, problem]
        dist.broadcast_object_list(decision, src=0)
        state, problem = decision
        if problem is None:
            shares: list = [None] * world
            mine = file_problems(path, state["files"], rank, world) or pickled_code_problems(
                path, state["files"], rank, world
            )
            dist.all_gather_object(shares, mine)
            problem = next((line for share in shares for line in share), None)
        if problem is None:
            return path, state
        if explicit:
            raise CheckpointError(
                f"trainer.resume_from_path={path}: not a complete dsrl checkpoint: {problem}; {_FIX_PATH}"
            )
        if rank == 0:
            logger.info(f"resume: skipping {path}: {problem}")
    return None, None


def check_settings(cfg: Config, path: Path, state: dict[str, Any], world_size: int) -> None:
    """CheckpointError unless ``cfg`` at ``world_size`` may resume ``state``: the same world size (ZeRO partitions
    per rank) unless ``trainer.resume_allow_world_size_change``, and the same state-relevant
    settings unless ``trainer.resume_allow_config_change``."""
    saved, now = state["config"], state_config(cfg, world_size)
    if saved["world_size"] != world_size:
        if not cfg.trainer.resume_allow_world_size_change:
            raise CheckpointError(
                f"{path}: written by {saved['world_size']} ranks, this run has {world_size}; ZeRO partitions "
                f"weights and optimizer per rank; fix: start with {saved['world_size']} ranks, set "
                "trainer.resume_allow_world_size_change=true to convert it for this world size, or "
                "trainer.resume_mode=disable to start over"
            )
        now = {**now, "world_size": saved["world_size"]}  # allowed: not a difference of settings
    differences = config_differences(saved, now)
    if differences and not cfg.trainer.resume_allow_config_change:
        raise CheckpointError(
            f"{path}: the run's settings differ from the checkpoint's:\n  "
            + "\n  ".join(differences)
            + "\nfix: restore them, set trainer.resume_allow_config_change=true to resume anyway, "
            "or trainer.resume_mode=disable to start over"
        )


def check_train_data(cfg: Config, path: Path, state: dict[str, Any], train_data: list[dict[str, Any]]) -> None:
    """CheckpointError unless the training files are those the checkpoint was trained on (size and SHA-256 of each,
    in order) or ``trainer.resume_allow_config_change`` allows other data: the saved sampler position would draw
    other prompts."""
    saved = state["train_data"]
    changed = [
        f"{now['path']}: {then['bytes']:,} bytes, SHA-256 {then['sha256'][:12]}... then; {now['bytes']:,} bytes, "
        f"{now['sha256'][:12]}... now"
        for then, now in zip(saved, train_data, strict=False)  # a change in their number is reported below
        if (then["bytes"], then["sha256"]) != (now["bytes"], now["sha256"])
    ]
    if len(saved) != len(train_data):
        changed.append(f"{len(saved)} file(s) then, {len(train_data)} now")
    if changed and not cfg.trainer.resume_allow_config_change:
        raise CheckpointError(
            f"{path}: data.train_files changed since the checkpoint was written, so its sampler position would "
            "draw other prompts:\n  " + "\n  ".join(changed) + "\nfix: restore the files, set "
            "trainer.resume_allow_config_change=true to resume with the new data, or trainer.resume_mode=disable "
            "to start over"
        )
