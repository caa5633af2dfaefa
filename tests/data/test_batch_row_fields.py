"""The batch's per-row lists (``ROW_FIELDS``) follow their rows through ``select``, ``split`` and ``concat``."""

import pytest
import torch

from dsrl.data.batch import ROW_FIELDS, Batch


def batch_of(uids: list[int], *, raw_prompts: bool = True, prompt_width: int = 2) -> Batch:
    ids = torch.tensor([[u] * prompt_width for u in uids])
    return Batch(
        prompt_ids=ids,
        prompt_mask=torch.ones_like(ids),
        response_ids=ids[:, :1],
        response_mask=torch.ones_like(ids[:, :1]),
        group_ids=torch.tensor(uids),
        data_sources=[f"s{u}" for u in uids],
        ground_truths=[str(u) for u in uids],
        extra_infos=[{"uid": u} for u in uids],
        raw_prompts=[[{"role": "user", "content": f"q{u}"}] for u in uids] if raw_prompts else [],
    )


def contents(batch: Batch) -> list[str]:
    return [messages[0]["content"] for messages in batch.raw_prompts]


def test_raw_prompts_is_a_row_field():
    assert "raw_prompts" in ROW_FIELDS


def test_raw_prompts_follow_select_split_and_concat():
    batch = batch_of([0, 1, 2, 3])
    picked = batch.select(torch.tensor([3, 1, 1]))
    assert contents(picked) == ["q3", "q1", "q1"] and picked.group_ids.tolist() == [3, 1, 1]
    assert [contents(part) for part in batch.split(3)] == [["q0", "q1", "q2"], ["q3"]]
    both = Batch.concat([picked, batch_of([7], prompt_width=5)])
    assert contents(both) == ["q3", "q1", "q1", "q7"] and both.prompt_ids[:, -1].tolist() == [3, 1, 1, 7]
    plain = batch_of([0, 1], raw_prompts=False)
    assert plain.select(torch.tensor([1])).raw_prompts == []
    assert Batch.concat([plain, plain]).raw_prompts == []


def test_concat_refuses_raw_prompts_on_some_batches_only():
    with pytest.raises(ValueError, match="'raw_prompts' is set on some batches and not on others"):
        Batch.concat([batch_of([0]), batch_of([1], raw_prompts=False)])
    empty = batch_of([0]).select(torch.tensor([], dtype=torch.long))  # no rows: nothing to miss
    assert contents(Batch.concat([empty, batch_of([1])])) == ["q1"]
