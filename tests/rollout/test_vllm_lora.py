"""The LoRA adapters as the vLLM rollout reads them (dsrl.rollout.vllm_lora), without vLLM: the rank vLLM is
built for, the settings written, and the directory a push writes, read back by PEFT itself."""

from __future__ import annotations

import gc
import os
import types
from typing import Literal

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from dsrl.engines.lora import iter_adapter_parameters, lora_config, saved_adapter_tensors
from dsrl.rollout.vllm_lora import AdapterDirectory, actor_adapter_config, vllm_lora_ranks, vllm_max_lora_rank

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks in vLLM 0.32


def model_cfg(**overrides):
    keys = {
        "lora_rank": 4,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "exclude_modules": None,
        "lora_adapter_path": None,
    }
    return OmegaConf.create({**keys, **overrides})


@pytest.mark.parametrize("rank, built", [(1, 1), (2, 8), (8, 8), (9, 16), (257, 320), (512, 512)])
def test_the_engine_is_built_for_the_smallest_allowed_rank_that_holds_the_adapters(rank, built):
    assert vllm_max_lora_rank(rank, VLLM_RANKS) == built


def test_the_allowed_ranks_come_from_the_installed_vllm_or_its_floors_tuple():
    """vLLM 0.10.2 has no ``vllm.config.lora.MaxLoRARanks`` (review G3): its ranks are then 0.10.2's own tuple."""
    floor = types.ModuleType("vllm.config.lora")  # 0.10.2's module: LoRAConfig, no MaxLoRARanks
    newer = types.ModuleType("vllm.config.lora")
    newer.MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]  # 0.33's
    assert vllm_lora_ranks(floor) == (8, 16, 32, 64, 128, 256, 320, 512)
    assert vllm_lora_ranks(newer) == VLLM_RANKS
    assert vllm_max_lora_rank(1, vllm_lora_ranks(floor)) == 8
    assert vllm_max_lora_rank(1, vllm_lora_ranks(newer)) == 1


def test_a_rank_beyond_vllm_is_refused_naming_the_key():
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref.model.lora_rank=600: vLLM serves LoRA ranks up to 512; "
        r"use a rank of at most 512, or actor_rollout_ref.model.lora.merge=true",
    ):
        vllm_max_lora_rank(600, VLLM_RANKS)


def test_peft_saved_names_leave_out_the_adapter_name():
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    [(saved, tensor)] = saved_adapter_tensors([(name, torch.ones(2, 3).t())]).items()
    assert saved == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert tensor.is_contiguous() and tensor.device.type == "cpu"


@pytest.fixture
def peft_model(tiny_model_dir):
    """The tiny model with rank-4 adapters on q and v, lora_B random (PEFT starts it at zero)."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), lora_config(model_cfg())
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator))
    return model


def test_the_settings_are_the_run_s_or_the_saved_adapter_s(peft_model, tmp_path):
    assert (actor_adapter_config(model_cfg()).r, actor_adapter_config(model_cfg()).lora_alpha) == (4, 16)
    peft_model.save_pretrained(tmp_path)
    saved = actor_adapter_config(model_cfg(lora_rank=0, lora_alpha=99, lora_adapter_path=str(tmp_path)))
    assert (saved.r, saved.lora_alpha, sorted(saved.target_modules)) == (4, 16, ["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="lora_adapter_path=.*adapter_config.json cannot be read"):
        actor_adapter_config(model_cfg(lora_adapter_path=str(tmp_path / "missing")))


def test_a_push_is_a_peft_adapter_directory(peft_model, tiny_model_dir):
    """PEFT loads what a push writes onto a fresh base model and gets the actor's adapters back."""
    directory = AdapterDirectory(actor_adapter_config(model_cfg()))
    assert directory.write(iter_adapter_parameters(peft_model)) == 1
    assert directory.write(iter_adapter_parameters(peft_model)) == 2  # each push is numbered: vLLM's adapter id
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, directory.path)
    pushed = dict(iter_adapter_parameters(peft_model))
    read = dict(iter_adapter_parameters(loaded))
    assert pushed.keys() == read.keys() and len(pushed) == 16  # 4 layers x (q, v) x (A, B)
    for name, tensor in pushed.items():
        torch.testing.assert_close(read[name], tensor, rtol=0, atol=0)
    assert loaded.peft_config["default"].lora_alpha == 16
    path = directory.path
    del directory
    gc.collect()
    assert not os.path.exists(path)  # the temporary directory goes with the rollout


def test_a_push_of_other_tensors_is_refused(peft_model):
    directory = AdapterDirectory(actor_adapter_config(model_cfg()))
    full = list(peft_model.named_parameters())[:2]
    with pytest.raises(
        ValueError, match=r"expected adapter tensors \(lora_A, lora_B\), got \['base_model.model.model.embed"
    ):
        directory.write(full)
    with pytest.raises(ValueError, match="got none"):
        directory.write([])
