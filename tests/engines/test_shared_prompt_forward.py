"""``actor_rollout_ref.model.shared_prompt_forward``: each distinct prompt of a micro-batch runs once and its
responses run on its KV cache. The same function of the parameters as one forward over every row: equal
log-probs and gradients to float rounding (the engines under ZeRO-3: tests/engines/test_engines.py)."""

from __future__ import annotations

import pytest
import torch

from dsrl import config as C
from dsrl.engines.forward import policy_logits
from tests.conftest import QUICKSTART
from tests.helpers.engines import group_batch


@pytest.mark.parametrize("train", [True, False])
def test_shared_prompts_give_the_same_log_probs_and_gradients(tiny_model_dir, train):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train(train)
    batch = group_batch()
    results = {}
    for share in (False, True):
        model.zero_grad()
        logits, width = policy_logits(model, batch, torch.device("cpu"), share_prompts=share)
        log_probs = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[:, :width, None])[..., 0]
        mask = batch.response_mask[:, :width].float()
        (log_probs * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[share] = (log_probs * mask).detach(), grads
    (single, single_grad), (shared, shared_grad) = results[False], results[True]
    assert single.shape == shared.shape == (12, 5)
    torch.testing.assert_close(shared, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared_grad, single_grad, atol=1e-5, rtol=1e-4)
    assert single_grad.abs().sum() > 0


def test_shared_prompts_need_gradient_checkpointing_off():
    overrides = [
        "actor_rollout_ref.model.shared_prompt_forward=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ]
    with pytest.raises(C.ConfigError) as err:
        C.load_and_validate(QUICKSTART, overrides, 1)
    [violation] = [v for v in err.value.violations if v.startswith("actor_rollout_ref.model.shared_prompt_forward=")]
    assert "gradient checkpointing" in violation and "enable_gradient_checkpointing=false" in violation
