"""A step's rewards on one rank: responses decoded and scored by the reward functions or the reward model, DAPO's
overlong punishment added (``reward_model.reward_manager=dapo``), and gdpo's reward components picked out of the
extras. The trainer orders the calls and turns problems into a stop; the metrics over all ranks are
``dsrl.trainer.metrics.reward_metrics``.

With ``reward_model.enable`` the reward model scores every response first (``dsrl.engines.reward_model``, on the
sequences ``dsrl.rewards.model_inputs`` builds). As verl's reward loop: without ``custom_reward_function`` its score is
the response's score; with one, the function's result is, and the function reads the reward model's score in
``extra_info["reward_model_score"]`` (verl's function would ask verl's reward-model server for it). Either way the
score is the reward extra ``reward_model_score``: a gdpo component, and ``reward/reward_model_score/mean``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrl.config import Config, reward_model_length
from dsrl.data.batch import Batch, last_response_token
from dsrl.engines.reward_model import RewardModelEngine
from dsrl.rewards import FAILURE_COUNTS, RewardScorer, overlong_penalties, reward_components
from dsrl.rewards.model_inputs import RewardModelInputs, reward_tokenizer_problem
from dsrl.runtime.distributed import gather_problems


@dataclass
class Scores:
    """One batch's rewards on this rank."""

    token_level: torch.Tensor  # [B, T] float32: each response's score at its last response token, 0 elsewhere
    responses: list[str]  # the decoded responses
    extras: dict[str, list]  # what the reward functions returned besides the score: B values per name, None where none
    counts: dict[str, float]  # the scorer's failure counts


RM_SCORE = "reward_model_score"  # the reward model's score: in the reward function's extra_info, and a reward extra
RM_TRUNCATED = "reward_model/truncated"  # rows the reward model read without their start (a count over the ranks)


def reward_model_inputs(cfg: Config, tokenizer, reward_tokenizer) -> RewardModelInputs:
    """The sequences the reward model (``reward_tokenizer``'s) reads of ``tokenizer``'s responses; ValueError when
    the two tokenizers cannot be paired (``reward_tokenizer_problem``)."""
    problem = reward_tokenizer_problem(tokenizer, reward_tokenizer, cfg.reward_model.model.path)
    if problem is not None:
        raise ValueError(problem)
    return RewardModelInputs(tokenizer, reward_tokenizer, max_length=reward_model_length(cfg))


class StepScorer:
    """Scores batches for the trainer: training, validation and ReMax's greedy baseline alike. ``model_inputs`` (with
    the reward model): the sequences it reads; the trainer sets ``reward_model``, the engine, once it is built."""

    def __init__(self, cfg: Config, scorer: RewardScorer, tokenizer, model_inputs: RewardModelInputs | None = None):
        self.cfg, self.scorer, self.tokenizer = cfg, scorer, tokenizer
        self.model_inputs = model_inputs
        self.reward_model: RewardModelEngine | None = None

    def response_texts(self, batch: Batch) -> list[str]:
        return self.tokenizer.batch_decode(
            [ids[mask.bool()] for ids, mask in zip(batch.response_ids, batch.response_attention, strict=True)],
            skip_special_tokens=True,
        )

    def prompt_text(self, batch: Batch, row: int) -> str:
        return self.tokenizer.decode(batch.prompt_ids[row][batch.prompt_mask[row].bool()], skip_special_tokens=True)

    def score(self, batch: Batch) -> Scores:
        """This rank's rows; with the reward model a collective (every rank calls it as often, with any rows)."""
        responses = self.response_texts(batch)
        infos: list = batch.extra_infos or [{}] * len(batch)
        model_scores = None
        if self.reward_model is not None and self.model_inputs is not None:
            sequences, truncated = self.model_inputs.sequences(batch)
            model_scores = self.reward_model.score(sequences).tolist()
            infos = [{**(info or {}), RM_SCORE: value} for info, value in zip(infos, model_scores, strict=True)]
        if model_scores is None or self.cfg.custom_reward_function.path is not None:
            scores, extras, counts = self.scorer.score_batch(batch.data_sources, responses, batch.ground_truths, infos)
        else:  # verl: the reward model's score is the response's
            scores, extras, counts = list(model_scores), {}, dict.fromkeys(FAILURE_COUNTS, 0)
        if model_scores is not None:
            extras, counts = {**extras, RM_SCORE: model_scores}, {**counts, RM_TRUNCATED: truncated}
        kwargs = self.cfg.reward_model.reward_kwargs
        buffer = kwargs.overlong_buffer_cfg
        if buffer.enable:  # the dapo reward manager (validated), as verl: training, validation and remax's baseline
            penalties = overlong_penalties(
                batch.response_attention.sum(-1).tolist(),
                max_resp_len=self.cfg.data.max_response_length if kwargs.max_resp_len is None else kwargs.max_resp_len,
                buffer_len=buffer.len,
                penalty_factor=buffer.penalty_factor,
            )
            scores = [score + penalty for score, penalty in zip(scores, penalties, strict=True)]
            if buffer.log:
                extras = {**extras, "overlong_reward": penalties, "overlong": [penalty < 0 for penalty in penalties]}
        token_level = torch.zeros_like(batch.response_mask, dtype=torch.float32)
        last = last_response_token(batch.response_mask)
        token_level[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=torch.float32)
        return Scores(token_level, responses, extras, counts)

    def gdpo_components(self, batch: Batch, scores: Scores) -> tuple[torch.Tensor | None, list[str]]:
        """gdpo's reward components ``[B, K]`` (``algorithm.gdpo_reward_keys``; None without) and the problems
        of every rank (a collective when the keys are set): a row without a component."""
        keys = self.cfg.algorithm.gdpo_reward_keys
        if not keys:
            return None, []
        rows, problems = reward_components(
            list(keys), {**scores.extras, "score": scores.token_level.sum(-1).tolist()}, batch.data_sources
        )
        problems = gather_problems(problems)
        return (None if problems else torch.tensor(rows, dtype=torch.float32)), problems
