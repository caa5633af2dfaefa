"""Packed forwards (verl's ``use_remove_padding``): a micro-batch's sequences without their padding, end to end.

Each row's valid tokens (its prompt's, flushed left, then its response's up to the last token in the context) make
one sequence; sequences are placed into packed rows first-fit, longest first, each row holding at most
``row_tokens`` tokens. Position ids restart at 0 with every sequence and no attention mask is passed, so
transformers builds the block-diagonal causal mask from the position ids (``masking_utils.
find_packed_sequence_indices``; it does so only without a KV cache: a packed forward never uses one). The
logits at the positions that predict response tokens are gathered back into the ``[b, width, V]`` layout of
``dsrl.engines.forward.response_logits`` (past a row's response, another position's, as padding gives there), so
what follows the forward is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrl.config.files import packing_problem
from dsrl.data.batch import Batch


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [R, L]: packed rows, right-padded with 0 past their last sequence
    position_ids: torch.Tensor  # [R, L]: restarting at 0 with each sequence; padding continues the last one
    rows: torch.Tensor  # [b, width]: the packed row of the position predicting each response token
    columns: torch.Tensor  # [b, width]: its column there (-1: no such token, the row's response is shorter)
    width: int  # response columns kept (the micro-batch's longest response, as model_inputs keeps)
    tokens: int  # real tokens, R * L minus the padding of the packed rows

    def gather(self, per_position: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, width, ...]`` of ``per_position`` (``[R, L, ...]``, or ``[R, len(kept), ...]`` for the ascending
        packed columns ``kept``) at the position predicting each response token; a column out of the context
        takes some position's value, as a padded forward's padding does (the response mask drops both)."""
        columns = self.columns.clamp(min=0)
        if kept is not None:
            columns = torch.searchsorted(kept, columns)
        return per_position[self.rows.to(per_position.device), columns.to(per_position.device)]


def sequences(micro: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Each row's tokens in the context (its valid prompt tokens, then its response tokens with attention), for
    each response column the index in that sequence of the token predicting it (-1 for a column out of the
    context), and the response width to keep (``model_inputs``'s: up to the last column any row attends)."""
    attended = micro.response_attention.bool()
    columns = attended.any(0).nonzero()
    width = int(columns[-1]) + 1 if len(columns) else 1
    seqs, predictors = [], []
    for i in range(len(micro)):
        prompt = micro.prompt_ids[i][micro.prompt_mask[i].bool()]
        kept = attended[i, :width]
        seqs.append(torch.cat([prompt, micro.response_ids[i, :width][kept]]))
        before = torch.cumsum(kept.long(), 0) - kept.long()  # response tokens in the context before each column
        predictors.append(torch.where(kept, len(prompt) + before - 1, -1))
    return seqs, predictors, width


def pack(micro: Batch, row_tokens: int | None = None) -> PackedInputs:
    """``micro``'s sequences in packed rows of at most ``row_tokens`` tokens (None: the longest sequence's length,
    which bounds the dense mask sdpa and eager attention build per row)."""
    seqs, predictors, width = sequences(micro)
    capacity = max(row_tokens or 0, max(len(s) for s in seqs))
    fill: list[int] = []  # tokens placed in each packed row
    placed: dict[int, tuple[int, int]] = {}  # sequence -> (packed row, first column)
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        row = next((r for r, used in enumerate(fill) if used + len(seqs[i]) <= capacity), None)
        if row is None:
            row = len(fill)
            fill.append(0)
        placed[i] = (row, fill[row])
        fill[row] += len(seqs[i])
    length = max(fill)
    input_ids = torch.zeros(len(fill), length, dtype=micro.prompt_ids.dtype)
    position_ids = torch.zeros(len(fill), length, dtype=torch.long)
    rows = torch.zeros(len(seqs), width, dtype=torch.long)
    columns = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, seq in enumerate(seqs):
        row, start = placed[i]
        input_ids[row, start : start + len(seq)] = seq
        position_ids[row, start : start + len(seq)] = torch.arange(len(seq))
        rows[i] = row
        columns[i] = torch.where(predictors[i] >= 0, start + predictors[i], -1)
    for row, used in enumerate(fill):  # the padding continues the row's last sequence: nothing before it sees it
        position_ids[row, used:] = torch.arange(length - used) + int(position_ids[row, used - 1]) + 1
    return PackedInputs(input_ids, position_ids, rows, columns, width, sum(fill))


def packed_response_logits(
    module: torch.nn.Module, micro: Batch, device: torch.device, *, row_tokens: int | None = None
) -> tuple[torch.Tensor, int]:
    """Logits ``[b, width, V]`` predicting ``micro``'s response tokens from one packed forward, and ``width``; only
    the packed columns that predict a response token get logits."""
    packed = pack(micro, row_tokens)
    kept = torch.unique(packed.columns[packed.columns >= 0])
    out = module(
        input_ids=packed.input_ids.to(device),
        position_ids=packed.position_ids.to(device),
        use_cache=False,
        logits_to_keep=kept.to(device),
    )
    return packed.gather(out.logits, kept.to(device)), packed.width


def refuse_unpackable(model: torch.nn.Module, key: str) -> None:
    """ValueError naming ``key`` (a ``use_remove_padding`` set to true) when ``model`` (a transformers model)
    cannot run packed rows: what validation checks for a local model directory, here for a hub id too."""
    problem = packing_problem(model.config.to_dict())
    if problem is not None:
        raise ValueError(f"{key}=true: {model.config.name_or_path}: {problem}; fix: set {key}=false")
