"""DeepSpeed plumbing shared by the actor, critic and reference engines.

- ``init_distributed``: the process group every engine and the weight sync run on, in the world this
  process's launcher describes (``dsrl.runtime.launch``).
- ``build_ds_config``: a JSON from ``ds_configs/`` (or a path) with dsrl's run values filled in and
  checked by ``dsrl.config.deepspeed_json.fill_ds_json``, the same function validation runs before
  torch loads: ``"auto"`` (or absent) keys get the value derived from the run config; a concrete
  value that disagrees with the run config is refused, never silently replaced.
- ``load_pretrained``: loads a transformers model so that under ZeRO-3 each rank only ever holds
  its partition (``HfDeepSpeedConfig`` makes ``from_pretrained`` build under ``deepspeed.zero.Init``).
- ``initialize_trained``: ``deepspeed.initialize`` for the actor and the critic, their Adam's bias
  correction made a function of the step count alone (``bias_correction_from_step``), so that a resumed
  run takes the same optimizer steps as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import default_pg_timeout
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

# Importing model classes inside `deepspeed.zero.Init` fails with a signature-mismatch TypeError,
# so the auto classes (and with them the model registry) are imported here, before any Init.
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: F401
from transformers.integrations import HfDeepSpeedConfig

from dsrl.config.deepspeed_json import fill_ds_json, zero_stage
from dsrl.runtime.distributed import rendezvous_watchdog, stop_when_launcher_dies
from dsrl.runtime.launch import RendezvousError, join

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def init_distributed(timeout_s: int | None = None) -> None:
    """Join (or create) the default process group; idempotent.

    The world is the one this process's launcher describes (``dsrl.runtime.launch.join``: deepspeed, torchrun, srun,
    mpirun, or one process on a free port). Under a launcher a watchdog stops this rank when the process that
    launched it is gone (``stop_when_launcher_dies``). ``timeout_s`` (``actor_rollout_ref.nccl_timeout``): how
    long the ranks wait for each other, in the rendezvous and in every collective; None keeps DeepSpeed's
    (``DEEPSPEED_TIMEOUT`` minutes, 10). While the ranks gather, a rank that waits long says so
    (``rendezvous_watchdog``); a rendezvous that times out raises ``RendezvousError``.
    """
    if dist.is_initialized():
        return
    launch = join()
    # NCCL without cuMem-allocated buffers beside vLLM's memory pool, on every rank alike, whatever its rollout.
    # Older vLLM set this when imported (vllm/env_override.py); 0.32's no longer does (only its weight-transfer
    # code reads it). NCCL's NVLS (NVSwitch) is built on cuMem, so a user may set 1 and measure (unmeasured here).
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    timeout = default_pg_timeout if timeout_s is None else timedelta(seconds=timeout_s)
    try:
        with rendezvous_watchdog(launch):
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=timeout)
    except dist.DistStoreError as err:
        raise RendezvousError(
            f"rank {launch.rank} on {socket.gethostname()}: the {launch.world_size} ranks did not all meet at "
            f"{launch.master_addr}:{launch.master_port} within {timeout.total_seconds():.0f} s ({launch.launcher}; "
            f"{str(err).splitlines()[0]}); fix: start every node's ranks (each host of the hostfile reachable, the "
            "same command with its own --node_rank on every node), make the address reachable from every node, "
            "or check that WORLD_SIZE counts the ranks you started"
        ) from err
    stop_when_launcher_dies(launch.launcher)
    # One device per rank, the one of its local rank (a no-op on CPU), as DeepSpeed's engines assume; a rank
    # that sees fewer devices is reported by the preflight.
    if launch.local_rank < get_accelerator().device_count():
        get_accelerator().set_device(launch.local_rank)
    unlink_shared_memory_buffers()


def unlink_shared_memory_buffers() -> None:
    """Remove the names of DeepSpeed's shared-memory all-reduce buffers (CPU ranks of one machine): each rank
    creates one in /dev/shm (66 MiB) and maps every other's while the group forms, and nothing removes them,
    even after a clean exit. Once every rank has mapped them (a barrier) the names can go: the memory stays
    mapped until the last rank ends, however it ends. Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if get_accelerator().device_name() != "cpu" or os.environ.get("LOCAL_SIZE") != str(world):
        return  # DeepSpeed makes them for CPU ranks that all share one machine only
    dist.barrier()
    # The name DeepSpeed's shm.cpp gives them: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>.
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path("/dev/shm") / name)


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
    """A complete DeepSpeed config dict for one engine: ``fill_ds_json`` on this process group's world size.

    ``train_batch_size = micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``
    (DeepSpeed checks that identity). ``optim`` (lr, betas, weight_decay) and ``grad_clip`` are given
    for training engines; an engine without them (the reference) must have no ``optimizer`` section.
    ``prefix`` is the dotted config path of the role (e.g. ``actor_rollout_ref.actor``) for messages.
    Raises ValueError (``DeepSpeedJsonError``: one line per problem).
    """
    if dtype not in DTYPES:
        raise ValueError(f"actor_rollout_ref.model.dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    return fill_ds_json(
        name_or_path,
        key=key,
        prefix=prefix,
        world_size=dist.get_world_size(),
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dtype=dtype,
        optim=optim,
        grad_clip=grad_clip,
    )


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


def lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: Any, *, total_training_steps: int | None, prefix: str
) -> torch.optim.lr_scheduler.LambdaLR:
    """verl's schedule over training steps (the trainer steps it once per ``update``, as verl does).

    Linear warm-up from 0 over ``lr_warmup_steps`` (or ``lr_warmup_steps_ratio`` of the run), then
    constant or a cosine down to ``min_lr_ratio * lr``: the factors of verl 0.9's
    ``get_constant_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup``, with its operations in its
    order, so that every step's lr is verl's to the last bit (transformers' cosine with a floor, the same curve
    written otherwise, differs in the last bit at many steps). ``total_training_steps`` is needed by the ratio
    and the cosine only.
    """
    kind = optim.warmup_style or optim.lr_scheduler_type
    warmup = optim.lr_warmup_steps
    needs_total = kind == "cosine" or (warmup <= 0 and optim.lr_warmup_steps_ratio > 0)
    if needs_total and total_training_steps is None:
        raise ValueError(
            f"{prefix}.optim: a cosine schedule or lr_warmup_steps_ratio needs the run's total training steps"
        )
    if warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * total_training_steps) if needs_total else 0
    if kind == "constant":
        factor = functools.partial(_constant_factor, warmup=warmup)
    else:
        factor = functools.partial(_cosine_factor, warmup=warmup, total=total_training_steps, floor=optim.min_lr_ratio,
                         cycles=optim.num_cycles)  # fmt: skip
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _constant_factor(step: int, *, warmup: int) -> float:
    """The lr over its peak at ``step``: linear from 0 over ``warmup`` steps, then 1."""
    if step < warmup:
        return float(step) / float(max(1.0, warmup))
    return 1.0


def _cosine_factor(step: int, *, warmup: int, total: int, floor: float, cycles: float) -> float:
    """The lr over its peak at ``step``: the warm-up, then ``cycles`` cosine periods over the rest of the run between
    1 and ``floor`` (``min_lr_ratio``)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    cosine = math.cos(math.pi * float(cycles) * 2.0 * progress)
    return max(floor, cosine * ((1 - floor) * 0.5) + (1 + floor) * 0.5)


def initialize_trained(module: torch.nn.Module, ds_config: dict[str, Any]) -> deepspeed.DeepSpeedEngine:
    """The DeepSpeed engine of a trained role (the actor, the critic): its trainable parameters under
    ``ds_config``, the optimizer's steps exact across a resume (``bias_correction_from_step``)."""
    remember_cpu_info()
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=ds_config
    )
    bias_correction_from_step(engine.basic_optimizer)
    return engine


def remember_cpu_info() -> None:
    """Make ``cpuinfo.get_cpu_info`` answer from memory after its first call in this process.

    DeepSpeed asks py-cpuinfo three times for each CPU Adam it builds (its op builder twice, the optimizer
    once), and each call runs a subprocess for about a second on our 2-core machine; the answer is a fact
    of the machine. Every call gets a copy, so a caller's changes stay its own."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    ask = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict[str, Any]:
        return dict(ask())

    get_cpu_info.remembered = True
    cpuinfo.get_cpu_info = get_cpu_info


def bias_correction_from_step(optimizer: torch.optim.Optimizer) -> None:
    """Make DeepSpeed's C++ Adam take ``beta ** t`` from the step count ``t`` alone, at every step.

    DeepSpeed's CPU Adam (the optimizer of every offloaded setup, GPU nodes included) and the CPU build
    of FusedAdam keep ``beta ** t`` in a C++ object: multiplied by ``beta`` when the step count rises by
    one, ``pow(beta, t)`` when it jumps, as at the first step after a resume. In float32 the two differ in
    the last bit at some ``t`` (``beta2 = 0.999``: t = 3, 6, 12, ...), so a resumed run drifts from the
    uninterrupted one from there on. Before each ``step()`` the C++ object is made to recompute: given
    other betas (a fresh object for CPU Adam; one update of a one-element dummy for FusedAdam's, which
    every FusedAdam of the process shares), which its next step sees as a change of betas, so every
    step, resumed or not, takes ``pow(beta, t)``. torch's Adam and FusedAdam's CUDA kernel compute it
    from the step count already.
    """
    if isinstance(optimizer, DeepSpeedCPUAdam):

        def recompute() -> None:  # the hyperparameters are placeholders: every update passes its own
            optimizer.ds_opt_adam.create_adam(optimizer.opt_id, 0.0, 0.0, 0.0, 0.0, 0.0, optimizer.adam_w_mode, False)

    elif isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu":
        dummy = [[torch.zeros(1)] for _ in range(4)]  # gradient, parameter, exp_avg, exp_avg_sq
        no_overflow = torch.zeros(1, dtype=torch.int)

        def recompute() -> None:  # chunk size (unused on CPU), flag, tensors, lr, beta1, beta2, eps, step, mode,
            # bias correction, weight decay
            optimizer.multi_tensor_adam(1, no_overflow, dummy, 0.0, 0.0, 0.0, 1.0, 1, optimizer.adam_w_mode, 1, 0.0)

    else:
        return
    step = type(optimizer).step

    def step_from_count(self, *args, **kwargs):
        recompute()
        return step(self, *args, **kwargs)

    optimizer.step = types.MethodType(step_from_count, optimizer)  # bound: LR schedulers wrap it as a method
