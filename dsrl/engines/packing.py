"""Packed forwards (verl's ``use_remove_padding``): a micro-batch's sequences without their padding, end to end.

Each row's valid tokens (its prompt's, flushed left, then its response's up to the last token in the context) make
one sequence; sequences are placed into packed rows first-fit, longest first, each row holding at most a length
chosen from the model's shape (``_row_length``: sdpa and eager attention compute every pair of a row, so longer
rows trade padding for attention pairs). Position ids restart at 0 with every sequence and no attention mask is
passed, so transformers builds the block-diagonal causal mask from the position ids (``masking_utils.
find_packed_sequence_indices``; it does so only without a KV cache: a packed forward never uses one). The
logits at the positions that predict response tokens are gathered back into the ``[b, width, V]`` layout of
``dsrl.engines.forward.response_logits`` (past a row's response, another position's, as padding gives there), so
what follows the forward is unchanged.

Prompt deduplication (``dedup``, verl's ``use_prefix_grouper``): the rows of a micro-batch with the same prompt
make one unit, the prompt once and then each row's response, every response's position ids continuing from the
prompt's end. Position ids can no longer describe that, so the forward takes an explicit 4D mask in which each
response token sees the prompt and its own response's earlier tokens (sdpa reads it as given; the engines refuse
other attention implementations). Response token 0 of every row in a unit is predicted by the one shared last
prompt position; indexing it out to each row sums their gradients there in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrl.config.files import packing_problem
from dsrl.data.batch import Batch


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [R, L]: packed rows, right-padded with 0 past their last unit
    position_ids: torch.Tensor  # [R, L]: from 0 in each unit's prompt; padding continues the row's last position
    attention_mask: torch.Tensor | None  # [R, 1, L, L] bool (True: attended) with dedup; None: from position ids
    rows: torch.Tensor  # [b, width]: the packed row of the position predicting each response token
    columns: torch.Tensor  # [b, width]: its column there (-1: no such token, the row's response is shorter)
    width: int  # response columns kept (the micro-batch's longest response, as model_inputs keeps)
    tokens: int  # real tokens run, R * L minus the padding of the packed rows
    sequence_tokens: int  # the rows' own tokens, each row's prompt counted once per row
    where: torch.Tensor  # [b, P + width]: each prompt and response column's flat position ``r * L + l``, -1: none

    def gather(self, per_position: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, width, ...]`` of ``per_position`` (``[R, L, ...]``, or ``[R, len(kept), ...]`` for the ascending
        packed columns ``kept``) at the position predicting each response token; a column out of the context
        takes some position's value, as a padded forward's padding does (the response mask drops both)."""
        columns = self.columns.clamp(min=0)
        if kept is not None:
            columns = torch.searchsorted(kept, columns)
        return per_position[self.rows.to(per_position.device), columns.to(per_position.device)]


@dataclass
class _Unit:
    """Tokens placed together in a packed row: a prompt, then one response (or, with dedup, each of its rows')."""

    parts: list[torch.Tensor]  # [prompt, response, ...]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def positions(self) -> torch.Tensor:
        prompt = len(self.parts[0])
        return torch.cat([torch.arange(prompt)] + [prompt + torch.arange(len(r)) for r in self.parts[1:]])

    def part_ids(self) -> torch.Tensor:
        return torch.cat([torch.full((len(part),), k) for k, part in enumerate(self.parts)])


def prompt_groups(batch: Batch) -> list[int]:
    """Per row, an id shared by the rows with the same prompt (its valid tokens)."""
    prompts = torch.cat([batch.prompt_ids * batch.prompt_mask, batch.prompt_mask], dim=1).cpu()
    return torch.unique(prompts, dim=0, return_inverse=True)[1].tolist()


