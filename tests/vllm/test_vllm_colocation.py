"""The order of one colocated generation phase, recorded on the real vLLM engine and a real
ZeRO-3 DeepSpeed engine.

An order check, not a memory test: on CPU vLLM has no sleep mode and DeepSpeed's engines keep
nothing on a device, so the LLM's ``sleep`` / ``wake_up`` and the engine's ``offload_states`` /
``reload_states`` are recorded here without being executed (everything else runs for real). The
memory itself is measured by ``scripts/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

from dsrl.engines.weight_sync import iter_full_parameters
from dsrl.rollout import SamplingParams, colocation

pytestmark = pytest.mark.vllm

NOT_ON_CPU = ("sleep", "wake_up")  # recorded, not executed: the CPU build has no sleep mode


def describe(name, args, kwargs) -> str:
    """``llm.collective_rpc(reload_weights)``, ``llm.wake_up(['weights'])``, ``llm.sleep(level=1)``,
    ``llm.generate``."""
    if name == "collective_rpc":
        return f"llm.collective_rpc({getattr(args[0], '__name__', args[0])})"
    if name == "wake_up":
        return f"llm.wake_up({args[0] if args else kwargs.get('tags')})"
    if name == "sleep":
        return f"llm.sleep(level={kwargs['level'] if 'level' in kwargs else args[0]})"
    return f"llm.{name}"


class RecordingLLM:
    """Forwards to the real ``vllm.LLM`` and records each call in ``calls``."""

    def __init__(self, llm, calls):
        self._llm, self._calls = llm, calls

    def __getattr__(self, name):
        method = getattr(self._llm, name)

        def record(*args, **kwargs):
            self._calls.append(describe(name, args, kwargs))
            return None if name in NOT_ON_CPU else method(*args, **kwargs)

        return record


@pytest.fixture(scope="module")
def actor(world_of_one, make_cfg, ds_test_config, vllm_rollout):
    from dsrl.engines import ActorEngine

    return ActorEngine(make_cfg(f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}"))


@pytest.fixture
def recorded(vllm_rollout, actor, monkeypatch):
    """Every call of the phase in order; the engine in sleep mode (recorded), the accelerator a device
    and the actor treated as holding device states (recorded)."""
    calls: list[str] = []
    monkeypatch.setattr(vllm_rollout, "llm", RecordingLLM(vllm_rollout.llm, calls))
    monkeypatch.setattr(vllm_rollout, "sleep_mode", True)
    monkeypatch.setattr(vllm_rollout, "asleep", set())  # restored after the test: the engine never slept
    monkeypatch.setattr(vllm_rollout, "weights_valid", True)
    monkeypatch.setattr(colocation, "get_accelerator", lambda: FakeDevice(get_accelerator(), calls))
    monkeypatch.setattr(colocation, "_free_device_memory", lambda: None)
    grads = [OffloadStateTypeEnum.lp_grads]
    monkeypatch.setattr(colocation, "offload_targets", lambda engine: grads if engine is actor.engine else [])
    engine = actor.engine
    for name in ("offload_states", "reload_states"):
        monkeypatch.setattr(engine, name, lambda *a, _n=name, **k: calls.append(f"actor.{_n}"))
    partition_cache = engine.empty_partition_cache
    monkeypatch.setattr(
        engine, "empty_partition_cache", lambda: (calls.append("actor.empty_partition_cache"), partition_cache())
    )
    return calls


class FakeDevice:
    """The accelerator as colocation sees it: a device (so the actor counts as holding device states and
    the allocator cache is emptied), recording ``empty_cache``; everything else is the real one."""

    def __init__(self, accelerator, calls):
        self._accelerator, self._calls = accelerator, calls

    def device_name(self):
        return "cuda"

    def empty_cache(self):
        self._calls.append("empty_cache")
        self._accelerator.empty_cache()

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def test_one_generation_phase_runs_in_the_design_order(vllm_rollout, actor, recorded):
    metrics: dict[str, float] = {}
    prompt = torch.tensor([[5, 6, 7, 8]])
    with colocation.colocated_generation(
        vllm_rollout,
        weights=lambda: iter_full_parameters(actor.module),
        trainer_engines={"actor": actor.engine},
        metrics=metrics,
    ) as rollout:
        recorded.append("body")
        out = rollout.generate(prompt, torch.ones_like(prompt), SamplingParams(n=2, max_tokens=4, seed=0))
    assert recorded == [
        "actor.offload_states",
        "actor.empty_partition_cache",
        "empty_cache",
        "llm.wake_up(['weights'])",
        "llm.collective_rpc(reload_weights)",
        "llm.collective_rpc(_refresh_shared_weight_layers)",
        "llm.collective_rpc(_repack_cpu_experts)",  # a no-op for this dense model
        "llm.reset_prefix_cache",
        "empty_cache",  # the push's buffers, before the KV cache is mapped
        "llm.wake_up(['kv_cache'])",
        "body",
        "llm.generate",
        "llm.sleep(level=2)",
        "actor.reload_states",
    ]
    assert out.response_ids.shape == (2, 4)
    assert {
        "timing_s/release_memory",
        "timing_s/update_weights",
        "timing_s/wake",
        "timing_s/gen",
        "timing_s/sleep",
    } <= set(metrics)
    assert all(v >= 0 for v in metrics.values())


def test_the_engine_refuses_to_push_or_generate_while_asleep(vllm_rollout, actor, recorded):
    """Level 2 (the default): weights and KV cache are dropped; the push needs the weights awake, generation
    needs both awake and the weights pushed again."""
    prompt = torch.tensor([[5, 6, 7, 8]])
    sampling = SamplingParams(max_tokens=4, seed=0)
    vllm_rollout.sleep()
    assert recorded[-1] == "llm.sleep(level=2)"
    with pytest.raises(RuntimeError, match=r"while \['kv_cache', 'weights'\] sleep"):
        vllm_rollout.generate(prompt, torch.ones_like(prompt), sampling)
    with pytest.raises(RuntimeError, match="update_weights while the weights sleep"):
        vllm_rollout.update_weights(iter([]))
    vllm_rollout.wake_up(["weights"])
    with pytest.raises(RuntimeError, match=r"while \['kv_cache'\] sleep"):
        vllm_rollout.generate(prompt, torch.ones_like(prompt), sampling)
    vllm_rollout.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        vllm_rollout.generate(prompt, torch.ones_like(prompt), sampling)
    vllm_rollout.update_weights(iter_full_parameters(actor.module))
    vllm_rollout.generate(prompt, torch.ones_like(prompt), sampling)


def test_after_a_level_1_sleep_the_weights_need_no_push(vllm_rollout, actor, recorded, monkeypatch):
    monkeypatch.setattr(vllm_rollout, "sleep_level", 1)
    prompt = torch.tensor([[5, 6, 7, 8]])
    vllm_rollout.sleep()
    vllm_rollout.wake_up()
    vllm_rollout.generate(prompt, torch.ones_like(prompt), SamplingParams(max_tokens=4, seed=0))
    assert recorded[-3:] == ["llm.sleep(level=1)", "llm.wake_up(None)", "llm.generate"]
