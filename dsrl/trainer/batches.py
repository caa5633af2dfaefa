"""How a step's batch is built: the prompts of a rank (``prompt_batch``), then the rollout's responses to them
(``with_responses``). Shared by the training step, its validation and ``dsrl-eval``."""

from __future__ import annotations

import torch

from dsrl.data.batch import Batch
from dsrl.data.datasets import collate_prompts
from dsrl.rollout.base import RolloutOutput


def prompt_batch(records, pad_token_id: int, first_group_id: int) -> Batch:
    """Left-padded prompts; group ids are global row numbers from ``first_group_id``, unique across ranks."""
    fields = collate_prompts(records, pad_token_id)
    group_ids = torch.arange(first_group_id, first_group_id + len(fields["data_sources"]))
    empty = torch.empty(len(group_ids), 0, dtype=torch.long)
    return Batch(**fields, response_ids=empty, response_mask=empty, group_ids=group_ids)


def with_responses(prompts: Batch, out: RolloutOutput, n: int) -> Batch:
    """The rows of ``prompts`` repeated ``n`` times (a prompt's rows contiguous) with the rollout's responses. With
    multi-turn, each row's ``extra_info`` gains its ``num_turns`` and ``num_tool_calls`` for the reward functions."""
    repeat = torch.arange(len(prompts)).repeat_interleave(n)
    batch = prompts.select(repeat)
    if out.conversations is not None:
        infos = batch.extra_infos or [{}] * len(batch)
        talks = [
            {"num_turns": talk["num_turns"], "num_tool_calls": talk["num_tool_calls"]} for talk in out.conversations
        ]
        batch = batch.replace(extra_infos=[{**info, **talk} for info, talk in zip(infos, talks, strict=True)])
    return batch.replace(
        response_ids=out.response_ids,
        response_mask=out.response_mask,
        rollout_log_probs=out.log_probs,
        response_attention_mask=out.attention_mask,
        prompt_routes=out.prompt_routes,
        response_routes=out.response_routes,
    )