def _units(micro: Batch, dedup: bool) -> tuple[list[_Unit], list[torch.Tensor], list[torch.Tensor], list[int], int]:
    """The units of ``micro``'s rows; for each row, per response column the index in its unit of the token
    predicting it (-1 for a column out of the context); per prompt and response column the index in its unit of
    the token there (-1: padding); each row's unit; and the response width to keep (``model_inputs``'s: up to the
    last column any row attends)."""
    attended = micro.response_attention.bool()
    columns = attended.any(0).nonzero()
    width = int(columns[-1]) + 1 if len(columns) else 1
    units: list[_Unit] = []
    keys = prompt_groups(micro) if dedup else range(len(micro))
    by_key: dict[int, int] = {}
    unit_of, predictors, places = [], [], []
    for i, key in enumerate(keys):
        in_prompt = micro.prompt_mask[i].bool()
        prompt = micro.prompt_ids[i][in_prompt]
        kept = attended[i, :width]
        u = by_key.setdefault(key, len(units))
        if u == len(units):
            units.append(_Unit([prompt]))
        start = len(units[u])  # where this row's response begins in its unit
        units[u].parts.append(micro.response_ids[i, :width][kept])
        before = torch.cumsum(kept.long(), 0) - kept.long()  # response tokens in the context before each column
        predictor = torch.where(before == 0, len(prompt) - 1, start + before - 1)
        predictors.append(torch.where(kept, predictor, -1))
        places.append(
            torch.cat(
                [torch.where(in_prompt, in_prompt.long().cumsum(0) - 1, -1), torch.where(kept, start + before, -1)]
            )
        )
        unit_of.append(u)
    return units, predictors, places, unit_of, width


@dataclass(frozen=True)
class Packing:
    """How a role's forwards pack (``use_remove_padding``; ``packing_for`` builds it from the model)."""

    dedup: bool = False  # use_prefix_grouper: one unit per distinct prompt
    pair_cost: float | None = None  # attention_pair_cost; None: rows as long as the longest unit


def attention_pair_cost(config: object) -> float | None:
    """One attended pair's multiply-adds against one position's through a decoder layer: sdpa and eager attention
    compute every pair of a packed row, masked or not, so longer rows cost more per token. Per position: the
    q/k/v/o projections and a gated MLP; per pair: scores and weighted values. None when the config lacks a size."""
    h, heads, inner = (getattr(config, k, None) for k in ("hidden_size", "num_attention_heads", "intermediate_size"))
    if not (h and heads and inner):
        return None
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return 2 * q / (h * (2 * q + 2 * kv) + 3 * h * inner)


