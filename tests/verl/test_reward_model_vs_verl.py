"""The reward model's score reaches the batch as in verl 0.9.1's reward loop. Routing (verl's
``RewardLoopWorker.compute_score``): without ``custom_reward_function`` the reward model's score is the response's
score; with one, the function's result is. Placement (verl's ``RewardManagerBase.assemble_rm_scores``): the score
sits at the last attended response token, on left-padded prompts and right-padded responses of every length, an
empty response included (both then write the last column). dsrl's side is ``StepScorer.score`` itself, on a real
``Batch``; the reward-model engine's scores (a transformers forward, checked in tests/engines/) and the reward
workers' results are given."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from dsrl.data.batch import Batch
from dsrl.rewards import FAILURE_COUNTS
from dsrl.trainer.scoring import RM_SCORE, RM_TRUNCATED, StepScorer

P, T = 5, 7
RESPONSE_LENGTHS = torch.tensor([0, 1, 3, T, 4, 2, T - 1, 5])
B = len(RESPONSE_LENGTHS)


def padded_batch(generator: torch.Generator) -> Batch:
    """Left-padded prompts of 1..P tokens and right-padded responses of ``RESPONSE_LENGTHS``."""
    prompt_lengths = torch.randint(1, P + 1, (B,), generator=generator)
    prompt_mask = (torch.arange(P) >= P - prompt_lengths[:, None]).long()
    response_mask = (torch.arange(T) < RESPONSE_LENGTHS[:, None]).long()
    return Batch(
        prompt_ids=torch.randint(4, 100, (B, P), generator=generator) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(4, 100, (B, T), generator=generator) * response_mask,
        response_mask=response_mask,
        group_ids=torch.arange(B),
        data_sources=["arithmetic"] * B,
        ground_truths=["1"] * B,
        extra_infos=[{"index": i} for i in range(B)],
    )


def dsrl_scores(batch: Batch, model_scores: torch.Tensor, function_scores: list[float] | None):
    """``StepScorer.score`` with the reward model's ``model_scores`` and, when given, a reward function's results."""
    cfg = SimpleNamespace(
        custom_reward_function=SimpleNamespace(path=None if function_scores is None else "my_reward.py"),
        reward_model=SimpleNamespace(reward_kwargs=SimpleNamespace(overlong_buffer_cfg=SimpleNamespace(enable=False))),
    )
    seen = []

    def score_batch(sources, responses, truths, infos):
        seen.extend(infos)
        return list(function_scores), {}, dict.fromkeys(FAILURE_COUNTS, 0)

    tokenizer = SimpleNamespace(batch_decode=lambda rows, skip_special_tokens: [str(len(r)) for r in rows])
    inputs = SimpleNamespace(sequences=lambda batch: ([[1]] * len(batch), 0))
    scorer = StepScorer(cfg, SimpleNamespace(score_batch=score_batch), tokenizer, inputs)
    scorer.reward_model = SimpleNamespace(score=lambda sequences: model_scores.clone())
    return scorer.score(batch), seen


def test_the_reward_models_score_is_the_reward_where_verl_assembles_it():
    generator = torch.Generator().manual_seed(0)
    batch = padded_batch(generator)
    model_scores = torch.randn(B, generator=generator)
    data = DataProto.from_dict(
        tensors={"prompts": batch.prompt_ids, "responses": batch.response_ids, "attention_mask": batch.attention_mask}
    )
    verl_scores = NaiveRewardManager.assemble_rm_scores(data, model_scores.tolist())
    scores, _ = dsrl_scores(batch, model_scores, None)
    assert torch.equal(scores.token_level, verl_scores)
    assert verl_scores[0, -1] == model_scores[0]  # the empty response: the last column, in both
    assert scores.extras[RM_SCORE] == model_scores.tolist() and scores.counts[RM_TRUNCATED] == 0


def test_with_a_reward_function_its_result_is_the_reward_and_it_reads_the_models_score():
    generator = torch.Generator().manual_seed(1)
    batch = padded_batch(generator)
    model_scores = torch.randn(B, generator=generator)
    function_scores = torch.randn(B, generator=generator)
    data = DataProto.from_dict(
        tensors={"prompts": batch.prompt_ids, "responses": batch.response_ids, "attention_mask": batch.attention_mask}
    )
    scores, seen = dsrl_scores(batch, model_scores, function_scores.tolist())
    assert torch.equal(scores.token_level, NaiveRewardManager.assemble_rm_scores(data, function_scores.tolist()))
    assert [info[RM_SCORE] for info in seen] == model_scores.tolist()
    assert [info["index"] for info in seen] == list(range(B))  # the row's own extra_info, the score added
    assert scores.extras[RM_SCORE] == model_scores.tolist()
