"""A mixture of experts' routers (``dsrl.engines.routers``): the recorded forward's load-balancing loss is the one
transformers computes for ``output_router_logits=True`` (with a padding mask, and without one as for packed rows),
its gradient reaches every router, the imbalance is the busiest expert's share over the mean, the backward's
recompute records nothing, and a dense model has no routers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.engines.routers import RouterRecord


@pytest.fixture
def moe(moe_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32)


@pytest.mark.parametrize("padded", [True, False])
def test_the_aux_loss_is_transformers_own(moe, padded):
    record = RouterRecord(moe)
    ids = torch.randint(3, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :5] = 0
    inputs = {"input_ids": ids, "attention_mask": mask if padded else None, "use_cache": False}
    with record.recording():
        moe(**inputs)
    assert len(record.logits) == moe.config.num_hidden_layers and (record.mask is not None) == padded
    expected = moe(**inputs, output_router_logits=True).aux_loss
    aux = record.aux_loss()
    torch.testing.assert_close(aux, expected, rtol=1e-6, atol=0)
    aux.backward()
    for layer in moe.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0


def test_the_imbalance_is_the_busiest_experts_share_over_the_mean(moe):
    record = RouterRecord(moe)
    record.chosen = [torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]]), torch.arange(8).view(4, 2)]  # 2 layers
    record.mask = None
    # layer 0: expert 0 takes 3 of 8 choices over 8 experts (mean 1): 3; layer 1: every expert once: 1
    assert record.imbalance().item() == pytest.approx(2.0)
    record.mask = torch.tensor([[1, 1, 0, 0]])  # the last two positions are padding
    # layer 0: experts 0, 1, 0, 2 chosen, 0 twice: 2 / 0.5 = 4; layer 1: experts 0-3 once: 1 / 0.5 = 2
    assert record.imbalance().item() == pytest.approx(3.0)


def test_a_checkpointed_recompute_in_backward_records_nothing(moe):
    moe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moe.train()
    record = RouterRecord(moe)
    with record.recording():
        out = moe(input_ids=torch.randint(3, 100, (1, 10)), use_cache=False)
    recorded = len(record.logits)
    (out.logits.sum() + record.aux_loss()).backward()
    assert recorded == len(record.logits) == moe.config.num_hidden_layers


def test_a_dense_model_has_no_routers(tiny_model_dir):
    assert RouterRecord(AutoModelForCausalLM.from_pretrained(tiny_model_dir)).routers == []
