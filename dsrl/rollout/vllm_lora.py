"""The actor's LoRA adapters as vLLM reads them (``actor_rollout_ref.model.lora.merge=false`` with the vLLM rollout).

vLLM's public API takes an adapter as a PEFT directory: ``LoRARequest(name, id, path)``. Each push writes the
actor's adapters into a temporary directory of the rollout's own, as ``PeftModel.save_pretrained`` lays them out
(``adapter_config.json`` with the actor's settings; ``adapter_model.safetensors`` under PEFT's saved names, which
leave out the adapter's name), and numbers the push: vLLM caches adapters by id, so each push gets a new one and
is read from disk once. The base weights come from the model directory when the engine is built and are never
pushed. Imports no vLLM: the engine side lives in ``dsrl.rollout.vllm``.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, get_args

import torch
from peft import LoraConfig
from safetensors.torch import save_file

from dsrl.engines.lora import ADAPTER_FILE, lora_config, saved_adapter_config, saved_adapter_tensors

# The max_lora_rank values vLLM 0.10.2 (dsrl's floor) allows, a tuple inside LoRAConfig.__post_init__ there; later
# releases name them as vllm.config.lora.MaxLoRARanks (0.33 adds rank 1).
VLLM_0_10_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_ranks(vllm_lora_config: ModuleType) -> tuple[int, ...]:
    """The ``max_lora_rank`` values the installed vLLM allows, from its ``vllm.config.lora`` module."""
    ranks = getattr(vllm_lora_config, "MaxLoRARanks", None)
    return VLLM_0_10_LORA_RANKS if ranks is None else get_args(ranks)


def vllm_max_lora_rank(rank: int, allowed: Sequence[int]) -> int:
    """The smallest of vLLM's allowed ``max_lora_rank`` values (``allowed``) that holds adapters of ``rank``."""
    fitting = [value for value in allowed if value >= rank]
    if not fitting:
        raise ValueError(
            f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves LoRA ranks up to {max(allowed)}; "
            f"use a rank of at most {max(allowed)}, or actor_rollout_ref.model.lora.merge=true (merged weights)"
        )
    return min(fitting)


def actor_adapter_config(model_cfg: Any) -> LoraConfig:
    """The settings the actor's adapters are built with: the saved adapter's (``lora_adapter_path``) or the run's."""
    if model_cfg.lora_adapter_path is not None:
        return saved_adapter_config(model_cfg.lora_adapter_path)
    return lora_config(model_cfg)


class AdapterDirectory:
    """A temporary PEFT adapter directory that each push rewrites; removed with this object (or at exit)."""

    def __init__(self, config: LoraConfig):
        self.path = tempfile.mkdtemp(prefix="dsrl-vllm-lora-")
        weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
        config.save_pretrained(self.path)
        self.pushes = 0

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Save the adapters (the actor's names, full tensors) under PEFT's names; returns the push's number (1, 2,
        ...)."""
        tensors = saved_adapter_tensors(named_tensors)
        other = [name for name in tensors if ".lora_A." not in name and ".lora_B." not in name]
        if not tensors or other:
            raise ValueError(
                f"VLLMRollout.update_weights with LoRA adapters: expected adapter tensors (lora_A, lora_B), got "
                f"{other[:3] or 'none'}; push ActorEngine.rollout_weights() of a run with model.lora.merge=false"
            )
        save_file(tensors, str(Path(self.path) / ADAPTER_FILE))
        self.pushes += 1
        return self.pushes
