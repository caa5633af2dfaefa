"""The memory plan's mixture-of-experts shapes (``dsrl.plan.shape``): total and active parameters of Qwen3-MoE,
Qwen2-MoE (a shared expert, dense layers) and Mixtral layouts as transformers builds them, the activations a token
keeps in a routed layer, and Qwen3-30B-A3B's published sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dsrl.plan.shape import ModelShape, PlanError, read_shape

REPO = Path(__file__).resolve().parents[2]
SMALL = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96}  # fmt: skip
LAYOUTS = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24},
    "qwen2_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40, "mlp_only_layers": [1], "decoder_sparse_step": 1},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}  # fmt: skip


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_the_parameters_are_those_transformers_builds(model_type):
    config = {"model_type": model_type, **SMALL, **LAYOUTS[model_type]}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    shape = ModelShape.from_config(config, model_type)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    assert shape.moe_layers == (3 if model_type == "qwen2_moe" else 4)
    idle = shape.moe_layers * (shape.experts - 2) * 3 * 64 * shape.expert_intermediate
    assert shape.active_parameters() == shape.parameters() - idle


def test_qwen3_30b_a3b_has_its_published_sizes():
    shape = read_shape("unused", str(REPO / "bench" / "model_shapes" / "Qwen3-30B-A3B.json"))
    assert round(shape.parameters() / 1e9, 1) == 30.5 and round(shape.active_parameters() / 1e9, 1) == 3.4


def test_a_routed_layer_keeps_each_chosen_experts_activations(moe_model_dir):
    """Autograd's saved tensors of a forward of the tiny MoE, each storage once, against the plan's bytes per token
    and layer (the embedding, final norm and head spread over the layers): within 15%."""
    model = AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32).train()
    tokens, storages = 512, {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=torch.randint(3, 100, (1, tokens)), use_cache=False)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(size for pointer, size in storages.items() if pointer not in weights)
    shape = read_shape(str(moe_model_dir))
    planned = shape.layer_activation_bytes(4) * shape.layers * tokens
    assert abs(planned / saved - 1) < 0.15, (planned, saved)


def test_experts_the_plan_cannot_lay_out_are_refused_with_the_keys_it_reads(tmp_path):
    deepseek = {"model_type": "deepseek_v3", **SMALL, "n_routed_experts": 64, "num_experts_per_tok": 6}
    (tmp_path / "config.json").write_text(json.dumps(deepseek))
    with pytest.raises(PlanError, match=r"\(n_routed_experts\) the memory plan cannot lay out: it reads num_experts"):
        read_shape("unused", str(tmp_path / "config.json"))
