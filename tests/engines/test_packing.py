"""``dsrl.engines.packing``: a micro-batch packed without padding gives the padded forward's response logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.config.files import packing_problem
from dsrl.engines.forward import model_inputs, response_logits
from dsrl.engines.packing import pack, packed_response_logits
from tests.helpers.engines import context_batch


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def log_probs(logits, batch, width):
    return torch.log_softmax(logits, -1).gather(-1, batch.response_ids[:, :width, None])[..., 0]


@pytest.mark.parametrize("row_tokens", [None, 10_000])  # rows as long as the longest sequence; one row
def test_packed_response_log_probs_equal_the_padded_ones(model, row_tokens):
    batch = context_batch()
    with torch.no_grad():
        inputs, width = model_inputs(batch, torch.device("cpu"))
        padded = log_probs(response_logits(model, inputs, width), batch, width)
        packed_logits, packed_width = packed_response_logits(model, batch, torch.device("cpu"), row_tokens=row_tokens)
    assert packed_width == width
    packed = log_probs(packed_logits, batch, width)
    mask = batch.response_mask[:, :width].bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=1e-5)


def test_packing_keeps_every_context_token_and_no_padding():
    batch = context_batch()
    packed = pack(batch)
    real = int(batch.prompt_mask.sum() + batch.response_attention.sum())
    assert packed.tokens == real
    longest = int((batch.prompt_mask.sum(1) + batch.response_attention.sum(1)).max())
    assert packed.input_ids.shape[1] == longest  # rows no longer than the longest sequence
    assert packed.input_ids.numel() < batch.input_ids.numel()


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"model_type": "qwen3", "layer_types": ["full_attention"] * 2}, None),
        ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ({"model_type": "qwen2_5_vl", "rope_scaling": {"mrope_section": [16, 24, 24]}}, "mrope"),
        ({"model_type": "x_vl", "text_config": {"model_type": "x"}, "vision_config": {}}, "vision-language"),
    ],
)
def test_models_that_cannot_run_packed_rows_are_named_with_the_reason(config, reason):
    problem = packing_problem(config)
    assert problem is None if reason is None else reason in problem


def test_packing_is_refused_at_validation_for_such_a_local_model(tiny_model_dir, tmp_path):
    import json
    import shutil

    from tests.helpers.config import problems

    model = tmp_path / "linear"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_types": ["linear_attention", "full_attention"]}))
    packing = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.shared_prompt_forward=false"]
    (problem,) = [p for p in problems([f"actor_rollout_ref.model.path={model}", *packing]) if "use_remove_padding" in p]
    assert "linear_attention carry a state along a packed row" in problem
    assert problem.endswith("fix: set actor_rollout_ref.model.use_remove_padding=false")
