"""Token-budget micro-batches (``use_dynamic_bsz``): the budget bounds the padded rectangle each
forward runs, ``rows * (max prompt + max response columns)``, as ``model_inputs`` builds it.

Single process: ``dsrl.runtime.distributed.all_reduce`` is the identity without a process group; the
cross-rank agreement is simulated by patching it.
"""

from __future__ import annotations

import random

import pytest
import torch

import dsrl.engines.forward as forward
from dsrl.data.batch import Batch
from dsrl.engines.forward import micro_batch_indices, model_inputs
from dsrl.engines.packing import Packing

KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


def make_batch(
    prompt_lens: list[int], response_lens: list[int], *, P: int | None = None, T: int | None = None
) -> Batch:
    """Rows with these prompt (left-padded) and response (right-padded) lengths."""
    P = P or max(prompt_lens)
    T = T or max(response_lens)
    prompt_len, response_len = torch.tensor(prompt_lens), torch.tensor(response_lens)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    response_mask = (torch.arange(T) < response_len[:, None]).long()
    return Batch(
        prompt_ids=(torch.arange(P) + 3) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=(torch.arange(T) + 3) * response_mask,
        response_mask=response_mask,
        group_ids=torch.arange(len(prompt_lens)),
    )


def area(batch: Batch, idx: torch.Tensor) -> int:
    """Elements of the input ``model_inputs`` builds for rows ``idx``."""
    inputs, _ = model_inputs(batch.select(idx), torch.device("cpu"))
    rows, cols = inputs["input_ids"].shape
    return rows * cols


def check_parts(batch: Batch, parts: list[torch.Tensor], budget: int) -> None:
    assert all(part.dtype == torch.long for part in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(batch)))  # every row exactly once
    for part in parts:
        assert len(part) > 0
        assert area(batch, part) <= budget, (part.tolist(), area(batch, part))


def as_sets(parts: list[torch.Tensor]) -> set[frozenset[int]]:
    return {frozenset(part.tolist()) for part in parts}


def test_greedy_cut_of_rows_sorted_by_length():
    # Rows (prompt, response): 0:(4,10) 1:(2,2) 2:(1,6) 3:(3,5) 4:(2,10) 5:(2,3); budget 24.
    # Sorted by (response, prompt): 1, 5, 3, 2, 4, 0. Greedy: [1,5,3] = 3*(3+5) = 24;
    # adding 2 would give 4*(3+6) = 36. [2,4] = 2*(2+10) = 24; adding 0 would give 3*(4+10) = 42. [0] = 14.
    # Three parts is the minimum: the rows alone already span 14+4+7+8+12+5 = 50 > 2*24.
    batch = make_batch([4, 2, 1, 3, 2, 2], [10, 2, 6, 5, 10, 3])
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=24, key=KEY)
    check_parts(batch, parts, 24)
    assert as_sets(parts) == {frozenset({1, 5, 3}), frozenset({2, 4}), frozenset({0})}
    assert [area(batch, part) for part in parts] == [24, 24, 14]
    assert all(part.tolist() == sorted(part.tolist()) for part in parts)


def test_long_tail_stays_within_the_padded_budget():
    # Row 0: prompt 8 + response 32 = 40 tokens; rows 1..15: 2 + 2 = 4 tokens; budget 80.
    # The old packer balanced VALID tokens (40 + 15*4 = 100) over ceil(100/80) = 2 parts, longest
    # first to the lightest part: the long row's part got 3 short rows (40 + 12 = 52 valid tokens)
    # but runs a [4, 40] rectangle = 160 > 80. Sorting by length puts the short rows together.
    batch = make_batch([8] + [2] * 15, [32] + [2] * 15)
    old_long_part_area = 4 * (8 + 32)
    assert old_long_part_area > 80
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=80)
    check_parts(batch, parts, 80)
    assert as_sets(parts) == {frozenset({0}), frozenset(range(1, 16))}
    assert sorted(area(batch, part) for part in parts) == [40, 60]


