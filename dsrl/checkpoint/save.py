"""Checkpoints that resume the whole loop exactly, and the actor exported as a Hugging Face model.

Layout (verl's names)::

    default_local_dir/
      latest_checkpointed_iteration.txt   N of the newest complete checkpoint (replaced atomically)
      global_step_N/
        actor/ds/...             DeepSpeed checkpoint: partitioned weights, optimizer, LR scheduler (a LoRA
                                 actor's: the adapters only; its frozen base is loaded from model.path)
        actor/huggingface/       with hf_model in actor.checkpoint.save_contents (LoRA: the merged model,
                                 and the adapter as a PEFT directory in huggingface/lora_adapter/)
        critic/ds/...            (gae)
        rng/rank_R.pt            RNG states of rank R (python, numpy, torch, accelerator)
        in_flight/rank_R.pt      colocate_async: rank R's partial rollouts (tokens, log-probs, versions)
        trainer_state.json       written last: step, sampler position, KL coefficient, skip counters,
                                 MLflow run id, state-relevant config and its hash, the training data's
                                 identity, the frozen parameters' checksum, the manifest, and a checksum
                                 of the state itself

Every rank writes into ``.tmp_global_step_N``; after a barrier the ranks hash the files (each a share
of them), rank 0 records the manifest (each file's size and SHA-256) in ``trainer_state.json``, syncs
it, and renames the directory to ``global_step_N``: a checkpoint is visible only once complete. Old
checkpoints are renamed to ``.trash_*`` before they are deleted, so a crash while pruning never leaves
a half-deleted ``global_step_*``. A rank that cannot write its part (a full disk) removes the
temporary directory and stops the run with ``CheckpointWriteError``, saying what failed and the free
space. Resuming (``dsrl.checkpoint.resume``) takes the newest checkpoint whose state and files check out:
``state_problem`` (the state parses, is unchanged since it was written, names this step, and every
file of the manifest is there with its size; ``dsrl.checkpoint.resume`` checks its fields), then
``file_problems`` (every file's SHA-256, the ranks hashing a share each); a crash at any point of a
save, or a file changed since, falls back to the previous checkpoint.

A checkpoint is data: torch files unpickle with ``weights_only=True`` (tensors and plain values, and the three
classes of ``DEEPSPEED_TYPES`` that DeepSpeed's files hold), never as arbitrary pickles that could run code. Each
rank loads its share of them so before anything else reads them (``pickled_code_problems``, beside the SHA-256,
which protects against damage, not against whoever wrote the manifest), and every load of DeepSpeed's, which passes
``weights_only=False`` and has no setting for it, runs under ``weights_only_loads``.

Every function that takes engines is a collective: every rank calls it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
from safetensors.torch import save_file

from dsrl.config import RESUME_HARMLESS_KEYS, Config, to_dict
from dsrl.config.keys import SCHEMA
from dsrl.config.layout import ADAPTER_DIR, FINAL_MODEL_DIR
from dsrl.engines.lora import (
    ADAPTER,
    ADAPTER_FILE,
    is_peft_model,
    iter_adapter_parameters,
    iter_merged_parameters,
    saved_adapter_tensors,
)
from dsrl.engines.weight_sync import checkpoint_format, iter_full_parameters
from dsrl.tracking import flatten

if TYPE_CHECKING:
    from peft import PeftModel

STATE_FILE = "trainer_state.json"
STATE_CHECKSUM = "state_sha256"  # the state's own checksum, over every other field
LATEST_FILE = "latest_checkpointed_iteration.txt"
DS_TAG = "ds"  # DeepSpeed's tag: engine files live in <role>/ds/
IN_FLIGHT_DIR = "in_flight"  # trainer.v1.trainer_mode=colocate_async: each rank's partial rollouts
HF_DIR = FINAL_MODEL_DIR  # the Hugging Face model: the run folder's final one, and a checkpoint's actor/ one
# 3: the state holds each role's frozen parameters' checksum; 2: the manifest holds each file's size and SHA-256
# (1: sizes only), the state its own checksum
FORMAT = 3
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MAX_SHARD_BYTES = 5 * 2**30
# The classes beyond tensors and plain values that DeepSpeed's (0.19.8) checkpoint files hold, found by loading
# every file of a checkpoint of each shipped kind (ZeRO-2, ZeRO-3, ZeRO-3 + offload; float32 and bfloat16; LoRA;
# the critic) and of its universal form with weights_only=True: the only classes their loads allow.
DEEPSPEED_TYPES = (
    LossScaler,  # the optimizer state's loss scaler (static, scale 1: dsrl refuses fp16)
    ZeroStageEnum,  # the optimizer state's ZeRO stage
    fragment_address,  # ZeRO-1/2's param_slice_mappings: each parameter's (numel, start) in its rank's partition
)
# torch's switch that overrides a torch.load call's own weights_only=False (read at each call).
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # with the first set too, torch.load refuses to run


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: the path, what is wrong, and the fix."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a folder that went away): what failed and the free space."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"global_step_{step}"


# ---- what is saved ---------------------------------------------------------------------------


def state_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The settings that shape the run (all but ``RESUME_HARMLESS_KEYS``), flattened, with the world size."""
    flat = flatten(to_dict(cfg))
    kept = {k: v for k, v in flat.items() if not any(re.fullmatch(p, k) for p in RESUME_HARMLESS_KEYS)}
    return {**kept, "world_size": world_size}


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key: saved -> now`` for every state-relevant setting that differs (absent keys show as <unset>). A key
    the checkpoint lacks that is at its default now is none: a key dsrl gained since, whose default is what the
    run that wrote the checkpoint did."""
    unset = "<unset>"
    return [
        f"{key}: {saved.get(key, unset)!r} -> {now.get(key, unset)!r}"
        for key in sorted(set(saved) | set(now))
        if saved.get(key, unset) != now.get(key, unset)
        and not (key not in saved and key in SCHEMA and now[key] == SCHEMA[key].default)
    ]


def _has_frozen(module: torch.nn.Module) -> bool:
    """Whether part of ``module`` is frozen (a LoRA actor's base): its checkpoints hold the trained part only."""
    return any(not p.requires_grad for p in module.parameters())


def frozen_checksum(module: torch.nn.Module, chunk: int = 1 << 24) -> int | None:
    """A checksum of ``module``'s frozen parameters, None when none is: the sum, modulo 2**64, of their elements'
    bit patterns as integers. Integer sums do not depend on order, so it is exact whatever the ZeRO stage, world
    size or device, and it costs one pass over this rank's share of the weights (no file is read). The checkpoint
    of a LoRA actor holds the adapters alone; a resume checks with it that the base they were trained on is the
    one loaded from ``model.path``. Collective under ZeRO-3 (each rank sums its partitions)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    if not frozen:
        return None
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    partitioned = hasattr(frozen[0], "ds_tensor")  # ZeRO-3: the same on every rank
    total = torch.zeros((), dtype=torch.int64)
    for p in frozen:
        if partitioned:  # this rank's flat partition, less the padding that ends the last ranks'
            part = p.ds_tensor.numel()
            flat = p.ds_tensor.narrow(0, 0, min(max(p.ds_numel - dist.get_rank() * part, 0), part))
        else:
            flat = p.detach().reshape(-1)
        ints = flat.view(bits[flat.element_size()])
        for start in range(0, ints.numel(), chunk):
            total += ints[start : start + chunk].sum(dtype=torch.int64).cpu()
    if partitioned:
        total = total.to(get_accelerator().current_device_name())
        dist.all_reduce(total)
    return int(total)


def rng_state() -> dict[str, Any]:
    """This process's RNG streams as tensors and plain values (loads with ``weights_only=True``)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version_, internal, gauss = state["python"]
    random.setstate((version_, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])


# ---- saving ----------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds either its old content or all of ``text``, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    """Rename out of the ``global_step_*`` namespace first, then delete: never a half-deleted checkpoint."""
    trash = path.parent / f".trash_{path.name}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash)


def _files(directory: Path) -> list[str]:
    """Every file of a checkpoint directory but the state, relative and sorted."""
    return [str(p.relative_to(directory)) for p in sorted(directory.rglob("*")) if p.is_file() and p.name != STATE_FILE]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_shares(directory: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of every file in ``names``, each rank hashing every world-th one. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: sha256_file(directory / name) for name in names[rank::world]}
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    return {name: digest for share in shares for name, digest in share.items()}


def state_checksum(state: dict[str, Any]) -> str:
    """SHA-256 of a state's fields but its own checksum, as written (sorted keys)."""
    fields = {k: v for k, v in state.items() if k != STATE_CHECKSUM}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def save_engines(directory: Path, engines: dict[str, Any]) -> None:
    """Each engine's DeepSpeed checkpoint under ``directory/<role>/ds``; of an engine with frozen parameters
    (LoRA), the trained ones and their optimizer state only. Collective."""
    for role, engine in engines.items():
        partial = _has_frozen(engine.module)
        with _frozen_left_out(engine.module) if partial else nullcontext():
            engine.save_checkpoint(
                str(directory / role), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=partial
            )


@contextmanager
def _frozen_left_out(module: torch.nn.Module) -> Iterator[None]:
    """``module.state_dict()`` without its frozen tensors under any of their names. DeepSpeed's
    ``exclude_frozen_parameters`` drops each under one name, so a tied one (an output layer that is the
    embedding) stayed under the other: the whole embedding in every ZeRO-2 checkpoint of a LoRA actor."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def leave_out(_module, state_dict, _prefix, _metadata):
        for name in frozen & state_dict.keys():
            del state_dict[name]

    handle = module.register_state_dict_post_hook(leave_out)
    try:
        yield
    finally:
        handle.remove()


def save_in_flight(directory: Path, rank: int, state: dict[str, Any]) -> None:
    """This rank's partial rollouts (``dsrl.trainer.partial_rollout.InFlight.state_dict``: tensors and ints)."""
    (directory / IN_FLIGHT_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / IN_FLIGHT_DIR / f"rank_{rank}.pt")


def load_in_flight(directory: Path, rank: int) -> dict[str, Any] | None:
    """What ``save_in_flight`` wrote for ``rank``, loaded as data; None for a checkpoint without (a sync run's)."""
    path = directory / IN_FLIGHT_DIR / f"rank_{rank}.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def save_rng(directory: Path, rank: int) -> None:
    (directory / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), directory / "rng" / f"rank_{rank}.pt")


