"""The batch contract: one record of tensors that every phase of a step reads and extends.

Vocabulary: B sequences (prompts x n), P prompt tokens (left-padded), T response tokens
(right-padded). Tensor fields are ``None`` until the phase that produces them has run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# Per-token float fields: [B, T] float32, aligned with response_ids.
TOKEN_FIELDS = (
    "rollout_log_probs",  # rollout engine's log-probs of the sampled tokens
    "old_log_probs",  # actor log-probs before the update
    "entropy",  # actor entropy per position
    "sum_pi_squared",  # sum_v pi(v)^2 per position (OTB)
    "ref_log_probs",  # reference model log-probs
    "teacher_log_probs",  # distillation teacher's log-probs
    "values",  # critic values
    "token_level_scores",  # reward-function score at the last response token
    "token_level_rewards",  # scores after in-reward KL
    "advantages",
    "returns",
    "rollout_is_weights",  # truncated importance weights rollout -> trainer
)
ROW_FIELDS = ("data_sources", "ground_truths", "extra_infos", "raw_prompts")


@dataclass
class Batch:
    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P] int64, 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] int64, right-padded
    response_mask: torch.Tensor  # [B, T] int64, 1 on generated tokens incl. EOS (the loss mask)
    group_ids: torch.Tensor  # [B] int64, same id = same prompt
    data_sources: list[str] = field(default_factory=list)  # [B] reward dispatch key
    ground_truths: list[Any] = field(default_factory=list)  # [B]
    extra_infos: list[dict] = field(default_factory=list)  # [B]
    # [B] each row's prompt as chat messages, for a reward model with another chat template; [] unless the prompts
    # were loaded with keep_messages (dsrl.data.datasets.load_prompts)
    raw_prompts: list[list[dict]] = field(default_factory=list)
    rollout_log_probs: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_level_scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None  # [B] float32, ReMax: the score of the prompt's greedy response
    reward_components: torch.Tensor | None = (
        None  # [B, K] float32, gdpo: the reward's algorithm.gdpo_reward_keys values
    )
    # [B, T] int64, multi-turn: 1 on every response token the model sees -- its turns and the tool outputs between
    # them (response_mask 0 there) -- 0 on padding; None = response_mask (one turn). Always ends on a response_mask 1.
    response_attention_mask: torch.Tensor | None = None
    # [B, P, layers, k] and [B, T, layers, k] int16, a mixture of experts' routing replay (actor.router_replay): the
    # experts each token's forward chose (R3: the rollout's, R2: the old-log-prob pass's); -1 where none was recorded
    prompt_routes: torch.Tensor | None = None
    response_routes: torch.Tensor | None = None
    # [B, T] int64, partial rollout (trainer.v1.trainer_mode=colocate_async): the policy version (global_step) that
    # sampled each response token; 0 on padding. None = every token the step's own version's.
    rollout_versions: torch.Tensor | None = None

    @classmethod
    def of_responses(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, out: Any, n: int) -> Batch:
        """The batch of ``n`` responses per prompt (``out``: a rollout's output, rows of prompt i at
        ``i*n .. i*n+n-1``), each row with its prompt; group ids are the prompts' positions."""
        rows = torch.arange(len(prompt_ids)).repeat_interleave(n)
        return cls(
            prompt_ids=prompt_ids[rows],
            prompt_mask=prompt_mask[rows],
            response_ids=out.response_ids,
            response_mask=out.response_mask,
            group_ids=rows,
            rollout_log_probs=out.log_probs,
            response_attention_mask=out.attention_mask,
        )

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def replace(self, **fields) -> Batch:
        return dataclasses.replace(self, **fields)

    @property
    def input_ids(self) -> torch.Tensor:  # [B, P + T]
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def response_attention(self) -> torch.Tensor:  # [B, T]: every response token in the context (tool outputs too)
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    @property
    def attention_mask(self) -> torch.Tensor:  # [B, P + T]
        return torch.cat([self.prompt_mask, self.response_attention.to(self.prompt_mask.dtype)], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:  # [B, P + T]; left padding shifts positions
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    def _tensor_items(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                yield f.name, value

    def select(self, index: torch.Tensor) -> Batch:
        """Rows ``index`` (a LongTensor of row numbers) of every field."""
        rows = index.tolist()
        fields = {name: value[index] for name, value in self._tensor_items()}
        for name in ROW_FIELDS:
            values = getattr(self, name)
            fields[name] = [values[i] for i in rows] if values else []
        return self.replace(**fields)

    def split(self, n_rows: int) -> list[Batch]:
        """Consecutive chunks of ``n_rows`` rows (the last may be shorter)."""
        return [self.select(torch.arange(s, min(s + n_rows, len(self)))) for s in range(0, len(self), n_rows)]

    def to(self, device: torch.device | str) -> Batch:
        return self.replace(**{name: value.to(device) for name, value in self._tensor_items()})

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Stack rows; prompts are re-padded on the left and responses on the right to a common width."""
        P = max(b.prompt_ids.shape[1] for b in batches)
        T = max(b.response_ids.shape[1] for b in batches)
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(Batch):
            values = [getattr(b, f.name) for b in batches]
            if f.name in ROW_FIELDS:
                if len({bool(vs) for vs, b in zip(values, batches, strict=True) if len(b)}) > 1:
                    raise ValueError(f"Batch.concat: row field {f.name!r} is set on some batches and not on others")
                fields[f.name] = [v for vs in values for v in vs]
            elif all(v is None for v in values):
                fields[f.name] = None
            elif any(v is None for v in values):
                raise ValueError(f"Batch.concat: field {f.name!r} is set on some batches and not on others")
            elif f.name.startswith("prompt_"):
                fields[f.name] = torch.cat([pad_columns(v, P - v.shape[1], 0) for v in values])
            elif values[0].dim() == 1 or f.name == "reward_components":  # not per token
                fields[f.name] = torch.cat(values)
            else:
                fields[f.name] = torch.cat([pad_columns(v, 0, T - v.shape[1]) for v in values])
        return Batch(**fields)


def pad_columns(value: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """``value`` (``[B, columns, ...]``) with ``before`` and ``after`` columns of zeros around its own."""
    return F.pad(value, (0, 0) * (value.dim() - 2) + (before, after))


def last_response_token(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's last position with ``response_mask`` 1 (after a multi-turn response's holes);
    -1 for an empty response."""
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return (positions * (response_mask != 0)).amax(-1) - 1


def left_pad(
    sequences: list[tuple[int, ...]] | list[list[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token sequences to the longest: ``(ids, mask)``, both ``[B, P]`` int64, mask 1 on tokens.

    Left padding puts every prompt's last token in column ``P - 1``, where generation continues.
    """
    if not sequences:
        raise ValueError("left_pad: no sequences")
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # [B, P]
    ids = torch.full(mask.shape, pad_token_id, dtype=torch.long)
    # Row-major boolean indexing visits the kept positions in the order of the concatenated sequences.
    ids[mask] = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    return ids, mask.long()


def right_pad(rows: Sequence[Sequence[float]], width: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows of values, each at most ``width`` long, as ``[len(rows), width]`` of ``dtype``, ``value`` after each row."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out
