"""``actor_rollout_ref.model.shared_prompt_forward``: each distinct prompt of a micro-batch runs once and its
responses run on its KV cache. The same function of the parameters as one forward over every row: equal
log-probs and gradients to float rounding (the engines under ZeRO-3: tests/engines/test_engines.py)."""

from __future__ import annotations

import pytest
import torch

from dsrl import config as C
from dsrl.data.batch import Batch
from dsrl.engines.forward import policy_logits
from tests.conftest import QUICKSTART


def group_batch(seed: int = 0) -> Batch:
    """3 prompts (one left-padded, one of a single token) x 4 responses of varied lengths, one with a
    mask hole; rows of a prompt are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    P, T = 6, 5
    prompt_len = torch.tensor([6, 3, 1])
    prompts = torch.randint(3, 100, (3, P), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    rows = torch.tensor([0, 1, 2, 0, 1, 2, 2, 0, 1, 0, 2, 1])
    response_len = torch.randint(1, T + 1, (len(rows),), generator=g)
    response_mask = (torch.arange(T) < response_len[:, None]).long()
    response_mask[3, 1] = 0
    return Batch(
        prompt_ids=(prompts * prompt_mask)[rows],
        prompt_mask=prompt_mask[rows],
        response_ids=torch.randint(3, 100, (len(rows), T), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=rows,
    )


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