def write_state(directory: Path, state: dict[str, Any], digests: dict[str, str]) -> None:
    """``trainer_state.json`` with the manifest of everything else in ``directory`` (each file's size and
    ``digests[file]``, its SHA-256) and its own checksum; written last."""
    files = {name: {"bytes": (directory / name).stat().st_size, "sha256": digests[name]} for name in _files(directory)}
    state = {**state, "files": files}
    state[STATE_CHECKSUM] = state_checksum(state)
    _write_atomically(directory / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))


def publish(tmp: Path, final: Path) -> None:
    """Make the complete checkpoint visible under its final name and point ``latest`` at it."""
    if final.exists():  # a rerun from an older checkpoint writes this step again
        _remove(final)
    os.replace(tmp, final)
    _write_atomically(final.parent / LATEST_FILE, final.name.removeprefix("global_step_"))


def prune(root: Path, keep: dict[str, int | None]) -> None:
    """Delete the state of ``role`` from all but its ``keep[role]`` newest checkpoints (None: keep all);
    a checkpoint left with no role's state is deleted whole."""
    steps = sorted(complete_steps(root), reverse=True)
    for age, step in enumerate(steps):
        directory = step_dir(root, step)
        present = [role for role in keep if (directory / role).is_dir()]
        dropped = [role for role in present if keep[role] is not None and age >= keep[role]]
        if not dropped:
            continue
        if len(dropped) == len(present):
            _remove(directory)
        else:
            for role in dropped:
                _remove(directory / role)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    engines: dict[str, Any],
    state: dict[str, Any],
    export_hf: bool,
    actor_module: torch.nn.Module,
    tokenizer: Any,
    keep: dict[str, int | None],
    in_flight: dict[str, Any] | None = None,
) -> Path:
    """Write ``root/global_step_<step>`` (see the module docstring) with the trainer's ``state`` plus
    step, world size, dsrl version and format, and this rank's ``in_flight`` partial rollouts when given; returns
    its path. Collective."""
    rank = dist.get_rank()
    state = {
        **state,
        "format": FORMAT,
        "dsrl_version": version("dsrl"),
        "global_step": step,
        "world_size": dist.get_world_size(),
    }
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    with _stop_when_unwritable(tmp, step):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
            tmp.mkdir(parents=True)
        dist.barrier()
        save_engines(tmp, engines)
        save_rng(tmp, rank)
        if in_flight is not None:
            save_in_flight(tmp, rank, in_flight)
        if export_hf:
            export_hf_model(actor_module, tokenizer, tmp / "actor" / HF_DIR)
        dist.barrier()
        _check_every_rank_wrote(tmp, step)
        digests = _hash_shares(tmp, _files(tmp))
        if rank == 0:
            write_state(tmp, state, digests)
            publish(tmp, final)
            prune(root, keep)
        dist.barrier()
    return final


