"""DAPO's soft overlong punishment and the truncated-response test, by hand."""

import pytest
import torch

from dsrl.algorithms import truncated_responses
from dsrl.rewards import overlong_penalties


def test_overlong_penalty_by_hand():
    # L_max 20, buffer 4: free up to 16 tokens, then -penalty_factor / 4 per token, -1.0 at 20
    lengths = [1, 15, 16, 17, 18, 19, 20]
    got = overlong_penalties(lengths, max_resp_len=20, buffer_len=4, penalty_factor=1.0)
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    assert overlong_penalties([18, 20], max_resp_len=20, buffer_len=4, penalty_factor=0.5) == pytest.approx(
        [-0.25, -0.5]
    )
    # past L_max (max_resp_len below data.max_response_length) it keeps falling, as in verl
    assert overlong_penalties([22], max_resp_len=20, buffer_len=4, penalty_factor=1.0) == pytest.approx([-1.5])
    # a buffer as long as L_max punishes every token; a factor of 0 punishes none
    assert overlong_penalties([5], max_resp_len=10, buffer_len=10, penalty_factor=1.0) == pytest.approx([-0.5])
    assert overlong_penalties([20], max_resp_len=20, buffer_len=4, penalty_factor=0.0) == [0.0]


EOS, PAD = 9, 0


def test_truncated_responses_are_the_full_ones_without_eos():
    response_ids = torch.tensor([
        [1, 2, 3, 4],    # fills the budget, no EOS: cut
        [1, 2, 3, EOS],  # fills the budget, ends with EOS: finished
        [1, EOS, PAD, PAD],  # finished early
        [1, 2, 7, 4],    # cut, its last token is the second EOS id
    ])  # fmt: skip
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    cut = truncated_responses(response_ids, response_mask, max_response_length=4, eos_token_ids=[EOS])
    assert cut.tolist() == [True, False, False, True]
    cut = truncated_responses(response_ids, response_mask, max_response_length=4, eos_token_ids=[EOS, 4])
    assert cut.tolist() == [False, False, False, False]
    # a batch narrower than the budget (every response stopped early) has none cut
    assert not truncated_responses(
        response_ids[:, :3], response_mask[:, :3], max_response_length=4, eos_token_ids=[EOS]
    ).any()
