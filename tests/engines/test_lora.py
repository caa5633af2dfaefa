"""``dsrl.engines.lora.add_adapters`` on a plain model: each LoRA key does what its help says (which layers get
adapters, their rank and scaling), and targets dsrl cannot train are refused naming the key."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from dsrl.engines.lora import add_adapters, lora_layers

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def model_cfg(**overrides):
    keys = {
        "lora_rank": 4,
        "lora_alpha": 16,
        "target_modules": "all-linear",
        "exclude_modules": None,
        "lora_adapter_path": None,
    }
    return OmegaConf.create({**keys, **overrides})


def adapted(tiny_model_dir, **overrides):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return add_adapters(model, model_cfg(**overrides))


def test_rank_alpha_targets_and_exclusions_shape_the_adapters(tiny_model_dir):
    layers = lora_layers(adapted(tiny_model_dir, lora_rank=4, lora_alpha=16))
    assert {name.rpartition(".")[2] for name in layers} == LINEAR  # all-linear: every linear layer but lm_head
    assert all(layer.r["default"] == 4 and layer.scaling["default"] == 16 / 4 for layer in layers.values())
    layers = lora_layers(adapted(tiny_model_dir, lora_rank=2, lora_alpha=8, exclude_modules=["down_proj", "o_proj"]))
    assert {name.rpartition(".")[2] for name in layers} == LINEAR - {"down_proj", "o_proj"}
    assert all(layer.scaling["default"] == 4.0 for layer in layers.values())
    model = adapted(tiny_model_dir, target_modules=["q_proj", "v_proj"])
    assert {name.rpartition(".")[2] for name in lora_layers(model)} == {"q_proj", "v_proj"}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)  # the base is frozen


def test_targets_dsrl_cannot_train_are_refused_naming_the_key(tiny_model_dir):
    with pytest.raises(ValueError, match=r"target_modules adapts .*embed_tokens.*not linear layers"):
        adapted(tiny_model_dir, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"target_modules=.*matched no module"):
        adapted(tiny_model_dir, target_modules=["q_proj"], exclude_modules=["q_proj"])