def test_padding_inside_a_response_counts():
    # A response with a mask hole (a multi-turn observation) spans up to its last valid token.
    batch = make_batch([2, 2, 2], [1, 1, 1], T=6)
    batch.response_mask[0] = torch.tensor([1, 0, 0, 0, 0, 1])
    batch.response_ids[0] = 7 * batch.response_mask[0]
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=10)
    check_parts(batch, parts, 10)
    assert as_sets(parts) == {frozenset({0}), frozenset({1, 2})}  # row 0 spans 8 columns, valid 3
    with pytest.raises(ValueError, match=f"{KEY}=7: a sequence spans 8 tokens"):
        micro_batch_indices(batch, micro_batch_size=1, max_token_len=7, key=KEY)  # 2 + 2 valid tokens fit


def test_a_row_that_cannot_fit_names_the_key():
    batch = make_batch([3, 6], [2, 8])
    with pytest.raises(ValueError, match=f"{KEY}=13: .*set it to at least max_prompt_length"):
        micro_batch_indices(batch, micro_batch_size=1, max_token_len=13, key=KEY)
    assert len(micro_batch_indices(batch, micro_batch_size=1, max_token_len=14, key=KEY)) == 2


def test_count_by_rows_without_a_budget():
    batch = make_batch([1] * 5, [1] * 5)
    parts = micro_batch_indices(batch, micro_batch_size=2, max_token_len=None)
    assert [part.tolist() for part in parts] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("agreed", [4, 6, 9, 16])
def test_more_parts_agreed_over_ranks(monkeypatch, agreed):
    """Another rank needs ``agreed`` parts: this rank splits its largest parts, staying in budget."""
    batch = make_batch([8] + [2] * 15, [32] + [2] * 15)
    calls = []

    def all_reduce(values, op="sum"):
        calls.append(op)
        return torch.maximum(values, torch.tensor([agreed]))

    monkeypatch.setattr(forward, "all_reduce", all_reduce)
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=80)
    assert calls == ["max"]
    assert len(parts) == agreed
    check_parts(batch, parts, 80)
    # The 15 short rows are halved (8 + 7, then the larger halves again), not peeled one at a time.
    assert max(len(part) for part in parts if 0 not in part.tolist()) <= 8


def test_fewer_rows_than_agreed_parts_gives_empty_trailing_parts(monkeypatch):
    monkeypatch.setattr(forward, "all_reduce", lambda values, op="sum": torch.tensor([5]))
    batch = make_batch([2, 2, 2], [1, 2, 3])
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=100)
    assert [len(part) for part in parts] == [1, 1, 1, 0, 0]
    assert sorted(torch.cat(parts).tolist()) == [0, 1, 2]


def test_random_batches_respect_the_budget():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 24)
        prompts = [rng.randint(1, 12) for _ in range(n)]
        responses = [rng.randint(1, 20) for _ in range(n)]
        budget = rng.randint(max(p + r for p, r in zip(prompts, responses, strict=True)), 150)
        batch = make_batch(prompts, responses, P=12, T=20)
        parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=budget)
        check_parts(batch, parts, budget)


def test_one_copy_of_each_prompt_keeps_a_group_together_and_counts_its_prompt_once():
    # Two prompts (10 and 20 tokens) with three responses each: a group packed with one prompt copy spans
    # 10 + 1 + 3 + 5 = 19 and 20 + 2 + 4 + 6 = 32 tokens, so a 32-token budget takes one part per group.
    batch = make_batch([10, 10, 10, 20, 20, 20], [5, 1, 3, 4, 2, 6])
    parts = micro_batch_indices(batch, micro_batch_size=1, max_token_len=32, key=KEY, packing=Packing(dedup=True))
    assert sorted(p.tolist() for p in parts) == [[0, 1, 2], [3, 4, 5]]
    # Without the prompt counted once, the second group alone is 3 x 20 + 12 = 72 tokens: more parts.
    assert len(micro_batch_indices(batch, micro_batch_size=1, max_token_len=32, key=KEY, packing=Packing())) > 2
