"""One generation phase of a rollout engine colocated with the DeepSpeed engines (DESIGN §7).

The devices are shared: while the rollout engine generates, the trainer's engines hold as little
device memory as they can, and while they train, the rollout engine sleeps. The order, on every
rank, is

    release trainer memory    offload_states() of each engine that keeps states on the device,
                              empty_partition_cache() of every engine, empty the allocator cache
    wake_up(["weights"])      the rollout engine's weights come back (level 1) or are re-allocated (level 2)
    update_weights(...)       the actor's full parameters, gathered a bucket at a time (a collective);
                              the engine drops its prefix cache after the push
    wake_up(["kv_cache"])     the KV cache is allocated only once the weights are in
    generate(...)             the body of the ``with`` block, any number of calls
    sleep()                   the rollout engine hands its memory back
    reload_states()           the engines offloaded above get their states back

Engines whose states already live in CPU memory (ZeRO parameter offload, or a CPU accelerator)
are not offloaded: there is nothing on the device to move. A rollout engine without sleep mode
(``HFRollout``; vLLM on CPU) makes ``wake_up`` / ``sleep`` no-ops, so the same code runs there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from dsrl.rollout.base import RolloutEngine

_GIB = 2**30


def keeps_states_on_device(engine: Any) -> bool:
    """Whether ``engine.offload_states()`` would free device memory: a device accelerator, an
    optimizer that can move its states (DeepSpeed's ZeRO optimizers; not an inference-only
    engine), and parameters that are not offloaded already (DeepSpeed refuses to move those)."""
    if get_accelerator().device_name() == "cpu":
        return False
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or isinstance(optimizer, DeepSpeedZeRoOffload) or not hasattr(optimizer, "offload_states"):
        return False
    param_offload = engine.zero_offload_param()
    return param_offload is None or param_offload.device == OffloadDeviceEnum.none


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
    trainer_engines: Sequence[Any] = (),
    metrics: dict[str, float],
) -> Iterator[RolloutEngine]:
    """Hand the devices to ``rollout`` with the actor's current weights for the ``with`` body.

    Args:
        rollout: the rollout engine (``VLLMRollout``, ``HFRollout``).
        weights: returns a fresh ``(name, full tensor)`` stream of the actor's parameters, e.g.
            ``lambda: iter_full_parameters(actor.module)``; consumed once (a collective).
        trainer_engines: the DeepSpeed engines sharing the devices (actor, critic, reference).
        metrics: filled with ``timing_s/release_memory``, ``timing_s/update_weights``,
            ``timing_s/wake``, ``timing_s/gen`` (the body), ``timing_s/sleep``, and on CUDA ``rollout/free_mem_before_sleep_gib``,
            ``rollout/free_mem_after_sleep_gib`` and ``rollout/sleep_freed_gib``.
    Yields:
        ``rollout``, awake, holding the actor's weights. Collective: every rank enters it.
    """
    start = time.perf_counter()
    offloaded = [engine for engine in trainer_engines if keeps_states_on_device(engine)]
    for engine in offloaded:
        engine.offload_states()
    for engine in trainer_engines:
        engine.empty_partition_cache()  # includes a gc.collect(): ~0.4 s per call on the CPU quickstart
    get_accelerator().empty_cache()
    metrics["timing_s/release_memory"] = time.perf_counter() - start

    start = time.perf_counter()
    rollout.wake_up(["weights"])
    wake = time.perf_counter() - start
    start = time.perf_counter()
    rollout.update_weights(weights())
    metrics["timing_s/update_weights"] = time.perf_counter() - start
    start = time.perf_counter()
    rollout.wake_up(["kv_cache"])
    metrics["timing_s/wake"] = wake + time.perf_counter() - start

    start = time.perf_counter()
    yield rollout
    metrics["timing_s/gen"] = time.perf_counter() - start

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
