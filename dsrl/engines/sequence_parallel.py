"""Ulysses sequence parallelism (``actor_rollout_ref.actor.ulysses_sequence_parallel_size``) on DeepSpeed's ALST.

Groups of ``sp`` consecutive ranks (DeepSpeed's ``parallel_state_sp``) run their members' micro-batches together,
one member's at a time ("SP over DP", as ALST's data-loader adapter does): every rank keeps the rows it generated,
and the batch arithmetic is the data-parallel one. A micro-batch's packed rows are cut into ``sp`` equal column
shards; each rank runs its shard through the model, and DeepSpeed's ``UlyssesSPAttentionHF`` trades sequence shards
for head shards around attention (all-to-all), so each rank attends over whole rows for ``heads / sp`` heads.

The mask: ALST's own transformers wrapper drops the attention mask (flash attention's varlen reads packing from
the position ids), under which sdpa would let packed sequences attend to each other. Here, where a row holds
several sequences (or with ``use_prefix_grouper``, whose responses see their shared prompt), the explicit 4D mask of
the whole packed rows goes in as the model's attention mask: transformers hands a 4D mask to the attention function
as given, and the core sdpa reads it at full length after the all-to-all. Rows of one sequence each run causal,
without a mask (``pack``'s ``explicit_mask``).

Each rank computes the statistics (log-probs, ...) of the response tokens whose predicting position lies in its
shard; ``gathered`` sums the ranks' parts, so every rank of the group holds the micro-batch's whole statistics and
computes the same loss from them. Its backward passes the gradient through unchanged: each token's gradient then
flows back from its own rank alone, and the group's gradients add up to the micro-batch's once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Result = TypeVar("Result")
ATTENTION = "dsrl_ulysses"  # the attention implementation name the sequence-parallel models run


class SequenceParallel:
    """This rank's sequence-parallel group of ``size`` consecutive ranks (collective to create). One per process:
    DeepSpeed keeps the groups in module state (``sequence_parallel_for`` hands out the one)."""

    def __init__(self, size: int):
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

        world = dist.get_world_size()
        if world % size:
            raise ValueError(
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size} does not divide the {world} ranks; "
                "fix: launch a multiple of it (deepspeed --num_gpus N)"
            )
        groups.initialize_sequence_parallel(sequence_parallel_size=size)
        self.size = size
        self.group = groups.get_sequence_parallel_group()
        self.rank = dist.get_rank(self.group)
        self._attention: dict[tuple[int, int], Any] = {}

    def apply(self, model: torch.nn.Module) -> None:
        """Make ``model`` (a transformers model loaded with sdpa) run its attention sequence-parallel."""
        from transformers import AttentionInterface

        attention = model.config._attn_implementation
        if attention != "sdpa":
            raise ValueError(
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={self.size}: {model.config.name_or_path} "
                f"runs {attention} attention; sequence parallelism here runs sdpa with the packed rows' mask; fix: "
                "load it with sdpa (transformers' default), or set the key to 1"
            )
        AttentionInterface.register(ATTENTION, _ulysses_attention)
        model.set_attn_implementation(ATTENTION)

    def attention(self, batch_size: int, module: torch.nn.Module) -> Any:
        """ALST's attention for ``batch_size`` rows of ``module``'s model (it fixes the row count when built)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        config = module.config
        key = (batch_size, id(config))
        if key not in self._attention:
            self._attention[key] = UlyssesSPAttentionHF(
                attn=sdpa_attention_forward,
                batch_size=batch_size,
                attn_head_count=config.num_attention_heads,
                attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                kv_head_count=config.num_key_value_heads,
                num_hidden_layers=config.num_hidden_layers,
                process_group=self.group,
                seq_length_is_variable=True,
            )
        return self._attention[key]

    def members(self, batch: Any) -> list[Any]:
        """The batches of the group's members, in rank order (this rank's own at ``self.rank``)."""
        batches: list[Any] = [None] * self.size
        dist.all_gather_object(batches, batch.to("cpu"), group=self.group)
        return batches

    def each_member(self, batch: Any, run: Callable[[Any], Result]) -> Result:
        """``run`` over every member's batch in turn (their forwards are the group's collectives); this rank's own
        result."""
        results = [run(rows) for rows in self.members(batch)]  # small: per-token statistics of a rank's rows
        return results[self.rank]

    def gathered(self, part: torch.Tensor) -> torch.Tensor:
        """The sum of the group's ``part``s (each rank's statistics, zero elsewhere); the gradient passes through."""
        return _SumParts.apply(part, self.group)


def group_budget(tokens: int, sp: SequenceParallel | None) -> int:
    """A micro-batch's token budget from a per-rank one: with ``sp``, the group's ranks' together (verl's)."""
    return tokens * (sp.size if sp is not None else 1)


_ACTIVE: SequenceParallel | None = None


def sequence_parallel_for(model: torch.nn.Module, size: int) -> SequenceParallel | None:
    """The process's groups of ``size`` ranks (made on the first call: every rank builds its engines in the same
    order), with ``model``'s attention run through them (``apply``); None for size 1."""
    global _ACTIVE
    if size == 1:
        return None
    if _ACTIVE is None:
        _ACTIVE = SequenceParallel(size)
    assert _ACTIVE.size == size, "the actor's size is the process's (validation refuses the reference's own)"
    _ACTIVE.apply(model)
    return _ACTIVE


def _ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The attention function of sequence-parallel models: ALST's all-to-all around sdpa, with the whole rows' mask
    (see the module docstring)."""
    assert _ACTIVE is not None
    return _ACTIVE.attention(query.shape[0], module).forward(module, query, key, value, attention_mask, *args, **kwargs)


class _SumParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
