"""The validation pass, shared by the trainer (``Trainer.validate``) and ``dsrl-eval`` (``dsrl.commands.evaluate``).

A rank's share of the prompts is ``prompts[rank::world]``, cut into chunks (``shard_chunks``) so that every rank
makes the same number of generate calls (a generate call is a collective within a tensor-parallel group); a rank
whose share ends early generates for a filler prompt it does not score. The chunks' responses are scored on their
rank (``score_chunks``), the rows meet in one gather (``gather_rows``, in dataset order) and become verl's
validation metrics (``row_metrics``), with one headline number (``validation_score``) and a table of the
generations (``generation_row``)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from dsrl.data.batch import Batch
from dsrl.rewards import FAILURE_COUNTS, numeric_extras
from dsrl.trainer.metrics import validation_metrics
from dsrl.trainer.scoring import StepScorer


class ScoredResponse(NamedTuple):
    """One response of a validation pass."""

    index: int  # its prompt's row in the validation prompts (the uid its group is known by)
    data_source: str
    score: float  # the response's score (the reward function's, plus any overlong penalty)
    extras: dict  # what the reward function returned besides the score
    texts: tuple[str, str] | None  # (prompt, response), for the rows whose texts were asked for


def shard_chunks(
    prompts: Sequence, rank: int, world_size: int, chunk_size: int | None
) -> list[tuple[Sequence, int, int]]:
    """This rank's chunks as ``(records, first_group_id, real prompts)``: ``prompts[rank::world]`` cut into chunks of
    ``chunk_size`` prompts (None: one chunk), as many on every rank (``ceil(N / world)`` prompts at most); a chunk
    past the end of this rank's share holds the first prompt as a filler and 0 real prompts. Group ids count the
    rank's shard rows (``ScoredResponse.index`` maps them back)."""
    shard = prompts[rank::world_size]
    most = math.ceil(len(prompts) / world_size)
    chunk = chunk_size or most
    chunks = []
    for start in range(0, most, chunk):
        records = shard[start : start + chunk]
        chunks.append((records if len(records) else prompts[:1], start, len(records)))
    return chunks


def score_chunks(
    batches: list[tuple[Batch, int]], scoring: StepScorer, *, rank: int, world_size: int, texts_below: int
) -> tuple[list[ScoredResponse], dict[str, float]]:
    """This rank's responses scored (no collective but the reward model's): ``batches`` holds each chunk's generated
    batch and its count of real rows (prompts x n; the filler's rows come after them and are dropped); the texts are
    kept for the rows whose prompt index is below ``texts_below``. Returns the rows and the scorer's failure
    counts."""
    rows: list[ScoredResponse] = []
    failures = dict.fromkeys(FAILURE_COUNTS, 0.0)
    for batch, real_rows in batches:
        if not real_rows and scoring.reward_model is None:
            continue  # the reward model's forward is collective: it runs with no rows too
        batch = batch.select(torch.arange(real_rows))
        scores = scoring.score(batch)
        for name, count in scores.counts.items():
            failures[name] = failures.get(name, 0.0) + count
        for i, (source, shard_row, score) in enumerate(
            zip(batch.data_sources, batch.group_ids.tolist(), scores.token_level.sum(-1).tolist(), strict=True)
        ):
            index = rank + world_size * shard_row
            texts = (scoring.prompt_text(batch, i), scores.responses[i]) if index < texts_below else None
            extras = {name: values[i] for name, values in scores.extras.items()}
            rows.append(ScoredResponse(index, source, score, extras, texts))
    return rows, failures


def gather_rows(
    rows: list[ScoredResponse], failures: dict[str, float]
) -> tuple[list[ScoredResponse], dict[str, float]]:
    """Every rank's rows in dataset order (a prompt's responses in generation order) and the failure counts summed
    over the ranks, on every rank. Collective."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rows, failures))
    every = sorted((row for part, _ in gathered for row in part), key=lambda row: row.index)
    return every, {name: float(sum(part[name] for _, part in gathered)) for name in failures}


def response_variables(rows: list[ScoredResponse]) -> tuple[dict[str, list[float]], list[Hashable] | None]:
    """The variables validation averages -- ``reward`` (the score) and each numeric extra every row has -- and the
    ``pred`` extras that vote for ``maj@k`` (None unless every row has a hashable one)."""
    extras = {name: [row.extras.get(name) for row in rows] for name in sorted({n for row in rows for n in row.extras})}
    variables = {"reward": [row.score for row in rows]}
    variables.update(
        {name: v for name, v in numeric_extras(extras).items() if len(v) == len(rows) and name != "reward"}
    )
    preds = extras.get("pred")
    if preds is not None and any(p is None or not isinstance(p, Hashable) for p in preds):
        preds = None
    return variables, preds


def row_metrics(rows: list[ScoredResponse]) -> dict[str, float]:
    """``dsrl.trainer.metrics.validation_metrics`` of gathered rows (verl's seed)."""
    variables, preds = response_variables(rows)
    return validation_metrics([row.data_source for row in rows], [row.index for row in rows], variables, preds)


def generation_row(texts: tuple[str, str], data_source: str, score: float, extras: dict) -> dict:
    """One row of a generations table: prompt, response, score, data source, then the reward's extras."""
    prompt, response = texts
    return {"prompt": prompt, "response": response, "score": score, "data_source": data_source, **extras}


def validation_score(metrics: dict[str, float]) -> float:
    """One number for a validation: the ``val-core/<data_source>/<var>/mean@N`` values averaged over
    the data sources (the core variable is ``acc`` when the reward gives it, else the reward)."""
    values = [v for k, v in metrics.items() if k.startswith("val-core/") and k.rpartition("/")[2].startswith("mean@")]
    return sum(values) / len(values) if values else math.nan
