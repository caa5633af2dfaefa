"""dsrl's packed rows against verl 0.9.1's remove-padding path (``verl.utils.attention_utils``, the pure-torch
fallbacks of flash-attn's ``bert_padding`` that verl uses without CUDA), on the tiny model in float32.

verl's actor with ``use_remove_padding``: ``unpad_input`` lays every row's attended tokens end to end in one row,
the position ids are gathered at the same indices, the model runs that row, the labels are the packed ids rolled by
one, and ``pad_input`` scatters the log-probs back to ``[B, P + T]``, whose response slice ``[:, -T - 1 : -1]``
is kept. dsrl (``dsrl.engines.packing``) places the same sequences into rows of its own length and gathers the
logits predicting each response token. Both must see the same sequences and give the same log-probs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.utils.attention_utils import index_first_axis, pad_input, rearrange, unpad_input

from dsrl.algorithms import logprobs_from_logits
from dsrl.engines.packing import pack, packed_response_logits
from tests.helpers.engines import context_batch, group_batch, in_context


def verl_packed_log_probs(model, batch):
    """verl 0.9.1's ``DataParallelPPOActor._forward_micro_batch`` with ``use_remove_padding`` (no Ulysses, no
    fused kernels, temperature 1): log-probs ``[B, T]`` and each row's packed token ids."""
    input_ids, attention_mask, position_ids = batch.input_ids, batch.attention_mask, batch.position_ids
    B, seqlen = input_ids.shape
    T = batch.response_ids.shape[1]
    ids_rmpad, indices, cu_seqlens, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    ids_rmpad = ids_rmpad.transpose(0, 1)  # [1, total]
    positions_rmpad = index_first_axis(rearrange(position_ids.unsqueeze(-1), "b s ... -> (b s) ..."), indices)
    logits = model(input_ids=ids_rmpad, position_ids=positions_rmpad.transpose(0, 1), use_cache=False).logits
    labels = torch.roll(ids_rmpad, shifts=-1, dims=1)
    log_probs = logprobs_from_logits(logits.squeeze(0), labels.squeeze(0))
    full = pad_input(hidden_states=log_probs.unsqueeze(-1), indices=indices, batch=B, seqlen=seqlen)
    sequences = [ids_rmpad[0, cu_seqlens[i] : cu_seqlens[i + 1]] for i in range(B)]
    return full.squeeze(-1)[:, -T - 1 : -1], sequences


@pytest.mark.parametrize("make_batch", [context_batch, lambda: in_context(group_batch())], ids=["varied", "groups"])
def test_dsrl_packs_the_sequences_verl_unpads_and_gives_its_log_probs(tiny_model_dir, make_batch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = make_batch()
    with torch.no_grad():
        expected, sequences = verl_packed_log_probs(model.eval(), batch)
        packed = pack(batch)
        logits = packed_response_logits(model, packed, torch.device("cpu"))
    got = logprobs_from_logits(logits, batch.response_ids[:, : packed.width])
    for i, sequence in enumerate(sequences):  # row i's tokens: dsrl's packed row from its first predicted column
        row, start = int(packed.rows[i, 0]), int(packed.columns[i, 0]) + 1 - int(batch.prompt_mask[i].sum())
        assert torch.equal(packed.input_ids[row, start : start + len(sequence)], sequence)
    mask = batch.response_mask[:, : packed.width].bool()
    assert mask.sum() > 0
    torch.testing.assert_close(got[mask], expected[:, : packed.width][mask], atol=1e-5, rtol=1e-5)
