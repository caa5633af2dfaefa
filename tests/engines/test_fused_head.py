"""The fused log-prob head (``use_fused_kernels``): log-probs, entropy and sum_pi_squared computed from the final
hidden states chunk by chunk equal those of the full logits, values and gradients, for every forward layout, tied
and untied output layers, the wide model and LoRA; models whose logits are more than the projection are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dsrl.engines.forward import PassTally, compute_response_stats, fused_head_for, policy_stats
from dsrl.engines.packing import Packing
from tests.helpers.engines import group_batch, in_context

TEMPERATURE = 0.7
LAYOUTS = {
    "padded": {},
    "shared_prompts": {"share_prompts": True},
    "packed": {"packing": Packing()},
    "dedup": {"packing": Packing(dedup=True)},
}


def built(tiny_model_dir, **overrides) -> torch.nn.Module:
    """The tiny model's architecture, randomly initialised in float32, with ``overrides`` of its config."""
    config = AutoConfig.from_pretrained(tiny_model_dir, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()


def stats_and_grads(model, batch, fused: bool, **layout):
    """Masked log-probs, entropy and sum_pi_squared, and the gradient of every trained parameter of a loss that
    weighs each token's log-prob and entropy."""
    model.zero_grad()
    stats, width = policy_stats(
        model,
        batch,
        torch.device("cpu"),
        temperature=TEMPERATURE,
        fused_head=fused_head_for(model, fused),
        tally=PassTally(),
        with_entropy=True,
        with_sum_pi_squared=True,
        entropy_grad=True,
        **layout,
    )
    mask = batch.response_mask[:, :width].float()
    weights = torch.linspace(-1, 1, mask.numel()).view(mask.shape)
    (weights * mask * (stats["log_probs"] + 0.3 * stats["entropy"])).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return {name: (value * mask).detach() for name, value in stats.items()}, grads


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tied", [True, False])
def test_fused_statistics_and_gradients_equal_the_full_logits_ones(tiny_model_dir, monkeypatch, layout, tied):
    import dsrl.engines.forward

    monkeypatch.setattr(dsrl.engines.forward, "CHUNK_ELEMENTS", 3 * 100)  # 3 positions a chunk: many chunks
    model = built(tiny_model_dir, tie_word_embeddings=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    batch = in_context(group_batch())
    full, full_grads = stats_and_grads(model, batch, False, **LAYOUTS[layout])
    fused, fused_grads = stats_and_grads(model, batch, True, **LAYOUTS[layout])
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        torch.testing.assert_close(fused[name], full[name], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grads, full_grads, atol=1e-5, rtol=1e-4)
    assert full_grads.abs().sum() > 0 and fused["sum_pi_squared"].sum() > 0
    assert "forward" not in vars(model.get_output_embeddings())  # the head computes logits again after the pass


def test_the_wide_model_and_lora_adapters_get_the_full_logits_gradients(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    wide = {"hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8}
    model = built(tiny_model_dir, num_key_value_heads=2, head_dim=128, **wide)
    batch = in_context(group_batch())
    full, full_grads = stats_and_grads(model, batch, False, **LAYOUTS["packed"])
    fused, fused_grads = stats_and_grads(model, batch, True, **LAYOUTS["packed"])
    torch.testing.assert_close(fused["log_probs"], full["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grads, full_grads, atol=1e-5, rtol=1e-4)
    lora = get_peft_model(built(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    for name, param in lora.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would leave A without a gradient
            torch.nn.init.normal_(param, std=0.1)
    full, full_grads = stats_and_grads(lora, batch, False)
    fused, fused_grads = stats_and_grads(lora, batch, True)
    torch.testing.assert_close(fused["log_probs"], full["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grads, full_grads, atol=1e-5, rtol=1e-4)
    assert len(full_grads) == sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)


def test_the_no_grad_pass_gives_the_full_logits_statistics(tiny_model_dir):
    model = built(tiny_model_dir).eval()
    batch = in_context(group_batch())
    common = {"temperature": TEMPERATURE, "micro_batch_size": 5, "max_token_len": None, "budget_key": "k"}
    common |= {"with_entropy": True, "with_sum_pi_squared": True}
    full = compute_response_stats(model, batch, **common)
    fused = compute_response_stats(model, batch, fused_head=fused_head_for(model, True), **common)
    for name, value in full.items():
        torch.testing.assert_close(fused[name], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "override, named",
    [({"final_logit_softcapping": 30.0}, "final_logit_softcapping"), ({"logits_scaling": 8.0}, "logits_scaling")],
)
def test_models_that_transform_their_logits_are_refused_with_the_reason(tiny_model_dir, override, named):
    model = built(tiny_model_dir)
    for key, value in override.items():  # as Gemma 2's and Granite's configs have them
        setattr(model.config, key, value)
    with pytest.raises(ValueError, match=rf"use_fused_kernels=true: .*{named}.*fix: set .*use_fused_kernels=false"):
        fused_head_for(model, True)
    assert fused_head_for(model, False) is None
