"""The colocated generation phase with stand-in engines: which DeepSpeed engines are offloaded,
the order of the calls, and the sleep-mode metrics (the real engines: tests/vllm)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.ops.adam import FusedAdam
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


def engine(
    name, calls, *, stage=3, param_offload=None, optimizer_offload=None, optimizer="zero", inner=FusedAdam, frozen=False
):
    """A stand-in DeepSpeed engine recording offload/reload/empty_partition_cache; ``frozen``: a module with a
    frozen parameter beside the trained one (LoRA)."""
    optim = {
        "zero": SimpleNamespace(offload_states=None, optimizer=object.__new__(inner)),
        "inference": object.__new__(DeepSpeedZeRoOffload),
        "none": None,
    }[optimizer]

    def offload(device):
        return None if device is None else SimpleNamespace(device=OffloadDeviceEnum(device))

    module = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    module[0].requires_grad_(not frozen)
    return SimpleNamespace(
        name=name,
        module=module,
        optimizer=optim,
        zero_optimization_stage=lambda: stage,
        zero_offload_param=lambda: offload(param_offload),
        zero_offload_optimizer=lambda: offload(optimizer_offload),
        offload_states=lambda include: calls.append(f"{name}.offload_states({sorted(t.value for t in include)})"),
        reload_states=lambda: calls.append(f"{name}.reload_states"),
        empty_partition_cache=lambda: calls.append(f"{name}.empty_partition_cache"),
    )


class Rollout:
    static_memory = False

    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")

    def update_weights(self, named_tensors):
        self.calls.append(f"update_weights({[name for name, _ in named_tensors]})")

    def sleep(self):
        self.calls.append("sleep")


def targets(engine):
    return sorted(t.value for t in colocation.offload_targets(engine))


@pytest.fixture(autouse=True)
def state_bytes(monkeypatch):
    """The stand-in engines hold no DeepSpeed tensors: each offload target counts as 1 GiB (the real count:
    tests/rollout/test_colocation_swap.py)."""
    monkeypatch.setattr(colocation, "offloaded_bytes", lambda engine, targets: len(targets) * 2**30)


GRADS = ["contiguous_grad_buffer", "lp_grads"]
OPTIMIZER = ["hp_params", "optim_states"]


def test_what_is_offloaded_depends_on_where_each_state_lives(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda"))
    assert targets(engine("zero3", calls)) == sorted(GRADS + OPTIMIZER + ["lp_params"])
    assert targets(engine("zero3", calls, param_offload="none")) == sorted(GRADS + OPTIMIZER + ["lp_params"])
    # ZeRO-1/2: the bf16 weights are the full model the push reads; they stay on the device.
    assert targets(engine("zero2", calls, stage=2)) == sorted(GRADS + OPTIMIZER)
    # Optimizer states already in CPU memory stay where they are; the rest still moves.
    assert targets(engine("zero3", calls, optimizer_offload="cpu")) == sorted(GRADS + ["lp_params"])
    assert targets(engine("zero2", calls, stage=2, optimizer_offload="cpu")) == GRADS
    # ZeRO-3 moves optimizer states only for FusedAdam (DeepSpeed asserts so); torch's AdamW keeps them.
    assert targets(engine("torch adam", calls, inner=torch.optim.AdamW)) == sorted(GRADS + ["lp_params"])
    assert targets(engine("zero2 torch adam", calls, stage=2, inner=torch.optim.AdamW)) == sorted(GRADS + OPTIMIZER)
    # A frozen base (LoRA) keeps ZeRO-3's partition on the device: DeepSpeed would map it into the trained buffer.
    assert targets(engine("lora", calls, frozen=True)) == sorted(GRADS + OPTIMIZER)
    assert targets(engine("zero2 lora", calls, stage=2, frozen=True)) == sorted(GRADS + OPTIMIZER)
    assert targets(engine("offloaded", calls, param_offload="cpu")) == []
    assert targets(engine("reference", calls, optimizer="inference")) == []
    assert targets(engine("no optimizer", calls, optimizer="none")) == []
    # Where the engine lives does not matter: on a CPU colocated_generation decides whether to offload at all.
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cpu"))
    assert targets(engine("zero3", calls)) == sorted(GRADS + OPTIMIZER + ["lp_params"])


def test_the_phase_order_and_its_metrics(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    free = iter([12.0, 10.0, 30.0])  # GiB free before the KV cache wakes, before and after the rollout sleeps
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: next(free))
    actor, ref = engine("actor", calls), engine("ref", calls, param_offload="cpu")
    metrics = {}
    with colocation.colocated_generation(
        Rollout(calls),
        weights=lambda: iter([("w", None)]),
        trainer_engines={"actor": actor, "ref": ref},
        metrics=metrics,
    ):
        calls.append("generate")
    assert calls == [
        "actor.offload_states(['contiguous_grad_buffer', 'hp_params', 'lp_grads', 'lp_params', 'optim_states'])",
        "actor.empty_partition_cache",
        "ref.empty_partition_cache",
        "empty_cache",
        "wake_up(['weights'])",
        "update_weights(['w'])",
        "empty_cache",  # the push's buffers, before the KV cache is mapped
        "wake_up(['kv_cache'])",
        "generate",
        "sleep",
        "actor.reload_states",
    ]
    assert metrics["perf/offloaded_gib/actor"] == 5.0 and metrics["perf/offloaded_gib/ref"] == 0.0
    assert metrics["rollout/free_mem_before_wake_gib"] == 12.0
    assert metrics["rollout/sleep_freed_gib"] == 20.0 and metrics["rollout/free_mem_after_sleep_gib"] == 30.0
    timings = {"timing_s/release_memory", "timing_s/update_weights", "timing_s/wake", "timing_s/gen", "timing_s/sleep"}
    assert timings <= metrics.keys()


def test_nothing_is_offloaded_for_a_rollout_whose_memory_is_reserved(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: None)
    rollout = Rollout(calls)
    rollout.static_memory = True  # vLLM without sleep mode: offloading would free nothing it can use
    with colocation.colocated_generation(
        rollout, weights=lambda: iter([]), trainer_engines={"actor": engine("actor", calls)}, metrics={}
    ):
        pass
    assert not [call for call in calls if "offload_states" in call or "reload_states" in call]


def test_a_failing_generation_still_puts_the_rollout_to_sleep_and_reloads_the_engines(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: None)
    phase = colocation.colocated_generation(
        Rollout(calls), weights=lambda: iter([]), trainer_engines={"actor": engine("actor", calls)}, metrics={}
    )
    with pytest.raises(RuntimeError, match="boom"), phase:
        raise RuntimeError("boom")
    assert calls[-2:] == ["sleep", "actor.reload_states"]  # both rank-local: no rank waits for another


def test_a_failing_push_still_reloads_the_engines(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: None)

    def broken_weights():
        raise ValueError("bad name")

    phase = colocation.colocated_generation(
        Rollout(calls), weights=broken_weights, trainer_engines={"actor": engine("actor", calls)}, metrics={}
    )
    with pytest.raises(ValueError, match="bad name"), phase:
        pytest.fail("the body must not run")
    assert "generate" not in calls and calls[-2:] == ["sleep", "actor.reload_states"]


def test_a_cpu_accelerator_releases_nothing_unless_asked_to_offload(monkeypatch):
    """On a CPU the "device" is host memory the rollout does not draw on: no partition-cache release (a
    gc.collect() per engine) and no allocator call, only the push and the rollout's own calls; the engines'
    offload and reload only with ``offload_on_cpu``."""
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cpu", calls))
    for offload_on_cpu in (False, True):
        calls.clear()
        metrics = {}
        with colocation.colocated_generation(
            Rollout(calls),
            weights=lambda: iter([("w", None)]),
            trainer_engines={"actor": engine("actor", calls)},
            metrics=metrics,
            offload_on_cpu=offload_on_cpu,
        ):
            calls.append("generate")
        phase = ["wake_up(['weights'])", "update_weights(['w'])", "wake_up(['kv_cache'])", "generate", "sleep"]
        if offload_on_cpu:  # the GPU path's offload and reload (actor_rollout_ref.rollout.offload_states_on_cpu)
            offload = f"actor.offload_states({sorted(GRADS + OPTIMIZER + ['lp_params'])})"
            phase = [offload, *phase, "actor.reload_states"]
        assert calls == phase
        assert "timing_s/release_memory" in metrics
        assert ("perf/offloaded_gib/actor" in metrics) == offload_on_cpu


def test_a_failing_offload_still_reloads_what_was_offloaded(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "get_accelerator", lambda: Accelerator("cuda", calls))
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: None)
    actor, critic = engine("actor", calls), engine("critic", calls)

    def broken_offload(include):
        raise RuntimeError("start (0) + length (65536) exceeds dimension size (2048).")

    critic.offload_states = broken_offload
    phase = colocation.colocated_generation(
        Rollout(calls), weights=lambda: iter([]), trainer_engines={"actor": actor, "critic": critic}, metrics={}
    )
    with pytest.raises(RuntimeError, match="exceeds dimension size"), phase:
        pytest.fail("the body must not run")
    # The critic too: DeepSpeed reloads whatever of its states the offload had moved before it raised.
    assert calls[1:] == ["sleep", "actor.reload_states", "critic.reload_states"]
