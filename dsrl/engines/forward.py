"""Forward passes over response tokens, and how a batch is cut into micro-batches.

Alignment (verl's): the logit at sequence position ``P + t - 1`` predicts response token ``t``, so
for a ``[b, P + T]`` input the response slice of the logits (or hidden states) is
``[:, P - 1 : P + T - 1]``, i.e. ``[:, -T - 1 : -1]``. Values use the same slice.

Memory: only the ``T + 1`` last positions of the logits are materialised (``logits_to_keep``), and
the float32 softmax statistics are computed ``chunk_rows`` positions at a time, so ``[B, T, V]``
probabilities never exist at once; under autograd each chunk is checkpointed (recomputed in
backward) so the saved state is the model-dtype logits only. The fused head (``use_fused_kernels``,
``head_stats``) goes further: the model hands back its final hidden states, and each chunk's logits are
computed from them by the output projection and dropped, so no logit-sized tensor exists at all.

Micro-batches: by count (consecutive rows) or by token budget (``use_dynamic_bsz``). The budget
bounds the padded rectangle each forward really runs, ``b * (max prompt length + max response
length)`` over the micro-batch's ``b`` rows (``model_inputs`` drops only the columns that are padding
in every row), not the valid tokens: a micro-batch mixing one long row with many short ones has few
valid tokens but the activations of ``b`` long rows. So rows are sorted by length (response, then
prompt) and cut into contiguous runs, which keeps both maxima close to every row's own lengths.
Every rank must run the same number of forward/backward passes (ZeRO-3 gathers parameters
collectively in each forward), so the number of micro-batches is agreed across ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from dsrl.algorithms import (
    entropy_from_logits,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)
from dsrl.data.batch import Batch, last_response_token
from dsrl.engines.packing import PackedInputs, Packing, pack, packed_response_logits, prompt_groups
from dsrl.engines.routers import RouteReplay
from dsrl.engines.sequence_parallel import SequenceParallel, group_budget
from dsrl.runtime.distributed import accelerator_device, all_reduce

# Float32 elements of one chunk of logits (2**26 * 4 bytes = 256 MiB): a few such temporaries live at once.
CHUNK_ELEMENTS = 2**26


@dataclass
class PassTally:
    """What one pass's forwards ran (``perf/padding_ratio``, ``perf/dedup_ratio``, ``perf/micro_batches/*``)."""

    micro_batches: int = 0
    positions: int = 0  # input positions, padding included
    tokens: int = 0  # real tokens among them (with dedup, each distinct prompt once per micro-batch)
    sequence_tokens: int = 0  # the rows' own tokens, each row's prompt counted: what runs without dedup
    routes_agreed: int = 0  # routing replay: the routers' own choices among the recorded experts
    routes_compared: int = 0  # ... out of this many recorded choices (moe/route_agreement/<pass>)

    def add(self, positions: int, tokens: int, sequence_tokens: int | None = None) -> None:
        self.micro_batches += 1
        self.positions += positions
        self.tokens += tokens
        self.sequence_tokens += tokens if sequence_tokens is None else sequence_tokens


