"""The colocated generation phase with stand-in engines: which DeepSpeed engines are offloaded,
the order of the calls, and the sleep-mode metrics (the real engines: tests/vllm)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from dsrl.rollout import colocation


class Accelerator:
    def __init__(self, name, calls=None):
        self.name, self.calls = name, calls if calls is not None else []

    def device_name(self):
        return self.name

    def empty_cache(self):
        self.calls.append("empty_cache")


def engine(name, calls, *, param_offload=None, optimizer="zero"):
    """A stand-in DeepSpeed engine recording offload/reload/empty_partition_cache."""
    optim = {
        "zero": SimpleNamespace(offload_states=None),
        "inference": object.__new__(DeepSpeedZeRoOffload),
        "none": None,
    }[optimizer]
    offload = None if param_offload is None else SimpleNamespace(device=OffloadDeviceEnum(param_offload))
    return SimpleNamespace(
        name=name,
        optimizer=optim,
        zero_offload_param=lambda: offload,
        offload_states=lambda: calls.append(f"{name}.offload_states"),
        reload_states=lambda: calls.append(f"{name}.reload_states"),
        empty_partition_cache=lambda: calls.append(f"{name}.empty_partition_cache"),
    )


class Rollout:
    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")

    def update_weights(self, named_tensors):
        self.calls.append(f"update_weights({[name for name, _ in named_tensors]})")

    def sleep(self):
        self.calls.append("sleep")


def test_only_engines_with_states_on_a_device_are_offloaded(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda"))
    assert colocation.keeps_states_on_device(engine("zero3", calls))
    assert colocation.keeps_states_on_device(engine("zero3", calls, param_offload="none"))
    assert not colocation.keeps_states_on_device(engine("offloaded", calls, param_offload="cpu"))
    assert not colocation.keeps_states_on_device(engine("reference", calls, optimizer="inference"))
    assert not colocation.keeps_states_on_device(engine("no optimizer", calls, optimizer="none"))
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cpu"))
    assert not colocation.keeps_states_on_device(engine("zero3", calls))


def test_the_phase_order_and_its_metrics(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    free = iter([10.0, 30.0])  # GiB free before and after the rollout sleeps
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: next(free))
    actor, ref = engine("actor", calls), engine("ref", calls, param_offload="cpu")
    metrics = {}
    with colocation.colocated_generation(
        Rollout(calls), weights=lambda: iter([("w", None)]), trainer_engines=[actor, ref], metrics=metrics
    ):
        calls.append("generate")
    assert calls == [
        "actor.offload_states",
        "actor.empty_partition_cache",
        "ref.empty_partition_cache",
        "empty_cache",
        "wake_up(['weights'])",
        "update_weights(['w'])",
        "wake_up(['kv_cache'])",
        "generate",
        "sleep",
        "actor.reload_states",
    ]
    assert metrics["rollout/sleep_freed_gib"] == 20.0 and metrics["rollout/free_mem_after_sleep_gib"] == 30.0
    timings = {"timing_s/release_memory", "timing_s/update_weights", "timing_s/wake", "timing_s/gen", "timing_s/sleep"}
    assert timings <= metrics.keys()


def test_a_failing_generation_leaves_the_engines_where_they_are(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    phase = colocation.colocated_generation(
        Rollout(calls), weights=lambda: iter([]), trainer_engines=[engine("actor", calls)], metrics={}
    )
    with pytest.raises(RuntimeError, match="boom"), phase:
        raise RuntimeError("boom")
    assert "sleep" not in calls and "actor.reload_states" not in calls  # no collective cleanup after an error
