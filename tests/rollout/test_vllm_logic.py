"""VLLMRollout's own logic with a stand-in engine (the real vLLM: tests/vllm): which push path a vLLM
release gets, what sleeps and what may run while it does, per-prompt seeds, the process settings."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsrl.rollout import vllm as vllm_rollout
from dsrl.rollout.base import seeded
from dsrl.rollout.vllm import VLLMRollout


class NewRunner:
    """The model runner of a vLLM with layerwise reloading: its reload takes tensors."""

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        pass


class OldRunner:
    """The model runner of vLLM 0.11-0.14: ``reload_weights()`` reloads from disk."""

    def reload_weights(self):
        pass


class Worker:
    """A vLLM worker; recent ones forward ``reload_weights(*args, **kwargs)`` to the model runner."""

    def __init__(self, runner):
        self.model_runner = runner

    def reload_weights(self, *args, **kwargs):
        self.model_runner.reload_weights(*args, **kwargs)


def NewWorker():
    return Worker(NewRunner())


def OldWorker():
    return Worker(OldRunner())


def test_the_push_path_follows_the_model_runners_reload_signature():
    assert vllm_rollout._reload_takes_iterator(NewWorker())
    assert not vllm_rollout._reload_takes_iterator(OldWorker())


class FakeLLM:
    """Records what the rollout asks of ``vllm.LLM``; runs the worker functions that need no vLLM on ``worker``."""

    RUNS = (vllm_rollout._reload_takes_iterator, vllm_rollout._load_weights)

    def __init__(self, worker):
        self.worker, self.calls = worker, []

    def collective_rpc(self, method, args=(), kwargs=None):
        if callable(method):
            self.calls.append(method.__name__)
            return [method(self.worker, *args) if method in self.RUNS else None]
        self.calls.append(f"{method}({', '.join(sorted(kwargs or {}))})")
        list(kwargs["weights_iterator"])  # consumed, as vLLM's loader does
        return [None]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags):
        self.calls.append(f"wake_up({tags})")


class LoadingModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded = [name for name, _ in weights]


def rollout(worker, *, sleep_mode=False, sleep_level=2, per_prompt_seeds=False):
    """A VLLMRollout around a stand-in engine, as the constructor leaves it."""
    engine = object.__new__(VLLMRollout)
    engine.llm = FakeLLM(worker)
    engine.reload_in_place = all(engine.llm.collective_rpc(vllm_rollout._reload_takes_iterator))
    engine.llm.calls.clear()
    engine.sleep_mode, engine.sleep_level, engine.per_prompt_seeds = sleep_mode, sleep_level, per_prompt_seeds
    engine.asleep, engine.weights_valid, engine.tp_group = set(), True, None
    engine.adapters, engine.lora_request = None, None  # full-weight pushes
    return engine


def test_new_vllm_reloads_in_place_and_old_vllm_loads_through_the_model():
    new = rollout(NewWorker())
    new.update_weights([("w", torch.zeros(1))])
    assert new.llm.calls == [
        "reload_weights(is_checkpoint_format, weights_iterator)",
        "_refresh_shared_weight_layers",
        "_repack_cpu_experts",  # after an in-place reload only (tests/vllm/test_vllm_training.py: a MoE on vLLM)
        "reset_prefix_cache",
    ]
    model = LoadingModel()
    old_worker = OldWorker()
    old_worker.model_runner.get_model = lambda: model
    old = rollout(old_worker)
    old.update_weights(iter([("a", torch.zeros(1)), ("b", torch.ones(1))]))
    assert old.llm.calls == ["_load_weights", "_refresh_shared_weight_layers", "reset_prefix_cache"]
    assert model.loaded == ["a", "b"]


def test_what_sleeps_cannot_be_used():
    engine = rollout(NewWorker(), sleep_mode=True)
    prompt = torch.tensor([[5, 6]])
    engine.sleep()
    assert engine.asleep == {"weights", "kv_cache"} and not engine.weights_valid
    with pytest.raises(RuntimeError, match="update_weights while the weights sleep"):
        engine.update_weights([])
    with pytest.raises(RuntimeError, match=r"generate while \['kv_cache', 'weights'\] sleep"):
        engine.generate(prompt, torch.ones_like(prompt), vllm_rollout.SamplingParams())
    engine.wake_up(["weights"])
    engine.update_weights([])
    with pytest.raises(RuntimeError, match=r"generate while \['kv_cache'\] sleep"):
        engine.generate(prompt, torch.ones_like(prompt), vllm_rollout.SamplingParams())
    engine.wake_up(["kv_cache"])
    assert engine.asleep == set() and engine.weights_valid
    engine.sleep()
    engine.wake_up()
    assert engine.asleep == set()
    assert engine.llm.calls[-2:] == ["sleep(2)", "wake_up(None)"]
    assert not engine.static_memory


def test_without_sleep_mode_nothing_sleeps_and_the_memory_is_static():
    engine = rollout(NewWorker())
    engine.sleep()
    engine.wake_up(["weights"])
    assert engine.llm.calls == [] and engine.asleep == set() and engine.static_memory


def test_requests_carry_seeds_only_with_per_prompt_seeds():
    prompts = [[1, 2], [3], [4, 5, 6]]
    _, seeds, caps, mine, call_seed = rollout(NewWorker())._group_requests(prompts, seed=7, max_tokens=[4, 2, 3])
    assert seeds == [None, None, None] and mine == slice(0, 3) and call_seed == 7  # the call is seeded instead
    assert caps == [4, 2, 3]  # multi-turn: each conversation's own room
    _, seeds, _, _, _ = rollout(NewWorker(), per_prompt_seeds=True)._group_requests(prompts, seed=7, max_tokens=[4] * 3)
    _, again, _, _, _ = rollout(NewWorker(), per_prompt_seeds=True)._group_requests(prompts, seed=7, max_tokens=[4] * 3)
    assert seeds == again and len(set(seeds)) == 3 and all(isinstance(s, int) for s in seeds)


def test_expandable_segments_are_refused_with_the_sleep_mode_of_vllm_before_0_24(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "max_split_size_mb:512,expandable_segments:True")
        with pytest.raises(ValueError, match=f"{name}=.*expandable_segments:True.*enable_sleep_mode=false"):
            vllm_rollout.check_allocator_for_sleep_mode("0.11.0")
        vllm_rollout.check_allocator_for_sleep_mode("0.24.0")  # switches them off around its pool itself
        vllm_rollout.check_allocator_for_sleep_mode("1.2.0rc1")
        monkeypatch.setenv(name, "max_split_size_mb:512")
        vllm_rollout.check_allocator_for_sleep_mode("0.10.2")


class LogitsModel:
    def compute_logits(self, hidden_states, sampling_metadata=None):
        return hidden_states.clone()


def test_padding_rows_of_the_vocabulary_get_no_probability():
    model = LogitsModel()
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))
    vllm_rollout._mask_padded_vocab(worker, 3)
    logits = model.compute_logits(torch.zeros(2, 5))
    assert torch.equal(logits[:, :3], torch.zeros(2, 3)) and torch.isneginf(logits[:, 3:]).all()


def test_the_engine_gets_the_rollout_keys_from_the_config():
    """``from_config`` hands every vllm key to the engine (its constructor needs vLLM; it is stood in for)."""
    from dsrl.config import load_config

    class Captured(VLLMRollout):
        def __init__(self, model_path, **kwargs):
            self.model_path, self.kwargs = model_path, kwargs

    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=some/model",
            "actor_rollout_ref.rollout.per_prompt_seeds=true",
            "actor_rollout_ref.rollout.sleep_level=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "trainer.seed=9",
            "data.max_prompt_length=100",
            "data.max_response_length=28",
        ],
    )
    engine = Captured.from_config(cfg)
    assert engine.model_path == "some/model"
    assert engine.kwargs["per_prompt_seeds"] is True and engine.kwargs["sleep_level"] == 1
    assert engine.kwargs["tensor_parallel_size"] == 2 and engine.kwargs["seed"] == 9
    assert engine.kwargs["max_model_len"] == 128 and engine.kwargs["enable_sleep_mode"] is None
    assert load_config(None, []).actor_rollout_ref.rollout.sleep_level == 2  # the default the engine then gets


def generator_draws():
    return random.random(), float(np.random.random_sample()), torch.rand(1).item()


def test_a_seeded_call_starts_every_global_generator_from_its_seed_and_restores_them():
    """python's, numpy's and torch's: vLLM's V2 model runner draws unseeded requests' seeds from numpy's,
    so the ranks of a tensor-parallel group need all of them alike, whatever each rank drew before."""
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    undisturbed = generator_draws()
    inside = []
    for rank_seed in (1, 2):  # two ranks whose generators differ before the call
        random.seed(rank_seed), np.random.seed(rank_seed), torch.manual_seed(rank_seed)
        with seeded(5, torch.device("cpu")):
            inside.append(generator_draws())
        if rank_seed == 1:
            assert generator_draws() == undisturbed  # the caller's streams go on as if nothing ran
    assert inside[0] == inside[1]
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    assert inside[0] == generator_draws()
    with seeded(None, torch.device("cpu")):
        assert generator_draws() != inside[0]
