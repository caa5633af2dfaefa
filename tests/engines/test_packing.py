"""``dsrl.engines.packing``: a micro-batch packed without padding gives the padded forward's response logits, and
with each distinct prompt once (``use_prefix_grouper``) the same log-probs and gradients, gradient checkpointing
on or off."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.config.files import packing_problem
from dsrl.engines.forward import PassTally, model_inputs, policy_logits, response_logits
from dsrl.engines.packing import Packing, pack, packed_response_logits, packing_for
from tests.helpers.engines import context_batch, group_batch, in_context


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
        rows = pack(batch, row_tokens)
        packed_logits = packed_response_logits(model, rows, torch.device("cpu"))
    assert rows.width == width
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


def masked_log_probs_and_grads(model, batch, **layout):
    model.zero_grad()
    tally = PassTally()
    logits, width = policy_logits(model, batch, torch.device("cpu"), tally=tally, **layout)
    mask = batch.response_mask[:, :width].float()
    masked = log_probs(logits, batch, width) * mask
    masked.sum().backward()
    return masked.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), tally


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_copy_of_each_prompt_gives_the_padded_and_the_shared_prompt_log_probs_and_gradients(
    tiny_model_dir, checkpointing
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    batch = in_context(group_batch())  # 3 prompts x 4 responses, rows of a prompt not contiguous
    if checkpointing:  # shared_prompt_forward's KV cache cannot run under it; dedup compares with the padded rows
        model.gradient_checkpointing_enable()
    padded, padded_grad, _ = masked_log_probs_and_grads(model, batch, share_prompts=False)
    dedup, dedup_grad, tally = masked_log_probs_and_grads(
        model, batch, share_prompts=False, packing=Packing(dedup=True)
    )
    torch.testing.assert_close(dedup, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dedup_grad, padded_grad, atol=1e-5, rtol=1e-4)
    assert padded_grad.abs().sum() > 0
    if not checkpointing:
        shared, shared_grad, _ = masked_log_probs_and_grads(model, batch, share_prompts=True)
        torch.testing.assert_close(dedup, shared, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dedup_grad, shared_grad, atol=1e-5, rtol=1e-4)
    prompts = [6, 3, 1]
    responses = int(batch.response_attention.sum())
    assert tally.tokens == sum(prompts) + responses  # each prompt once
    assert tally.sequence_tokens == 4 * sum(prompts) + responses
    assert tally.micro_batches == 1


def test_a_deduplicated_row_lets_each_response_see_its_prompt_and_itself_only():
    batch = group_batch()
    packed = pack(batch, dedup=True)
    mask = packed.attention_mask[:, 0]
    # The longest unit, prompt 0 (6 tokens) and its rows 0, 3, 7, 9, fills packed row 0 and sets the row length.
    responses = batch.response_attention.sum(1).tolist()
    assert packed.input_ids.shape[1] == 6 + sum(responses[i] for i in (0, 3, 7, 9))
    assert torch.equal(packed.input_ids[0, :6], batch.prompt_ids[0])
    assert torch.equal(packed.input_ids[0, 6 : 6 + responses[0]], batch.response_ids[0, : responses[0]])
    assert mask[0, 7, :8].tolist() == [True] * 8  # row 0's second response token: the prompt, then its own two
    second = 6 + responses[0]  # where row 3's response starts
    assert mask[0, second].nonzero().flatten().tolist() == [*range(6), second]  # none of row 0's response
    assert packed.position_ids[0, second] == 6  # positions continue from the prompt, not from the response before
    assert packed.columns[3, 0] == 5  # row 3's first token is predicted by the prompt's last position, as row 0's
    assert packed.columns[0, 0] == 5


def test_one_copy_of_each_prompt_needs_packed_rows_and_sdpa_attention(tiny_model_dir):
    from dsrl import config as C
    from tests.conftest import QUICKSTART

    with pytest.raises(C.ConfigError) as err:
        unpacked = [
            "actor_rollout_ref.model.use_remove_padding=false",
            "actor_rollout_ref.actor.use_prefix_grouper=true",
        ]
        C.load_and_validate(QUICKSTART, unpacked, 1)
    [violation] = [v for v in err.value.violations if v.startswith("actor_rollout_ref.actor.use_prefix_grouper=")]
    assert violation.endswith("fix: set actor_rollout_ref.model.use_remove_padding=true")
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    packing_for(eager, "actor_rollout_ref.model.use_remove_padding")  # packing alone reads position ids
    with pytest.raises(ValueError, match="runs eager attention") as refused:
        packing_for(eager, "actor_rollout_ref.model.use_remove_padding", dedup=True)
    assert str(refused.value).endswith("fix: set actor_rollout_ref.actor.use_prefix_grouper=false")


def test_packed_rows_trade_padding_against_attention_pairs_by_the_models_cost():
    from transformers import AutoConfig

    from dsrl.engines.packing import _row_length, attention_pair_cost

    lengths = [1200, 900, 800, 700, 500]  # at 1,200 tokens a row: 4 rows, 4,800 positions for 4,100 tokens
    assert _row_length(lengths, None) == 1200  # no cost known: rows as long as the longest unit
    # Pairs free: the fewest rows within twice the longest unit (one row of 4,100 would be past it): two.
    assert 4100 / 2 <= _row_length(lengths, 0.0) <= 2 * 1200
    assert _row_length(lengths, 1.0) == 1200  # pairs dearer than positions: the shortest rows
    # A 97M model's shape (hidden 1,024, 8 heads of 128, 2 KV heads, MLP 3,072): rows longer than the longest
    # unit (less padding) but not one row (its pairs cost more than the padding it saves).
    wide = AutoConfig.for_model(
        "qwen3", hidden_size=1024, num_attention_heads=8, head_dim=128, num_key_value_heads=2, intermediate_size=3072
    )
    pair_cost = attention_pair_cost(wide)
    assert pair_cost == 2 * 1024 / (1024 * (2 * 1024 + 2 * 256) + 3 * 1024 * 3072)
    assert 1200 < _row_length(lengths, pair_cost) < 2000


def test_a_micro_batch_with_no_response_token_in_the_context_keeps_one_column(model):
    batch = context_batch()
    cut = batch.replace(response_mask=torch.zeros_like(batch.response_mask), response_attention_mask=None)
    with torch.no_grad():  # every row's response masked out, as truncated-completion masking can leave a micro-batch
        logits = packed_response_logits(model, pack(cut), torch.device("cpu"))
    assert logits.shape == (len(batch), 1, model.config.vocab_size)


def test_rows_for_sequence_shards_keep_the_packed_log_probs(model):
    """Sequence parallelism's rows: padded to a multiple of the shard count, the explicit mask (each sequence
    causal, a pad column seeing itself) given to the model in place of the position ids' packing."""
    batch = context_batch()
    plain = pack(batch)
    sharded = pack(batch, multiple=4, explicit_mask=True)
    assert sharded.input_ids.shape[1] % 4 == 0 and sharded.input_ids.shape[1] >= plain.input_ids.shape[1]
    mask = sharded.attention_mask[:, 0]
    assert mask.diagonal(dim1=-2, dim2=-1).all() and not mask.triu(1).any()
    with torch.no_grad():
        logits = {
            name: packed_response_logits(model, rows, torch.device("cpu"))
            for name, rows in (("plain", plain), ("sharded", sharded))
        }
    keep = batch.response_mask[:, : plain.width].bool()
    torch.testing.assert_close(
        log_probs(logits["sharded"], batch, plain.width)[keep],
        log_probs(logits["plain"], batch, plain.width)[keep],
        atol=1e-5,
        rtol=1e-5,
    )
