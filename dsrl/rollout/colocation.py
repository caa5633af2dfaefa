"""One generation phase of a rollout engine colocated with the DeepSpeed engines.

The devices are shared: while the rollout engine generates, the trainer's engines hold as little
device memory as they can, and while they train, the rollout engine sleeps. The order, on every
rank, is

    release trainer memory    offload_states(include=...) of each engine that keeps states on the device
                              (``offload_targets``), empty_partition_cache() of every engine, empty the
                              allocator cache (on a device: a CPU accelerator has nothing to free)
    wake_up(["weights"])      the rollout engine's weights are re-allocated (level 2) or come back (level 1)
    update_weights(...)       the actor's full parameters, gathered a bucket at a time (a collective);
                              the engine drops its prefix cache after the push
    empty the allocator cache the push's buffers go back to the driver before the KV cache is mapped
    wake_up(["kv_cache"])     the KV cache is allocated only once the weights are in
    generate(...)             the body of the ``with`` block, any number of calls
    sleep()                   the rollout engine hands its memory back
    reload_states()           the engines offloaded above get their states back

Engines whose states already live in CPU memory (ZeRO parameter offload) are not offloaded: there is nothing
on the device to move. Nor is anything offloaded for a rollout engine whose device memory is reserved for good
(``static_memory``: vLLM without sleep mode), since that would free nothing it could use, nor on a CPU
accelerator, where device and host are one memory, unless asked (``offload_on_cpu``: the same calls, to test
them there). Where an engine has nothing to release (vLLM without sleep mode, the transformers rollout on a
CPU) ``wake_up`` / ``sleep`` are no-ops, so the same code runs there. The sleep and reloads also run when the
body raises: every step is rank-local, so no rank waits for another, and the engines are left as training
expects them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from dsrl.rollout.base import RolloutEngine

_GIB = 2**30


def offload_targets(engine: Any) -> list[OffloadStateTypeEnum]:
    """What ``engine.offload_states(include=...)`` should move off the device for a generation phase;
    [] when nothing: an engine without a ZeRO optimizer (the reference), or offloaded parameters (DeepSpeed
    refuses to move those).

    Gradients and their buffers always go. ZeRO-3 also moves its bf16 partition (1/world of the model);
    under ZeRO-1/2 those are the full weights the push reads, so they stay. So does ZeRO-3's partition of an
    engine with frozen parameters (LoRA): DeepSpeed 0.19.8 holds only the trained ones in the buffer it
    offloads, yet points every module parameter into it, the frozen base included. The fp32 master weights
    and the Adam moments go unless the optimizer already keeps them in CPU memory; ZeRO-3 moves them only
    for DeepSpeed's FusedAdam (it asserts so)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or isinstance(optimizer, DeepSpeedZeRoOffload) or not hasattr(optimizer, "offload_states"):
        return []
    if _offloaded(engine.zero_offload_param()):
        return []
    targets = [OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer]
    stage3 = engine.zero_optimization_stage() == 3
    if stage3 and all(p.requires_grad for p in engine.module.parameters()):
        targets.append(OffloadStateTypeEnum.lp_params)
    if not _offloaded(engine.zero_offload_optimizer()) and (not stage3 or type(optimizer.optimizer) is FusedAdam):
        targets += [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params]
    return targets


def offloaded_bytes(engine: Any, targets: Iterable[OffloadStateTypeEnum]) -> int:
    """Bytes of device memory ``engine.offload_states(include=targets)`` moves to the host: the distinct storages
    of the tensors DeepSpeed 0.19.8 re-homes for each target (``offload_states`` in zero/stage3.py and
    zero/stage_1_and_2.py; stages 1-2 have no contiguous gradient buffer to move). On a CPU accelerator, device
    and host are one memory: the bytes the same calls cover."""
    optimizer, device = engine.optimizer, get_accelerator().device_name()
    stage3 = engine.zero_optimization_stage() == 3
    tensors = {
        OffloadStateTypeEnum.hp_params: lambda: (
            optimizer.fp32_partitioned_groups_flat if stage3 else optimizer.single_partition_of_fp32_groups
        ),
        OffloadStateTypeEnum.lp_params: lambda: [optimizer.lp_param_buffer] if stage3 else optimizer.bit16_groups_flat,
        OffloadStateTypeEnum.lp_grads: lambda: (
            [optimizer.grad_partitions_flat_buffer]
            if stage3
            else [grad for grads in optimizer.averaged_gradients.values() if grads is not None for grad in grads]
        ),
        OffloadStateTypeEnum.contiguous_grad_buffer: lambda: (
            [bucket.buffer for bucket in optimizer.ipg_buckets.values()] if stage3 else []
        ),
        OffloadStateTypeEnum.optim_states: lambda: [
            value for state in optimizer.optimizer.state.values() for value in state.values()
        ],
    }
    storages = {}
    for target in targets:
        for tensor in tensors[target]():
            if torch.is_tensor(tensor) and tensor.device.type == device:
                storage = tensor.untyped_storage()
                # once each: DeepSpeed may train a float32 ZeRO-3 partition in place (master weights = parameters)
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _offloaded(offload_config: Any) -> bool:
    return offload_config is not None and offload_config.device != OffloadDeviceEnum.none