def _first_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens in each row, and each unit's (row, first column), placing units longest first into the first row
    with room for them."""
    fill: list[int] = []
    placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for u in sorted(range(len(lengths)), key=lambda u: -lengths[u]):
        row = next((r for r, used in enumerate(fill) if used + lengths[u] <= capacity), None)
        if row is None:
            row = len(fill)
            fill.append(0)
        placed[u] = (row, fill[row])
        fill[row] += lengths[u]
    return fill, placed


def _row_length(lengths: list[int], pair_cost: float | None) -> int:
    """The packed rows' capacity: with ``pair_cost``, the one whose rows run at the least cost (each row
    ``length * (1 + pair_cost * length)``), among the shortest capacity that packs the units into each possible
    number of rows; fewer, longer rows have less padding and more attention pairs. Never past twice the longest
    unit: a row's mask, and on a CPU its attention scores, take memory in its length squared, so per token at most
    twice what a row of the longest unit takes. Without ``pair_cost`` the longest unit."""
    longest, total = max(lengths), sum(lengths)
    if pair_cost is None:
        return longest
    best: tuple[float, int] | None = None
    for rows in range(len(_first_fit(lengths, longest)[0]), 0, -1):
        capacity = max(longest, -(-total // rows))
        while len(fill := _first_fit(lengths, capacity)[0]) > rows:
            capacity += max(1, capacity // 64)
        if capacity > 2 * longest:
            break
        cost = len(fill) * max(fill) * (1 + pair_cost * max(fill))
        if best is None or cost < best[0]:
            best = (cost, capacity)
    assert best is not None
    return best[1]


def pack(
    micro: Batch,
    row_tokens: int | None = None,
    *,
    dedup: bool = False,
    pair_cost: float | None = None,
    multiple: int = 1,
    explicit_mask: bool = False,
) -> PackedInputs:
    """``micro``'s units in packed rows of at most ``row_tokens`` tokens (None: ``_row_length``'s choice, by
    ``pair_cost``; never shorter than the longest unit); ``dedup``: one unit per distinct prompt. Rows are padded to
    a ``multiple`` of columns (sequence-parallel shards); ``explicit_mask``: the 4D mask without dedup too, where a
    row holds several sequences (a row of one needs none: sdpa then runs causal, without the mask's L x L booleans
    and, on CPU, without the attention weights its masked kernel keeps)."""
    units, predictors, places, unit_of, width = _units(micro, dedup)
    lengths = [len(u) for u in units]
    fill, placed = _first_fit(lengths, max(row_tokens or _row_length(lengths, pair_cost), max(lengths)))
    length = -(-max(fill) // multiple) * multiple
    input_ids = torch.zeros(len(fill), length, dtype=micro.prompt_ids.dtype)
    position_ids = torch.zeros(len(fill), length, dtype=torch.long)
    # Each position's unit and part (the prompt 0, the k-th response k); padding gets ids of its own.
    unit_ids = -1 - torch.arange(len(fill) * length).view(len(fill), length)
    part_ids = torch.zeros(len(fill), length, dtype=torch.long)
    for u, unit in enumerate(units):
        row, start = placed[u]
        span = slice(start, start + len(unit))
        input_ids[row, span] = torch.cat(unit.parts)
        position_ids[row, span] = unit.positions()
        unit_ids[row, span] = u
        part_ids[row, span] = unit.part_ids()
    rows = torch.zeros(len(micro), width, dtype=torch.long)
    columns = torch.full((len(micro), width), -1, dtype=torch.long)
    where = torch.full((len(micro), len(places[0])), -1, dtype=torch.long)
    for i, predictor in enumerate(predictors):
        row, start = placed[unit_of[i]]
        rows[i] = row
        columns[i] = torch.where(predictor >= 0, start + predictor, -1)
        where[i] = torch.where(places[i] >= 0, row * length + start + places[i], -1)
    for row, used in enumerate(fill):  # the padding continues the row's last position: nothing before it sees it
        position_ids[row, used:] = torch.arange(length - used) + int(position_ids[row, used - 1]) + 1
    mask = None
    if dedup or explicit_mask and len(units) > len(fill):
        same_unit = unit_ids[:, :, None] == unit_ids[:, None, :]
        seen_part = (part_ids[:, None, :] == 0) | (part_ids[:, :, None] == part_ids[:, None, :])
        mask = (same_unit & seen_part & torch.ones(length, length, dtype=torch.bool).tril())[:, None]
    own = sum(len(u.parts[0]) * (len(u.parts) - 1) + len(u) - len(u.parts[0]) for u in units)
    return PackedInputs(input_ids, position_ids, mask, rows, columns, width, sum(fill), own, where)


def packed_response_logits(module: torch.nn.Module, packed: PackedInputs, device: torch.device) -> torch.Tensor:
    """Logits ``[b, width, V]`` predicting the response tokens of ``packed``'s rows from one forward; only the
    packed columns that predict a response token get logits."""
    kept = torch.unique(packed.columns[packed.columns >= 0])
    if not len(kept):  # no response token in the context (every row's masked out): one column, as padded keeps
        kept = torch.zeros(1, dtype=torch.long)
    mask = {} if packed.attention_mask is None else {"attention_mask": packed.attention_mask.to(device)}
    out = module(
        input_ids=packed.input_ids.to(device),
        position_ids=packed.position_ids.to(device),
        use_cache=False,
        logits_to_keep=kept.to(device),
        **mask,
    )
    return packed.gather(out.logits, kept.to(device))


def packing_for(model: torch.nn.Module, key: str, *, dedup: bool = False) -> Packing:
    """How ``model`` (a transformers model) packs, for ``key`` (a ``use_remove_padding`` set to true); ValueError
    naming the key when it cannot run packed rows (what validation checks for a local model directory, here for a
    hub id too), or, with ``dedup`` (``use_prefix_grouper``), when its attention is not sdpa, the one
    implementation that reads the explicit mask as given."""
    problem = packing_problem(model.config.to_dict())
    if problem is not None:
        raise ValueError(f"{key}=true: {model.config.name_or_path}: {problem}; fix: set {key}=false")
    attention = model.config._attn_implementation
    if dedup and attention != "sdpa":
        raise ValueError(
            f"actor_rollout_ref.actor.use_prefix_grouper=true: {model.config.name_or_path} runs {attention} "
            "attention, and prompt deduplication passes a 4D boolean mask only sdpa reads as given; fix: set "
            "actor_rollout_ref.actor.use_prefix_grouper=false"
        )
    return Packing(dedup=dedup, pair_cost=attention_pair_cost(model.config))