def _check_every_rank_wrote(tmp: Path, step: int) -> None:
    """CheckpointWriteError on every rank unless rank 0 sees each rank's files in ``tmp``, the ones it publishes
    (each rank's RNG file stands for its shards): a directory that is not one on every node would publish a
    checkpoint holding node 0's shards alone. The preflight checks this at start-up; a mount lost since is
    found here. Collective."""
    world = dist.get_world_size()
    missing: list = [
        [r for r in range(world) if not (tmp / "rng" / f"rank_{r}.pt").is_file()] if dist.get_rank() == 0 else None
    ]
    dist.broadcast_object_list(missing, src=0)
    if missing[0]:
        raise CheckpointWriteError(
            f"step {step}: rank 0 does not see the files of {len(missing[0])} rank(s) (first: rank {missing[0][0]}) in "
            f"{tmp}: trainer.default_local_dir is no longer one directory on every node, so this checkpoint would lack "
            "their shards; nothing was published. Fix: a directory every node sees at the same path (a shared mount), "
            "then run again (trainer.resume_mode=auto resumes from the last complete checkpoint)"
        )


@contextmanager
def _stop_when_unwritable(tmp: Path, step: int) -> Iterator[None]:
    """Turn a failed write of this rank's part of a checkpoint into ``CheckpointWriteError``: the partial
    directory removed, the error, the free space and the last complete checkpoint named. torch's writer
    reports a full disk as ``[enforce fail at inline_container.cc] unexpected pos``, without the errno. The
    other ranks may wait in a collective of the save: the launcher stops them when this one exits."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "inline_container" not in str(err):
            raise  # not a write (a collective that timed out, a bug): reported as what it is
        shutil.rmtree(tmp, ignore_errors=True)
        root = tmp.parent
        free = shutil.disk_usage(root).free / 2**20 if root.is_dir() else float("nan")
        latest = root / LATEST_FILE
        last = f"global_step_{latest.read_text().strip()}" if latest.is_file() else "none"
        raise CheckpointWriteError(
            f"step {step}: the checkpoint could not be written to {tmp} ({' '.join(str(err).split())}); "
            f"{free:,.0f} MiB are free on the filesystem of {root} (a full disk or a file-size limit fails "
            f"like this). The partial checkpoint was removed; the last complete one is {last}. Fix: free "
            "space or point trainer.default_local_dir at a filesystem with room, then run again "
            "(trainer.resume_mode=auto resumes from the last complete checkpoint)"
        ) from err


# ---- the Hugging Face model --------------------------------------------------------------------


def _rank() -> int:
    """This process's rank; 0 in a process without a process group (``dsrl.commands.convert``, run without the
    launcher)."""
    return dist.get_rank() if dist.is_initialized() else 0


def _shards(named: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard


def export_hf_model(
    module: torch.nn.Module, tokenizer: Any, out: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """The actor as a Hugging Face model directory: safetensors shards with an index, ``config.json``,
    ``generation_config.json`` and the tokenizer; a LoRA actor (a ``PeftModel``) as its merged model
    (``iter_merged_parameters``: the base model's names) and, in ``out/lora_adapter``, its adapter as a
    PEFT directory (``save_adapter``). Tensors under the model's checkpoint names and shapes
    (``checkpoint_format``: a mixture-of-experts model's experts one tensor per expert, as ``save_pretrained``
    writes them). Collective.

    Parameters are gathered from ZeRO-3 a bucket at a time; rank 0 keeps at most one shard and one
    bucket of full tensors, the other ranks one bucket. Written to a temporary directory renamed to
    ``out`` when complete (an older ``out`` is replaced). A process without a process group is rank 0 of
    one (``dsrl.commands.convert`` exports a checkpoint's model so, without the launcher).
    """
    rank = _rank()
    lora = is_peft_model(module)
    base = module.get_base_model() if lora else module
    named = checkpoint_format(base, iter_merged_parameters(module) if lora else iter_full_parameters(module))
    tmp = out.with_name(f".tmp_{out.name}")
    if rank != 0:
        for _ in named:  # the gathers are collectives; only rank 0 writes
            pass
        if lora:
            save_adapter(module, tmp / ADAPTER_DIR)
        dist.barrier()
        return out
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    count = 0
    for shard in _shards(((name, tensor.cpu()) for name, tensor in named), max_shard_bytes):
        count += 1
        name = f"shard-{count:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    renamed = {f"shard-{i:05d}.safetensors": f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    for old, new in renamed.items():
        os.replace(tmp / old, tmp / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    base.config.save_pretrained(tmp)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if lora:
        save_adapter(module, tmp / ADAPTER_DIR)
    if out.exists():
        _remove(out)
    os.replace(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return out


def save_adapter(module: PeftModel, out: Path) -> None:
    """A LoRA actor's adapter as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base, out)`` and ``actor_rollout_ref.model.lora_adapter_path`` load. Gathered
    from ZeRO-3 (``iter_adapter_parameters``); rank 0 writes. Collective."""
    tensors = saved_adapter_tensors(iter_adapter_parameters(module))
    if _rank() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    module.peft_config[ADAPTER].save_pretrained(out)


def adapter_dir(model_dir: Path | None) -> Path | None:
    """The adapter exported with a LoRA actor's model (``model_dir/lora_adapter``), None without one."""
    return model_dir / ADAPTER_DIR if model_dir is not None and (model_dir / ADAPTER_DIR).is_dir() else None


# ---- resuming --------------------------------------------------------------------------------


def complete_steps(root: Path) -> list[int]:
    """Steps N with a ``global_step_N`` directory under ``root`` (complete by construction, unchecked)."""
    if not root.is_dir():
        return []
    return [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def state_problem(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(state, None)`` when ``directory``'s state file parses, is unchanged since it was written (its
    checksum), is of this format, names this step, and every file of its manifest is there with its
    size; else ``(None, why not)``. The files' contents are ``file_problems``'."""
    path = directory / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no {STATE_FILE} (not a dsrl checkpoint, or its save never finished)"
    except (OSError, ValueError) as err:
        return None, f"{STATE_FILE} is unreadable ({err})"
    if not isinstance(state, dict) or "format" not in state:
        return None, f"{STATE_FILE} is not a dsrl checkpoint state"
    if state["format"] != FORMAT:
        return None, (
            f"written by dsrl {state.get('dsrl_version', '?')} in checkpoint format {state['format']!r}, "
            f"which this dsrl ({version('dsrl')}, format {FORMAT}) does not read"
        )
    if state.get(STATE_CHECKSUM) != state_checksum(state):
        return None, f"{STATE_FILE} was changed after it was written (its checksum does not match)"
    step = int(_STEP_DIR.match(directory.name).group(1)) if _STEP_DIR.match(directory.name) else None
    if step is not None and state.get("global_step") != step:
        return None, f"{STATE_FILE} is for step {state.get('global_step')!r}, not {step}"
    files = state.get("files")
    if not isinstance(files, dict):
        return None, f"{STATE_FILE} has no manifest of the checkpoint's files"
    for name, entry in files.items():
        file = directory / name
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return None, f"{name} has {file.stat().st_size} bytes, {entry['bytes']} were written"
    return state, None


def file_problems(directory: Path, files: dict[str, dict], rank: int, world: int) -> list[str]:
    """One line for each file of this rank's share (every world-th of the manifest ``files``, sorted) whose
    SHA-256 is not the one written: changed or damaged since the save."""
    names = sorted(files)[rank::world]
    return [
        f"{name} changed since it was written (its SHA-256 does not match)"
        for name in names
        if sha256_file(directory / name) != files[name]["sha256"]
    ]


def pickled_code_problem(path: Path, name: str) -> str | None:
    """Why the torch file ``path`` (``name`` in the message) does not load as data, or None (``_load_error``). A file
    in neither of torch.save's formats (a zip, or a pickle of protocol 2 or more) is left to its loader, which
    refuses it under ``weights_only_loads`` as well."""
    with path.open("rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and not head.startswith(b"\x80"):
        return None
    err = _load_error(path)
    return None if err is None else _not_data(name, err)


def _load_error(path: Path) -> pickle.UnpicklingError | None:
    """What unpickling ``path`` with ``weights_only=True`` and ``DEEPSPEED_TYPES`` allowed raised, or None; a zip is
    memory-mapped, so its tensors are not read."""
    with path.open("rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    try:
        with torch.serialization.safe_globals(list(DEEPSPEED_TYPES)):
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as err:
        return err
    return None


def _not_data(name: str, err: pickle.UnpicklingError) -> str:
    found = re.search(r"GLOBAL (\S+)", str(err))
    what = f"a reference to {found.group(1)}" if found else " ".join(str(err).split())
    return (
        f"{name} holds pickled Python beyond tensors and plain values ({what}), which loading could run: dsrl "
        "loads checkpoint files as data only (torch.load with weights_only=True)"
    )


def pickled_code_problems(directory: Path, files: dict[str, dict], rank: int, world: int) -> list[str]:
    """One line for each torch file of this rank's share (every world-th of the manifest ``files``' ``.pt`` files,
    sorted) that does not load as data (``pickled_code_problem``)."""
    names = sorted(name for name in files if name.endswith(".pt"))[rank::world]
    return [line for name in names if (line := pickled_code_problem(directory / name, name)) is not None]


@contextmanager
def weights_only_loads(directory: Path) -> Iterator[None]:
    """Within ``with``: every ``torch.load`` of this process loads as data (``weights_only=True``, the classes of
    ``DEEPSPEED_TYPES`` allowed), DeepSpeed's too, which pass ``weights_only=False``: torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides the call's argument. A file that holds more raises
    ``CheckpointError`` naming the first torch file under ``directory`` that does not load as data; none of its
    code has run."""
    saved = {key: os.environ.pop(key, None) for key in (_FORCE_WEIGHTS_ONLY, _FORCE_NO_WEIGHTS_ONLY)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(list(DEEPSPEED_TYPES)):
            yield
    except pickle.UnpicklingError as err:
        found = ((path, _load_error(path)) for path in sorted(directory.rglob("*.pt")))
        culprit = next(((path, error) for path, error in found if error is not None), None)
        line = _not_data(str(culprit[0].relative_to(directory)), culprit[1]) if culprit else _not_data("a file", err)
        raise CheckpointError(
            f"{directory}: {line}; fix: use a checkpoint that dsrl wrote (one from elsewhere may carry code: "
            "docs/checkpoints.md)"
        ) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def load_checkpoint(directory: Path, engines: dict[str, Any], rank: int) -> None:
    """Restore every engine (weights, optimizer, LR scheduler, step counters) and this rank's RNG, every file
    loaded as data (``weights_only_loads``). Collective."""
    for role, engine in engines.items():
        # A LoRA actor's checkpoint lacks the frozen base (loaded from model.path; frozen_checksum checked it).
        with weights_only_loads(directory / role):
            path, _ = engine.load_checkpoint(
                str(directory / role), tag=DS_TAG, load_module_strict=not _has_frozen(engine.module)
            )
        if path is None:
            raise CheckpointError(f"{directory / role}: DeepSpeed found no {role} checkpoint to load")
    set_rng_state(torch.load(directory / "rng" / f"rank_{rank}.pt", weights_only=True))