def _release_cache() -> None:
    """Hand the caching allocator's free blocks back to the driver (vLLM maps its memory outside it)."""
    if get_accelerator().device_name() != "cpu":
        gc.collect()  # drop the last references to the push's buffers first
        get_accelerator().empty_cache()


def _free_device_memory() -> float | None:
    """Free memory of this rank's CUDA device in GiB, as the driver sees it (vLLM allocates outside
    torch's caching allocator); None elsewhere (on CPU, sleep frees nothing)."""
    if get_accelerator().device_name() != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / _GIB


@contextmanager
def colocated_generation(
    rollout: RolloutEngine,
    *,
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    trainer_engines: Mapping[str, Any],
    metrics: dict[str, float],
    offload_on_cpu: bool = False,
) -> Iterator[RolloutEngine]:
    """Hand the devices to ``rollout`` with the actor's current weights for the ``with`` body.

    Args:
        rollout: the rollout engine (``VLLMRollout``, ``HFRollout``).
        weights: returns a fresh ``(name, full tensor)`` stream of the actor's parameters, e.g.
            ``lambda: iter_full_parameters(actor.module)``; consumed once (a collective).
        trainer_engines: the DeepSpeed engines sharing the devices by role (``actor``, ``critic``, ``ref``).
        metrics: filled with ``perf/offloaded_gib/<role>`` (``offloaded_bytes`` of each engine, in a phase that
            offloads), ``timing_s/release_memory``, ``timing_s/update_weights``,
            ``timing_s/wake``, ``timing_s/gen`` (the body), ``timing_s/sleep``, and on CUDA
            ``rollout/free_mem_before_wake_gib`` (free before the KV cache is mapped),
            ``rollout/free_mem_before_sleep_gib``, ``rollout/free_mem_after_sleep_gib`` and ``rollout/sleep_freed_gib``.
        offload_on_cpu: offload on a CPU accelerator too (``actor_rollout_ref.rollout.offload_states_on_cpu``).
    Yields:
        ``rollout``, awake, holding the actor's weights. Collective: every rank enters it.
    """
    on_cpu = get_accelerator().device_name() == "cpu"
    start = time.perf_counter()
    offloaded = []
    try:
        if not rollout.static_memory and (offload_on_cpu or not on_cpu):
            for role, engine in trainer_engines.items():
                targets = offload_targets(engine)
                metrics[f"perf/offloaded_gib/{role}"] = offloaded_bytes(engine, targets) / _GIB
                if targets:
                    offloaded.append(engine)  # first: an offload that raises half-way still gets its reload
                    engine.offload_states(include=targets)
        if not on_cpu:
            # Frees the gathered ZeRO-3 parameters; includes a gc.collect() (~0.4 s on the CPU quickstart,
            # where the "device" is host memory the rollout does not draw on).
            for engine in trainer_engines.values():
                engine.empty_partition_cache()
            get_accelerator().empty_cache()
        metrics["timing_s/release_memory"] = time.perf_counter() - start

        start = time.perf_counter()
        rollout.wake_up(["weights"])
        wake = time.perf_counter() - start
        start = time.perf_counter()
        rollout.update_weights(weights())
        _release_cache()
        metrics["timing_s/update_weights"] = time.perf_counter() - start
        free = _free_device_memory()
        if free is not None:
            metrics["rollout/free_mem_before_wake_gib"] = free  # what the KV cache's wake has to fit in
        start = time.perf_counter()
        rollout.wake_up(["kv_cache"])
        metrics["timing_s/wake"] = wake + time.perf_counter() - start

        start = time.perf_counter()
        yield rollout
        metrics["timing_s/gen"] = time.perf_counter() - start
    finally:
        before = _free_device_memory()
        start = time.perf_counter()
        rollout.sleep()
        metrics["timing_s/sleep"] = time.perf_counter() - start
        after = _free_device_memory()
        if before is not None and after is not None:
            metrics["rollout/free_mem_before_sleep_gib"] = before
            metrics["rollout/free_mem_after_sleep_gib"] = after
            metrics["rollout/sleep_freed_gib"] = after - before
        for engine in offloaded:
            engine.reload_states()
