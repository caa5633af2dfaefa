"""Resuming a checkpoint written by another number of ranks (``trainer.resume_allow_world_size_change``).

ZeRO saves each rank's partition of the weights and optimizer state, so a checkpoint of W ranks is read as is
by W ranks only. At another world size, rank 0 converts each trained engine's DeepSpeed checkpoint with
DeepSpeed's ``ds_to_universal`` (ZeRO stage 1, 2 and 3): one folder per parameter with its fp32 master weight
and Adam moments, unpartitioned. Every engine then loads it with DeepSpeed's universal loading
(``checkpoint.load_universal``, read by ``engine.load_checkpoint`` at each call, so it is turned on for that
call alone), which cuts each tensor for this world size: parameters, moments and the optimizer's step are
the saved ones exactly. A LoRA actor's checkpoint holds the adapters alone: they are converted and loaded the
same way, and the frozen base is the one loaded from ``model.path`` (checked by ``dsrl.checkpoint.resume.restore``).

The conversion goes to ``trainer.default_local_dir/.universal_global_step_N/<role>/ds``, beside the
checkpoints: the published ``global_step_N`` and its manifest stay as written, and every rank reads the
conversion from the shared filesystem the checkpoints are on. It ends with ``conversion.json``, naming the
checkpoint it converts (the SHA-256 of its ``trainer_state.json``, which holds the manifest) and its roles. A
finished conversion of the same checkpoint there is used as it is: ``dsrl-convert global_step_N
.universal_global_step_N --universal`` (same folder) converts before the launch, off the run's clock. Otherwise
rank 0 removes what an earlier attempt left and converts in-process (``ds_to_universal``'s worker pools are not
forked from a rank that holds a process group). The other ranks wait outside any collective, watching the
conversion's folder: they wait as long as its bytes keep changing, and give up after
``actor_rollout_ref.nccl_timeout`` seconds without a change (a stalled filesystem, a rank 0 gone), so a
conversion of hundreds of GB no longer has to fit in one collective's timeout (review gpu_path_3 G4). The
conversion is removed once every rank has loaded it.

Per rank state: rank r takes the RNG state of the checkpoint's rank r where there was one; a rank the
checkpoint did not have is seeded from ``trainer.seed``, the step and r (``new_rank_seed``). The sampler
position, LR schedules, KL coefficient and skip counters are global and restored as at the same world size
(``dsrl.checkpoint.resume.restore``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

from dsrl.checkpoint.save import (
    DS_TAG,
    STATE_FILE,
    CheckpointError,
    set_rng_state,
    step_dir,
    weights_only_loads,
)
from dsrl.runtime.seeding import seed_all

logger = logging.getLogger("dsrl")


def universal_dir(root: Path, step: int) -> Path:
    """Where the conversion of a checkpoint of step ``step`` goes: beside the checkpoints under ``root``."""
    return root / f".universal_{step_dir(root, step).name}"


def new_rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank that the checkpoint of ``step`` did not have: from ``trainer.seed``, the step and the
    rank, so two such ranks, or one at two steps, do not draw alike."""
    return seed + 104_729 * step + rank


DONE_FILE = "conversion.json"  # written last: a conversion without it is unfinished
FAILED_FILE = "failed.json"  # rank 0's error, for the ranks that wait
POLL_S = 5.0  # how often a waiting rank looks at the conversion's folder


def checkpoint_identity(checkpoint: Path) -> str:
    """The SHA-256 of the checkpoint's state file, which holds the manifest of every other file's SHA-256."""
    return hashlib.sha256((checkpoint / STATE_FILE).read_bytes()).hexdigest()


def convert(checkpoint: Path, roles: list[str], out: Path) -> dict:
    """Each role's ``checkpoint/<role>/ds`` in universal form under ``out/<role>/ds``, its files loaded as data
    (``weights_only_loads``: CheckpointError for one that holds more), then ``out/conversion.json``; what that
    file holds."""
    start = time.perf_counter()
    for role in roles:
        with weights_only_loads(checkpoint / role):
            ds_to_universal(
                SimpleNamespace(
                    input_folder=str(checkpoint / role / DS_TAG),
                    output_folder=str(out / role / DS_TAG),
                    num_extract_workers=1,
                    num_merge_workers=1,  # in-process: no pool forked from a rank
                    # ZeRO-1/2's conversion asks for the tensor-parallel layout Megatron-style clients record; a model
                    # without tensor parallelism has none, and the injected default says so.
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=True,
                )
            )
    done = {
        "checkpoint": str(checkpoint),
        "state_sha256": checkpoint_identity(checkpoint),
        "roles": roles,
        "seconds": round(time.perf_counter() - start, 3),
        "bytes": _bytes_under(out),
    }
    (out / DONE_FILE).write_text(json.dumps(done, indent=1))
    return done