def _padded_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Per row: prompt columns from its first valid token to the end (prompts are left-padded), and
    response columns up to its last valid token (right-padded; mask holes count as columns)."""
    P = batch.prompt_mask.shape[1]
    prompt = (torch.arange(P, 0, -1) * (batch.prompt_mask.cpu() != 0)).amax(-1)
    response = last_response_token(batch.response_mask.cpu()) + 1
    return prompt.tolist(), response.tolist()


def _rectangles(rows: list[int], prompt: list[int], response: list[int], groups: list[int] | None) -> list[int]:
    """``k * (max prompt + max response columns)`` of ``rows[:k]`` for k = 1 .. len(rows): the
    ``[k, columns]`` input ``model_inputs`` builds (it keeps at least one response column). Packed (``groups``
    given, per row): the tokens of ``rows[:k]`` themselves, what a packed forward runs, a prompt once per group."""
    if groups is None:
        prompts, responses = accumulate((prompt[i] for i in rows), max), accumulate((response[i] for i in rows), max)
        return [k * (p + max(1, r)) for k, (p, r) in enumerate(zip(prompts, responses, strict=True), 1)]
    seen: set[int] = set()
    tokens = []
    for i in rows:
        tokens.append(max(1, response[i]) + (0 if groups[i] in seen else prompt[i]))
        seen.add(groups[i])
    return list(accumulate(tokens))


def _best_cut(run: list[int], prompt: list[int], response: list[int], groups: list[int] | None) -> int:
    """Where to cut ``run`` (2+ rows) in two: the smallest larger rectangle, then the most even halves."""
    heads, tails = _rectangles(run, prompt, response, groups), _rectangles(run[::-1], prompt, response, groups)
    m = len(run)  # run[:c] spans heads[c - 1], run[c:] spans tails[m - c - 1]
    return min(range(1, m), key=lambda c: (max(heads[c - 1], tails[m - c - 1]), abs(2 * c - m)))


def micro_batch_indices(
    batch: Batch,
    *,
    micro_batch_size: int,
    max_token_len: int | None,
    key: str = "max_token_len",
    packing: Packing | None = None,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch of ``batch`` (collective when ``max_token_len`` is set).

    ``max_token_len is None``: consecutive chunks of ``micro_batch_size`` rows. Otherwise every part
    keeps the rectangle ``model_inputs`` runs, ``len(part) * (max prompt + max response columns)``,
    within ``max_token_len``. Rows sorted by (response, prompt) length are cut greedily into
    contiguous runs: the fewest parts for that order, since a run's rectangle only grows as it
    extends. Responses lead the sort because they spread widest (a few tokens up to the maximum
    response length); sorting by prompt + response instead lets a run mix long prompts with long
    responses, which on skewed lengths costs more parts and area. The count is agreed over ranks
    (the maximum any rank needs); a rank that needs fewer parts splits its part with the largest
    rectangle in two until it has as many, which keeps every part within the budget and non-empty.
    Only a rank with fewer rows than the agreed count gets empty trailing parts (does not arise:
    callers pass equal row counts on every rank, and a rank never needs more parts than rows).
    Row indices within a part are ascending. ``key`` names the config field of the budget in errors.
    ``packing`` (``use_remove_padding``): the budget counts each part's own tokens, not its rectangle; with its
    ``dedup`` (``use_prefix_grouper``) rows with the same prompt are kept together (sorted by prompt, then
    response) and a part counts its prompt once.
    """
    n = len(batch)
    if max_token_len is None:
        return list(torch.arange(n).split(micro_batch_size))
    prompt, response = _padded_lengths(batch)
    longest = max((prompt[i] + max(1, response[i]) for i in range(n)), default=0)
    if longest > max_token_len:
        raise ValueError(
            f"{key}={max_token_len}: a sequence spans {longest} tokens (prompt + response) and cannot fit; "
            "set it to at least max_prompt_length + max_response_length"
        )
    dedup = packing is not None and packing.dedup
    groups = None if packing is None else prompt_groups(batch) if dedup else list(range(n))
    order = sorted(range(n), key=lambda i: (groups[i] if dedup and groups is not None else 0, response[i], prompt[i]))
    parts: list[list[int]] = []
    seen: set[int] = set()  # the last part's prompt groups
    prompt_max = response_max = used = 0  # of the last part (used: its tokens, when packed)
    for i in order:
        p, r = max(prompt_max, prompt[i]), max(response_max, response[i])
        if groups is None:
            cost = (len(parts[-1]) + 1 if parts else 1) * (p + max(1, r))
        else:
            cost = used + max(1, response[i]) + (0 if groups[i] in seen else prompt[i])
        if not parts or cost > max_token_len:
            parts.append([])
            seen, p, r, cost = set(), prompt[i], response[i], prompt[i] + max(1, response[i])
        parts[-1].append(i)
        if groups is not None:
            seen.add(groups[i])
        prompt_max, response_max, used = p, r, cost
    (num_parts,) = all_reduce(torch.tensor([len(parts)]), op="max").tolist()
    while len(parts) < num_parts and any(len(part) > 1 for part in parts):
        splittable = [j for j, part in enumerate(parts) if len(part) > 1]
        j = max(splittable, key=lambda j: _rectangles(parts[j], prompt, response, groups)[-1])
        cut = _best_cut(parts[j], prompt, response, groups)
        parts[j : j + 1] = [parts[j][:cut], parts[j][cut:]]
    parts += [[] for _ in range(num_parts - len(parts))]
    return [torch.tensor(sorted(part), dtype=torch.long) for part in parts]


