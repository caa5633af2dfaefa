"""Every way the trainer builds a step's batch from prompt records carries the records' chat messages
(``raw_prompts``) with their rows when the prompts keep them: ``prompt_batch`` (training, validation, dsrl-eval),
``with_responses``, and partial rollout's ``InFlight.batch_of``."""

import torch

from dsrl.data.datasets import PromptRecord
from dsrl.rollout.base import RolloutOutput
from dsrl.trainer import partial_rollout
from dsrl.trainer.batches import prompt_batch, with_responses
from dsrl.trainer.partial_rollout import Group, InFlight, Response


def record(i: int, keep: bool = True) -> PromptRecord:
    messages = [{"role": "user", "content": f"q{i}"}] if keep else None
    return PromptRecord(tuple(range(1, 2 + i)), "x", str(i), {"i": i}, messages)


def contents(batch) -> list[str]:
    return [messages[0]["content"] for messages in batch.raw_prompts]


def test_prompt_batch_and_with_responses_carry_the_messages_per_row():
    prompts = prompt_batch([record(0), record(2)], pad_token_id=0, first_group_id=4)
    assert contents(prompts) == ["q0", "q2"]
    responses = torch.tensor([[5, 6], [5, 0], [7, 0], [7, 7]])
    out = RolloutOutput(responses, (responses != 0).long(), torch.zeros(4, 2), ["stop"] * 4)
    batch = with_responses(prompts, out, n=2)
    assert contents(batch) == ["q0", "q0", "q2", "q2"] and batch.group_ids.tolist() == [4, 4, 5, 5]
    assert prompt_batch([record(0, keep=False)], 0, 0).raw_prompts == []


def test_partial_rollouts_batch_of_carries_the_messages(monkeypatch):
    monkeypatch.setattr(partial_rollout.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(partial_rollout.dist, "get_rank", lambda: 0)
    pool = InFlight(batch_size=2, pool_size=2, n=2, threshold=None, strategy="drop")
    groups = [
        Group(group_id=g, record=r, admitted=0, responses=[Response([3, 4], [0.0, 0.0], [0, 0], True)] * 2)
        for g, r in ((7, 1), (8, 0))
    ]
    records = [record(0), record(1)]
    batch = pool.batch_of(groups, lambda rows: [records[r] for r in rows], prompt_pad=0, response_pad=0, max_tokens=3)
    assert contents(batch) == ["q1", "q1", "q0", "q0"] and batch.group_ids.tolist() == [7, 7, 8, 8]
