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
conversion from the shared filesystem the checkpoints are on. It is removed once every rank has loaded it;
one left by a crash is deleted and redone by the next conversion of that step, from the checkpoint (whose
files were checked against its manifest). Rank 0 converts in-process (``ds_to_universal``'s
worker pools are not forked from a rank that holds a process group) while the other ranks wait in a
collective, within ``actor_rollout_ref.nccl_timeout``.

Per rank state: rank r takes the RNG state of the checkpoint's rank r where there was one; a rank the
checkpoint did not have is seeded from ``trainer.seed``, the step and r (``new_rank_seed``). The sampler
position, LR schedules, KL coefficient and skip counters are global and restored as at the same world size
(``dsrl.checkpoint.resume.restore``).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

from dsrl.checkpoint.save import DS_TAG, CheckpointError, set_rng_state, step_dir, weights_only_loads
from dsrl.runtime.seeding import seed_all

logger = logging.getLogger("dsrl")


def universal_dir(root: Path, step: int) -> Path:
    """Where the conversion of a checkpoint of step ``step`` goes: beside the checkpoints under ``root``."""
    return root / f".universal_{step_dir(root, step).name}"


def new_rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank that the checkpoint of ``step`` did not have: from ``trainer.seed``, the step and the
    rank, so two such ranks, or one at two steps, do not draw alike."""
    return seed + 104_729 * step + rank


def convert(checkpoint: Path, roles: list[str], out: Path) -> None:
    """Each role's ``checkpoint/<role>/ds`` in universal form under ``out/<role>/ds``, its files loaded as data
    (``weights_only_loads``: CheckpointError for one that holds more)."""
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


def load_at_new_world_size(
    checkpoint: Path, state: dict[str, Any], engines: dict[str, Any], *, root: Path, seed: int, rank: int
) -> None:
    """Restore every engine (weights, optimizer, step counters) from ``checkpoint``, written by
    ``state["world_size"]`` ranks, at this world size through its universal conversion, and this rank's RNG
    (module doc). Collective."""
    out = universal_dir(root, state["global_step"])
    problem: list = [None]
    if rank == 0:
        try:
            start = time.perf_counter()
            shutil.rmtree(out, ignore_errors=True)  # left by a crash during an earlier conversion or load
            convert(checkpoint, list(engines), out)
            logger.info(
                f"{checkpoint} ({state['world_size']} ranks) to universal form in {out}: converted in "
                f"{time.perf_counter() - start:.2f} s"
            )
        except Exception as err:  # noqa: BLE001 -- reported on every rank, not one rank's traceback and a hang
            problem[0] = f"{type(err).__name__}: {' '.join(str(err).split())}"
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(
            f"{checkpoint}: its conversion to DeepSpeed's universal form (to resume it at another world size) "
            f"failed: {problem[0]}; fix: resume with {state['world_size']} ranks, or trainer.resume_mode=disable "
            "to start over"
        )
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