def model_inputs(micro: Batch, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """Model inputs of ``micro`` without its all-padding columns, and the response width kept.

    Left prompt columns that are padding in every row and response columns after the last valid
    token of every row carry nothing; dropping them changes no valid position's output.
    """
    prompt_cols = micro.prompt_mask.any(0).nonzero()
    first = int(prompt_cols[0]) if len(prompt_cols) else micro.prompt_mask.shape[1]
    response_cols = micro.response_mask.any(0).nonzero()
    width = int(response_cols[-1]) + 1 if len(response_cols) else 1
    trimmed = micro.replace(
        prompt_ids=micro.prompt_ids[:, first:],
        prompt_mask=micro.prompt_mask[:, first:],
        response_ids=micro.response_ids[:, :width],
        response_mask=micro.response_mask[:, :width],
        response_attention_mask=None
        if micro.response_attention_mask is None
        else micro.response_attention_mask[:, :width],
    )
    inputs = {
        "input_ids": trimmed.input_ids.to(device),
        "attention_mask": trimmed.attention_mask.to(device),
        "position_ids": trimmed.position_ids.to(device),
    }
    return inputs, width


def padded_positions(micro: Batch, inputs: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """``[b, P + width]``: where each prompt and response column of ``micro`` sits in ``model_inputs``' flattened
    ``inputs`` (``r * columns + l``), -1 for a dropped or padding column (``RouteReplay.install``)."""
    b, columns = inputs["input_ids"].shape
    P = micro.prompt_ids.shape[1]
    first = P - (columns - width)
    column = torch.arange(P + width) - first
    where = torch.arange(b)[:, None] * columns + column
    attended = torch.cat([micro.prompt_mask, micro.response_attention[:, :width]], dim=1).cpu() != 0
    return torch.where(attended & (column >= 0), where, -1)


def response_logits(module: torch.nn.Module, inputs: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """Logits ``[b, width, V]`` predicting the ``width`` response tokens (positions ``-width-1 .. -2``)."""
    out = module(**inputs, use_cache=False, logits_to_keep=width + 1)
    return out.logits[:, :-1]


def kv_cache(out) -> tuple[str, object]:
    """(name, value) of a forward output's KV cache: transformers 5.20+ calls it ``cache`` (as output and as
    argument), earlier versions ``past_key_values``; pass it back as ``**{name: value}``."""
    name = "cache" if "cache" in out else "past_key_values"
    return name, out[name]


def policy_logits(
    module: torch.nn.Module,
    micro: Batch,
    device: torch.device,
    *,
    share_prompts: bool,
    packing: Packing | None = None,
    tally: PassTally | None = None,
    replay: RouteReplay | None = None,
) -> tuple[torch.Tensor, int]:
    """Logits ``[b, width, V]`` predicting ``micro``'s response tokens, and ``width`` (``model_inputs``).

    ``share_prompts``: rows with the same prompt (a group's responses) run it once. One forward over
    the distinct prompts returns their KV cache and last logit; the cache is indexed out to every row
    (autograd carries each row's gradient back to its prompt) and a second forward runs the response
    columns on top. The same function of the parameters with fewer rows through the prompt: GRPO with
    ``n`` responses runs ``(n - 1) / n`` fewer prompt tokens; values differ from the single forward
    only by float rounding (other batch shapes, gradients summed over a group in another order).
    Needs a cache under autograd, so not with gradient checkpointing (the config refuses the pair).
    Two forwards even when every prompt differs: under ZeRO-3 each forward gathers the layers
    collectively, so every rank must run as many as the others. ``packing``: one forward over the micro-batch's
    sequences without padding, with its ``dedup`` each distinct prompt once in them (``dsrl.engines.packing``;
    never with ``share_prompts``, which needs a cache). ``tally``: what the forward ran is added to it.
    ``replay``: the forward runs ``micro``'s recorded experts (``RouteReplay``; not with ``share_prompts``).
    """
    tally = tally or PassTally()
    if packing is not None:
        rows = pack(micro, dedup=packing.dedup, pair_cost=packing.pair_cost)
        tally.add(rows.input_ids.numel(), rows.tokens, rows.sequence_tokens)
        if replay is not None:
            replay.install(micro, rows.where, rows.input_ids.numel(), device, tally)
        return packed_response_logits(module, rows, device), rows.width
    inputs, width = model_inputs(micro, device)
    attended = int(inputs["attention_mask"].sum())
    if replay is not None:
        assert not share_prompts, "the config refuses routing replay with shared_prompt_forward"
        replay.install(micro, padded_positions(micro, inputs, width), inputs["input_ids"].numel(), device, tally)
    if share_prompts:
        P = inputs["input_ids"].shape[1] - width
        prompts = torch.cat([inputs["input_ids"][:, :P], inputs["attention_mask"][:, :P]], dim=1)
        _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
        distinct = int(inverse.max()) + 1
        rows = torch.arange(len(inverse), device=inverse.device)
        first = torch.full((distinct,), len(inverse), device=inverse.device).scatter_reduce_(0, inverse, rows, "amin")
        head = module(**{k: v[first, :P] for k, v in inputs.items()}, use_cache=True, logits_to_keep=1)
        name, cache = kv_cache(head)
        cache.batch_select_indices(inverse)
        tail = module(
            input_ids=inputs["input_ids"][:, P:],
            attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"][:, P:],
            use_cache=True,
            logits_to_keep=width,
            **{name: cache},
        )
        ran = int(inputs["attention_mask"][first, :P].sum() + inputs["attention_mask"][:, P:].sum())
        tally.add(distinct * P + inputs["input_ids"][:, P:].numel(), ran, attended)
        return torch.cat([head.logits[inverse], tail.logits[:, :-1]], dim=1), width
    tally.add(inputs["input_ids"].numel(), attended)
    return response_logits(module, inputs, width), width


def _chunks(b: int, t: int, rows: int) -> list[tuple]:
    """Indices into ``[b, t, ...]`` that cover it with at most ``rows`` positions each: blocks of whole
    sequences when one fits, else equal pieces of one sequence. They give views even of the actor's
    non-contiguous ``[:, :-1]`` logits, which flattening ``[b, t]`` would copy."""
    if rows >= t:
        k = rows // t
        return [(slice(i, i + k),) for i in range(0, b, k)]
    pieces = -(-t // rows)
    size = -(-t // pieces)
    return [(i, slice(s, s + size)) for i in range(b) for s in range(0, t, size)]


def _stat_names(with_entropy: bool, with_sum_pi_squared: bool) -> list[str]:
    """The statistics ``_chunk_stats`` returns, in its order."""
    return ["log_probs"] + ["entropy"] * with_entropy + ["sum_pi_squared"] * with_sum_pi_squared


def _chunk_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool, with_sum_pi_squared: bool
) -> list[torch.Tensor]:
    """Float32 log-probs of one chunk, then its entropy and sum of squared probabilities when asked."""
    z = logits.float() / temperature
    stats = [logprobs_from_logits(z, labels)]
    if with_entropy:
        stats.append(entropy_from_logits(z))
    if with_sum_pi_squared:
        stats.append(sum_pi_squared_from_logits(z))
    return stats


def _chunk_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient with respect to one chunk of logits, its softmax recomputed."""
    logits = logits.detach().requires_grad_()
    with torch.enable_grad():
        stats = _chunk_stats(logits, labels, temperature, grad_entropy is not None, False)
    outputs, grads = zip(
        *((s, g) for s, g in zip(stats, (grad_log_probs, grad_entropy), strict=False) if g is not None), strict=True
    )
    return torch.autograd.grad(outputs, logits, grads)[0]


class _ResponseStats(torch.autograd.Function):
    """``response_stats`` as one autograd node that keeps only its input: backward recomputes each
    chunk's softmax (checkpointing) and writes its gradient into one buffer the size of the logits.
    Autograd through per-chunk slices would instead add up one zero-padded full-size gradient per chunk."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, with_entropy, with_sum_pi_squared, entropy_grad, rows):
        b, t, _ = logits.shape
        ctx.chunks, ctx.temperature = _chunks(b, t, rows), temperature
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels)
        stats = [torch.empty(b, t, dtype=torch.float32, device=logits.device)]
        stats += [torch.empty_like(stats[0]) for _ in range(with_entropy + with_sum_pi_squared)]
        for idx in ctx.chunks:
            values = _chunk_stats(logits[idx], labels[idx], temperature, with_entropy, with_sum_pi_squared)
            for out, value in zip(stats, values, strict=True):
                out[idx] = value
        # Outputs after log_probs (entropy, when not differentiated, and sum_pi_squared) get no gradient.
        ctx.mark_non_differentiable(*stats[1 + (with_entropy and entropy_grad) :])
        return tuple(stats)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, *grad_rest):
        grad_entropy = grad_rest[0] if grad_rest else None  # None unless entropy is differentiated
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 7
        logits, labels = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in ctx.chunks:
            grad[idx] = _chunk_grad(
                logits[idx],
                labels[idx],
                ctx.temperature,
                None if grad_log_probs is None else grad_log_probs[idx],
                None if grad_entropy is None else grad_entropy[idx],
            )
        return grad, None, None, None, None, None, None


def response_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = False,
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token statistics of the softmax of ``logits / temperature``, chunk by chunk.

    logits [b, T, V] (any float dtype, any strides), labels [b, T] -> float32 [b, T] tensors:
    ``log_probs`` = log pi(labels), ``entropy`` = -sum_v pi_v log pi_v (when ``with_entropy``),
    ``sum_pi_squared`` = sum_v pi_v^2 (when ``with_sum_pi_squared``; never differentiated).
    Gradients flow into ``log_probs``, and into ``entropy`` only with ``entropy_grad``.
    At most ``chunk_rows`` positions are processed at a time (default: ~``CHUNK_ELEMENTS`` logits).
    Backward holds one ``logits``-sized gradient and one chunk's float32 temporaries (``_ResponseStats``).
    """
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // logits.shape[-1])
    stats = _ResponseStats.apply(logits, labels, temperature, with_entropy, with_sum_pi_squared, entropy_grad, rows)
    names = _stat_names(with_entropy, with_sum_pi_squared)
    return dict(zip(names, stats, strict=True))


# Config attributes of models whose logits are more than the output projection of the final hidden states.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def fused_head_for(model: torch.nn.Module, enabled: bool) -> torch.nn.Module | None:
    """The output projection the fused head computes log-probs with (``enabled``: ``use_fused_kernels``), else
    None; ValueError when ``model``'s logits are not that projection of its hidden states alone."""
    if not enabled:
        return None
    key, name = "actor_rollout_ref.actor.use_fused_kernels", model.config.name_or_path
    transforms = [key for key in _LOGIT_TRANSFORMS if getattr(model.config, key, None) not in (None, 1, 1.0)]
    head = model.get_output_embeddings()
    if transforms or not isinstance(getattr(head, "out_features", None), int):
        problem = f"it transforms its logits ({', '.join(transforms)})" if transforms else "no linear output layer"
        raise ValueError(f"{key}=true: {name}: {problem}, which the fused head does not compute; fix: set {key}=false")
    return head


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@contextmanager
def hidden_states_out(head: torch.nn.Module) -> Iterator[None]:
    """Inside, the output projection ``head`` hands back its input, the final hidden states at the kept positions,
    instead of logits: the forward paths above then give ``[b, width, H]`` where they gave ``[b, width, V]``. An
    instance attribute shadows the class's ``forward``, so ZeRO-3's hooks on ``head`` still run on every rank."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


# ZeRO-3 releases the output layer's gathered weight after each call of it, so the recomputed chunk's saved weight
# is the partitioned parameter when checkpoint compares it; ZeRO-3 gathers it again before its backward reads it.
RECOMPUTE = {"use_reentrant": False, "determinism_check": "none"}


def _head_chunk(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_sum_pi_squared: bool,
) -> tuple[torch.Tensor, ...]:
    return tuple(_chunk_stats(head(hidden), labels, temperature, with_entropy, with_sum_pi_squared))


def head_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = False,
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """``response_stats``'s statistics from the final hidden states ``[b, T, H]`` and the output projection
    ``head`` (the fused head, ``use_fused_kernels``): ``chunk_rows`` positions at a time (default ~``CHUNK_ELEMENTS``
    logits), each chunk's logits computed by ``head`` and dropped once its statistics are. Under autograd each chunk
    is checkpointed: backward recomputes its logits, and autograd sums the chunks' gradients of ``head``'s weight
    before its one accumulation, as for any weight used twice (a tied embedding's too), so ZeRO-3 reduces it once.
    Collective: each call of ``head`` gathers its ZeRO-3 parameters, so the chunk count is agreed over ranks."""
    b, t, hidden_size = hidden.shape
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // head.out_features)
    (count,) = all_reduce(torch.tensor([max(1, -(-b * t // rows))]), op="max").tolist()
    sizes = [len(part) for part in torch.arange(b * t).tensor_split(count)]
    differentiated = torch.is_grad_enabled() and hidden.requires_grad
    pieces = []
    for h, y in zip(hidden.reshape(b * t, hidden_size).split(sizes), labels.reshape(b * t).split(sizes), strict=True):
        args = (head, h, y, temperature, with_entropy, with_sum_pi_squared)
        pieces.append(checkpoint(_head_chunk, *args, **RECOMPUTE) if differentiated else _head_chunk(*args))
    stats = [torch.cat(column).view(b, t) for column in zip(*pieces, strict=True)]
    names = _stat_names(with_entropy, with_sum_pi_squared)
    out = dict(zip(names, stats, strict=True))
    for name in names[1 + (with_entropy and entropy_grad) :]:  # as response_stats: no gradient
        out[name] = out[name].detach()
    return out


def policy_stats(
    module: torch.nn.Module,
    micro: Batch,
    device: torch.device,
    *,
    temperature: float,
    share_prompts: bool = False,
    packing: Packing | None = None,
    fused_head: torch.nn.Module | None = None,
    tally: PassTally | None = None,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = False,
    sp: SequenceParallel | None = None,
    replay: RouteReplay | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """``response_stats`` of ``micro``'s response tokens ``[b, width]`` from one ``policy_logits`` forward, and
    ``width``. ``fused_head`` (the model's output projection, ``use_fused_kernels``): from its hidden states through
    ``head_stats`` instead, never holding the logits. ``sp`` (with ``packing``): this rank's shard of the packed
    rows, the group's statistics summed (``sequence_parallel_stats``). ``replay``: see ``policy_logits``."""
    flags = {"with_entropy": with_entropy, "with_sum_pi_squared": with_sum_pi_squared, "entropy_grad": entropy_grad}
    forward = partial(policy_logits, share_prompts=share_prompts, packing=packing, tally=tally, replay=replay)
    if sp is not None:
        assert replay is None, "the config refuses routing replay with sequence parallelism"
        assert packing is not None, "sequence parallelism runs packed rows (the config requires use_remove_padding)"
        tally = tally or PassTally()
        return sequence_parallel_stats(module, micro, device, sp, packing, fused_head, tally, temperature, flags)
    labels = micro.response_ids.to(device)
    if fused_head is None:
        logits, width = forward(module, micro, device)
        return response_stats(logits, labels[:, :width], temperature=temperature, **flags), width
    with hidden_states_out(fused_head):
        hidden, width = forward(module, micro, device)
    return head_stats(fused_head, hidden, labels[:, :width], temperature=temperature, **flags), width


@dataclass
class SequenceShard:
    """This rank's column shard ``[start, end)`` of a micro-batch's packed rows (``dsrl.engines.sequence_parallel``)
    and the response tokens predicted inside it."""

    rows: PackedInputs
    start: int
    end: int
    owned: torch.Tensor  # [b, width] bool: the response tokens whose predicting position lies in the shard

    def inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The model's inputs: the shard's ids and positions, with the whole rows' mask where they need one."""
        window = slice(self.start, self.end)
        inputs = {"input_ids": self.rows.input_ids[:, window], "position_ids": self.rows.position_ids[:, window]}
        if self.rows.attention_mask is not None:
            inputs["attention_mask"] = self.rows.attention_mask
        return {name: value.to(device) for name, value in inputs.items()}

    @property
    def count(self) -> int:
        return int(self.owned.sum())

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed row, shard column) of each owned token, in ``owned`` order; one (0, 0) stands in where there is
        none, its statistics weighted 0 by ``spread``, so that every rank runs the same head (ZeRO-3 gathers a
        head's weights collectively, in backward too)."""
        if not self.count:
            return torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        return self.rows.rows[self.owned], self.rows.columns[self.owned] - self.start

    def spread(self, sp: SequenceParallel, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """``[b, width]``: the group's sum of its ranks' ``value`` (per ``positions``) put in place. ``anchor`` (a
        zero on the shard's output) keeps every layer in this rank's backward, whose all-to-alls are collective
        whether or not a response token was predicted in its shard."""
        where = tuple(self.owned.nonzero().T.to(value.device))
        placed = value.new_zeros(self.owned.shape).index_put(where, value[: self.count])
        return sp.gathered(placed + anchor + value.sum() * 0)


def sequence_parallel_shard(micro: Batch, sp: SequenceParallel, packing: Packing, tally: PassTally) -> SequenceShard:
    """This rank's shard of ``micro``'s packed rows, cut into ``sp.size`` equal column shards. The whole micro-batch
    is tallied once, on the group's first rank."""
    rows = pack(micro, dedup=packing.dedup, pair_cost=packing.pair_cost, multiple=sp.size, explicit_mask=True)
    width = rows.input_ids.shape[1] // sp.size
    start = sp.rank * width
    first = sp.rank == 0
    tally.add(rows.input_ids.numel() * first, rows.tokens * first, rows.sequence_tokens * first)
    owned = (rows.columns >= start) & (rows.columns < start + width)
    return SequenceShard(rows, start, start + width, owned)


def sequence_parallel_stats(
    module: torch.nn.Module,
    micro: Batch,
    device: torch.device,
    sp: SequenceParallel,
    packing: Packing,
    fused_head: torch.nn.Module | None,
    tally: PassTally,
    temperature: float,
    flags: dict[str, bool],
) -> tuple[dict[str, torch.Tensor], int]:
    """``policy_stats`` of ``micro`` on this rank's shard (``sequence_parallel_shard``): the statistics of the
    response tokens predicted inside it, summed over the group into ``[b, width]``."""
    shard = sequence_parallel_shard(micro, sp, packing, tally)
    rows_at, columns_at = shard.positions()
    kept = torch.unique(columns_at)
    with nullcontext() if fused_head is None else hidden_states_out(fused_head):
        out = module(**shard.inputs(device), use_cache=False, logits_to_keep=kept.to(device))
    picked = out.logits[rows_at.to(device), torch.searchsorted(kept, columns_at).to(device)][None]
    width = shard.rows.width
    labels = micro.response_ids[:, :width][shard.owned] if shard.count else torch.zeros(1, dtype=torch.long)
    head = response_stats if fused_head is None else partial(head_stats, fused_head)
    stats = head(picked, labels.to(device)[None], temperature=temperature, **flags)
    anchor = out.logits.sum() * 0
    return {name: shard.spread(sp, value[0], anchor) for name, value in stats.items()}, width


def pad_response(values: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad ``[b, w]`` with zeros to ``[b, width]`` (back to the batch's response width)."""
    return F.pad(values, (0, width - values.shape[1]))


def compute_response_stats(
    module,
    batch: Batch,
    *,
    temperature: float,
    micro_batch_size: int,
    max_token_len: int | None,
    budget_key: str,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    share_prompts: bool = False,
    packing: Packing | None = None,
    fused_head: torch.nn.Module | None = None,
    tally: PassTally | None = None,
    sp: SequenceParallel | None = None,
    replay: RouteReplay | None = None,
) -> dict[str, torch.Tensor]:
    """No-grad forward of ``batch`` in micro-batches (``micro_batch_indices``), outputs put back in
    row order: ``[B, T]`` float32 ``old_log_probs`` (+ ``entropy``, ``sum_pi_squared``), 0 on
    response padding, on the batch's device. ``share_prompts``, ``packing``, ``fused_head``, ``tally``, ``sp``: see
    ``policy_stats``; with ``sp`` the group runs each member's batch in turn, in micro-batches of ``sp`` times the
    token budget (verl's), and this rank keeps its own. ``replay``: the forwards run the batch's recorded experts
    (none recorded: their own), and ``prompt_routes`` and ``response_routes`` come back too, what each token ran.
    Collective (ZeRO-3 forwards, micro-batch count)."""
    names = {"log_probs": "old_log_probs", "entropy": "entropy", "sum_pi_squared": "sum_pi_squared"}
    budget = None if max_token_len is None else group_budget(max_token_len, sp)

    def run(rows: Batch) -> dict[str, torch.Tensor]:
        B, T = rows.response_ids.shape
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for idx in micro_batch_indices(
                rows, micro_batch_size=micro_batch_size, max_token_len=budget, key=budget_key, packing=packing
            ):
                stats, _ = policy_stats(
                    module,
                    rows.select(idx),
                    accelerator_device(),
                    temperature=temperature,
                    share_prompts=share_prompts,
                    packing=packing,
                    fused_head=fused_head,
                    tally=tally,
                    with_entropy=with_entropy,
                    with_sum_pi_squared=with_sum_pi_squared,
                    sp=sp,
                    replay=replay,
                )
                for name, value in stats.items():
                    field = names[name]
                    if field not in out:
                        out[field] = torch.zeros(B, T, dtype=torch.float32)
                    out[field][idx] = pad_response(value.float().cpu(), T)
                if replay is not None:
                    prompt_routes, response_routes = replay.recorded()
                    if "prompt_routes" not in out:
                        for name, columns in (("prompt_routes", rows.prompt_ids.shape[1]), ("response_routes", T)):
                            out[name] = torch.full((B, columns, *replay.shape), -1, dtype=torch.int16)
                    out["prompt_routes"][idx] = prompt_routes
                    out["response_routes"][idx, : response_routes.shape[1]] = response_routes
        if replay is not None:
            replay.release()
        return out

    kept = run(batch) if sp is None else sp.each_member(batch, run)
    mask = batch.response_mask.float().cpu()
    return {
        name: (value if name.endswith("_routes") else value * mask).to(batch.response_ids.device)
        for name, value in kept.items()
    }