def finished_conversion(checkpoint: Path, roles: list[str], out: Path) -> dict | None:
    """``out``'s ``conversion.json`` when it is a finished conversion of ``checkpoint`` holding ``roles``."""
    try:
        done = json.loads((out / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    same = done.get("state_sha256") == checkpoint_identity(checkpoint) and set(roles) <= set(done.get("roles", ()))
    return done if same else None


def load_at_new_world_size(
    checkpoint: Path,
    state: dict[str, Any],
    engines: dict[str, Any],
    *,
    root: Path,
    seed: int,
    rank: int,
    stall_s: float,
) -> None:
    """Restore every engine (weights, optimizer, step counters) from ``checkpoint``, written by
    ``state["world_size"]`` ranks, at this world size through its universal conversion, and this rank's RNG
    (module doc). ``stall_s``: how long a waiting rank allows the conversion's folder not to change. Collective."""
    out, roles = universal_dir(root, state["global_step"]), list(engines)
    decision = [None, None]  # [a finished conversion to use, or None; this attempt's id]
    if rank == 0:
        decision = [finished_conversion(checkpoint, roles, out), f"{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(decision, src=0)
    reused, attempt = decision
    if reused is not None:
        logger.info(f"{checkpoint} ({state['world_size']} ranks): using its universal conversion in {out}")
    elif rank == 0:
        _convert_for_all(checkpoint, state, roles, out, attempt)
    else:
        _wait_for_conversion(checkpoint, roles, out, attempt, stall_s)
    for role, engine in engines.items():
        # DeepSpeed reads the ds config's checkpoint.load_universal at each load_checkpoint call (not when the
        # engine is built), so it is turned on here, for this load alone.
        engine._config.load_universal_checkpoint = True
        try:
            with weights_only_loads(out / role):
                path, _ = engine.load_checkpoint(str(out / role), tag=DS_TAG)
        finally:
            engine._config.load_universal_checkpoint = False  # a later load reads a checkpoint of this world size
        if path is None:
            raise CheckpointError(f"{out / role}: DeepSpeed found no universal {role} checkpoint to load")
    saved_rng = checkpoint / "rng" / f"rank_{rank}.pt"
    if rank < state["world_size"]:
        set_rng_state(torch.load(saved_rng, weights_only=True))
    else:
        seed_all(new_rank_seed(seed, state["global_step"], rank))
    dist.barrier()  # every rank has read the conversion
    if rank == 0:
        shutil.rmtree(out)


def _convert_for_all(checkpoint: Path, state: dict, roles: list[str], out: Path, attempt: str) -> None:
    """Rank 0's conversion; its failure is written for the waiting ranks, then raised."""
    shutil.rmtree(out, ignore_errors=True)  # left by a crash during an earlier conversion or load
    try:
        done = convert(checkpoint, roles, out)
    except Exception as err:  # noqa: BLE001 -- reported on every rank, not one rank's traceback and a hang
        problem = _conversion_failed(checkpoint, state, f"{type(err).__name__}: {' '.join(str(err).split())}")
        out.mkdir(parents=True, exist_ok=True)
        (out / FAILED_FILE).write_text(json.dumps({"attempt": attempt, "problem": str(problem)}))
        raise problem from err
    logger.info(
        f"{checkpoint} ({state['world_size']} ranks) to universal form in {out}: converted in {done['seconds']:.2f} s "
        f"({done['bytes'] / 2**30:.2f} GiB written, {done['bytes'] / 2**30 / max(done['seconds'], 1e-9):.2f} GiB/s); "
        f"to convert before a launch: dsrl-convert {checkpoint} {out} --universal"
    )


def _wait_for_conversion(checkpoint: Path, roles: list[str], out: Path, attempt: str, stall_s: float) -> None:
    """Wait, outside any collective, until rank 0's conversion in ``out`` is finished, failed, or has not changed
    for ``stall_s`` seconds."""
    seen, changed = -1, time.monotonic()
    while finished_conversion(checkpoint, roles, out) is None:
        try:
            failed = json.loads((out / FAILED_FILE).read_text())
        except (OSError, ValueError):
            failed = {}
        if failed.get("attempt") == attempt:
            raise CheckpointError(failed["problem"])
        size = _bytes_under(out)
        if size != seen:
            seen, changed = size, time.monotonic()
        elif time.monotonic() - changed > stall_s:
            raise CheckpointError(
                f"{out}: rank 0's conversion of {checkpoint} to universal form (to resume it at another world size) "
                f"wrote nothing for {stall_s:.0f} s (actor_rollout_ref.nccl_timeout); fix: convert it before the "
                f"launch (dsrl-convert {checkpoint} {out} --universal), or raise actor_rollout_ref.nccl_timeout"
            )
        time.sleep(POLL_S)


def _conversion_failed(checkpoint: Path, state: dict, problem: str) -> CheckpointError:
    return CheckpointError(
        f"{checkpoint}: its conversion to DeepSpeed's universal form (to resume it at another world size) "
        f"failed: {problem}; fix: resume with {state['world_size']} ranks, or trainer.resume_mode=disable "
        "to start over"
    )


def _bytes_under(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is not there); files that vanish while counted are skipped."""
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass
    return total
