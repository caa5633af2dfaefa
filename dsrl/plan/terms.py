"""The terms of the memory plan: what one thing holds in a phase, in bytes per rank on the device and on the host
(``Term``), counted from the model's shape and the ``PlanInputs``: an engine's resident states and its update's
gradients, DeepSpeed's buffers, a micro-batch's activations, the log-prob head, and the rollout engine with its KV
budget. No torch: the engines' constants the terms need are restated here. The formulas and why:
docs/architecture.md, section 13."""

from __future__ import annotations

from dataclasses import dataclass

from dsrl.plan.inputs import Device, Pass, PlanInputs, ZeroSetup
from dsrl.plan.shape import DTYPE_BYTES, GIB, ModelShape, kv_bytes_per_token

# dsrl.engines.forward.CHUNK_ELEMENTS and dsrl.engines.weight_sync.DEFAULT_BUCKET_BYTES, restated here (this
# module must not import torch); a test keeps them equal.
LOGIT_CHUNK_ELEMENTS = 2**26
PUSH_BUCKET_BYTES = 256 * 2**20
LOGIT_CHUNK_TEMPORARIES = 3  # float32 tensors of one chunk alive at once: the scaled logits, log-softmax, gather
# vLLM's device memory that is neither weights nor KV cache: its profiled activation peak, the sampler's logits
# and CUDA graphs. Not derivable from the shapes; an assumption, unverified on GPU.
VLLM_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class Term:
    """One line of a phase: bytes per rank on the device and on the host, and how they were counted."""

    name: str
    device: int = 0
    host: int = 0
    note: str = ""


@dataclass(frozen=True)
class KvBudget:
    """The rollout's KV cache per engine (tokens it holds) against what one step generates."""

    tokens: int
    needed: int
    sequence: int  # prompt + response length

    def describe(self) -> str:
        at_once = self.tokens // self.sequence
        wanted = self.needed // self.sequence
        enough = "all at once" if at_once >= wanted else f"~{at_once:,} sequences at a time"
        return (f"KV cache: {self.tokens:,} tokens per engine; a step needs {self.needed:,} "
                f"({wanted:,} sequences x {self.sequence:,} tokens): {enough}")  # fmt: skip


def model_states(role: str, zero: ZeroSetup, params: int, trained: int, b: int, N: int) -> list[Term]:
    """The resident states of a DeepSpeed engine (``trained`` 0: the reference, no optimizer). ZeRO-3's gradient
    partition is allocated once and stays; the gradients of stages 1-2 live in the update only
    (``update_gradients``)."""
    stage3 = zero.stage == 3
    pinned = " (pinned)" if zero.pinned else ""
    lp = b * params // N if stage3 else b * params
    terms = [Term(f"{role} parameters", *((0, lp) if stage3 and zero.offload_param else (lp, 0)),
                  f"{b} B x {params / 1e6:,.1f} M" + (f" / {N}" if stage3 else "")
                  + (pinned if zero.offload_param else ""))]  # fmt: skip
    if not trained:
        return terms
    oo = zero.offload_optimizer
    where = (lambda size: (0, size)) if oo else (lambda size: (size, 0))
    if stage3:
        g = DTYPE_BYTES[zero.grad_accum_dtype] if zero.grad_accum_dtype else b
        terms.append(
            Term(f"{role} gradients", *where(g * trained // N), f"{g} B x T / {N} partition{pinned if oo else ''}")
        )
    if not (stage3 and b == 4 and not oo):  # else the fp32 partition itself is trained in place
        terms.append(Term(f"{role} fp32 master weights", *where(4 * trained // N), f"4 B x T / {N}"))
    terms.append(Term(f"{role} Adam moments", *where(8 * trained // N), f"8 B x T / {N}"))
    return terms


def update_gradients(role: str, zero: ZeroSetup, trained: int, b: int, N: int) -> list[Term]:
    """The gradients an update holds beyond the resident states until its optimizer step frees them: ZeRO-1/2's
    (DeepSpeed's estimator's factors: the partition in the model dtype and in fp32), ZeRO-3's float32 copy of
    one sub-group of its partition, which the optimizer step reads; the fp32 part on the host under
    ``offload_optimizer``."""
    if not trained:
        return []

    def where(size: int) -> tuple[int, int]:
        return (0, size) if zero.offload_optimizer else (size, 0)

    if zero.stage == 3:
        elements = min(trained // N, zero.sub_group_size)
        return [
            Term(f"{role} fp32 gradient copy", *where(4 * elements), "4 B x min(T / N, sub_group_size), optimizer step")
        ]
    return [
        Term(f"{role} gradients", b * trained // N, 0, f"{b} B x T / {N}"),
        Term(f"{role} fp32 gradients", *where(4 * trained // N), f"4 B x T / {N}"),
    ]


def reduce_bucket(role: str, zero: ZeroSetup, params: int, b: int, *, touched_only: bool) -> list[Term]:
    """A trained engine's reduce bucket (contiguous gradients), allocated once and kept. ``touched_only`` (a CPU):
    it counts only as far as the model fills it (pages never written are not resident). Stage 2's all-gather
    bucket only chunks a collective into the parameters themselves: nothing kept."""
    elements = min(zero.reduce_bucket, params) if touched_only else zero.reduce_bucket
    return [Term(f"{role} reduce bucket", b * elements, 0, f"{zero.reduce_bucket:,} elements")]


def gathered(role: str, zero: ZeroSetup, params: int, b: int) -> list[Term]:
    """ZeRO-3's gathered parameters: at most ``stage3_max_live_parameters`` plus the prefetch bucket. They stay
    gathered after the engine ran (within the reuse distance) until the colocation empties the partition cache
    before a generation, which it does on a GPU only."""
    if zero.stage != 3:
        return []
    live = min(params, zero.max_live_parameters + zero.prefetch_bucket)
    return [Term(f"{role} gathered parameters", b * live, 0, "ZeRO-3 live parameters + prefetch")]


def micro_batch_tokens(inputs: PlanInputs, micro: Pass, layout: str) -> tuple[int, int]:
    """(rows, tokens) of a micro-batch of full-length sequences as ``layout`` runs it (``PlanInputs.layout``). Only
    ``dedup`` and ``shared_prompts`` run fewer tokens than rows x (P + R): one prompt per group of ``n`` rows. With
    a token budget, packed rows (``packed``, ``dedup``) hold as many sequences as the budget's tokens allow."""
    P, R, n = inputs.prompt_length, inputs.response_length, inputs.n

    def tokens(rows: int) -> int:
        return -(-rows // n) * P + rows * R if layout in ("dedup", "shared_prompts") else rows * (P + R)

    rows = micro.sequences(P + R)
    if layout == "dedup" and micro.budget is not None:
        while rows < micro.rows and tokens(rows + 1) <= micro.budget:
            rows += 1
    return rows, tokens(rows)


def activations(
    inputs: PlanInputs, micro: Pass, *, grad: bool, checkpointing: bool, layout: str, group: int
) -> list[Term]:
    """A micro-batch's activations through the decoder layers (docs/architecture.md, section 13), its tokens as
    ``layout`` runs them (``micro_batch_tokens``), a sequence-parallel rank's share of them (``group`` ranks share
    the micro-batch: the role's ``ulysses_sequence_parallel_size``, which runs packed rows) beside the
    packed rows' boolean mask where several sequences share them, which every rank of the group holds whole (its
    attention reads it after the all-to-all). ``shared_prompts`` (``model.shared_prompt_forward``): the prompts' KV
    cache, indexed out to every row, also stays while the responses run."""
    shape, b = inputs.shape, inputs.dtype_bytes
    P, R = inputs.prompt_length, inputs.response_length
    rows, tokens = micro_batch_tokens(inputs, micro, layout)
    masked = group > 1 and (rows > 1 or layout == "dedup")  # a row of one sequence runs causal, without a mask
    mask = [Term("sequence-parallel mask", tokens**2, 0, f"({tokens:,} tokens)^2 booleans")] if masked else []
    tokens = -(-tokens // group)
    per_layer = shape.layer_activation_bytes(b)
    # The prompts' cache indexed out to every row, then concatenated with the responses' keys and values.
    cache_bytes = rows * (P + (P + R)) * shape.kv_bytes_per_token(b)
    shared = layout == "shared_prompts"
    cache = [Term("shared prompts' KV cache", cache_bytes, 0, f"{rows:,} rows x (P + P + R) tokens")] if shared else []
    if not grad:
        working = tokens * shape.forward_working_bytes(b)
        return [Term("activations (no grad)", working, 0, f"{tokens:,} tokens"), *cache, *mask]
    if checkpointing:
        size = tokens * (shape.layers * shape.hidden * b + per_layer)
        return [Term("activations (checkpointed)", size, 0, f"{tokens:,} tokens x (L x h + 1 layer)"), *cache, *mask]
    size = tokens * (shape.layers + 1) * per_layer  # + the gradients of the layer in backward
    return [Term("activations", size, 0, f"{tokens:,} tokens x (L + 1) layers"), *cache, *mask]


def log_prob_head(shape: ModelShape, micro: Pass, inputs: PlanInputs, *, grad: bool, layout: str) -> Term:
    """The response logits of a micro-batch in the model dtype (and, in an update, their two gradients), plus the
    float32 chunks the log-softmax runs in. Padded forwards keep ``R + 1`` positions a row, packed ones ``R``. The
    fused head (``inputs.fused_head``) holds one chunk of logits at a time, and in an update, in backward, that
    chunk's gradient and a second output-layer gradient (autograd sums the chunks' into it)."""
    rows, _ = micro_batch_tokens(inputs, micro, layout)
    positions = rows * (inputs.response_length + (layout not in ("packed", "dedup")))
    positions = -(-positions // inputs.sequence_parallel)  # a sequence-parallel rank's share (packed rows)
    if inputs.fused_head:  # chunks of whole positions, as head_stats cuts them
        chunk = min(positions, max(1, LOGIT_CHUNK_ELEMENTS // shape.vocab))
        copies = 2 if grad else 1
        weight = shape.vocab * shape.hidden * inputs.dtype_bytes if grad else 0
        size = chunk * shape.vocab * (copies * inputs.dtype_bytes + LOGIT_CHUNK_TEMPORARIES * 4) + weight
        note = f"fused: {copies} x {chunk:,} positions x {shape.vocab:,} vocab + fp32 chunks"
        return Term("log-prob head", size, 0, note + (" + an output-layer gradient" if grad else ""))
    chunks = LOGIT_CHUNK_TEMPORARIES * 4 * min(positions * shape.vocab, LOGIT_CHUNK_ELEMENTS)
    logits = positions * shape.vocab * inputs.dtype_bytes
    copies = 3 if grad else 1
    return Term(
        "log-prob head", copies * logits + chunks, 0, f"{copies} x {positions:,} x {shape.vocab:,} vocab + fp32 chunks"
    )


def reward_forward(inputs: PlanInputs) -> list[Term]:
    """The reward model's no-grad forward of one micro-batch (``inputs.reward_pass``): rows of ``reward_length``
    tokens (its own chat template's, cut to ``reward_model.max_length``), neither packed nor sequence-parallel. One
    layer's working set a token, as any no-grad forward, and the backbone's last hidden states, which the score
    head reads at each row's last token: no logits over a vocabulary."""
    shape, micro, b = inputs.reward_shape, inputs.reward_pass, inputs.dtype_bytes
    tokens = micro.sequences(inputs.reward_length) * inputs.reward_length
    return [
        Term("activations (no grad)", tokens * shape.forward_working_bytes(b), 0, f"{tokens:,} tokens"),
        Term("score head", tokens * shape.hidden * b, 0,
             f"hidden states of {tokens:,} tokens x {shape.hidden:,}; the score of each row's last"),
    ]  # fmt: skip


def trained_states(inputs: PlanInputs) -> tuple[list[Term], list[Term]]:
    """The actor's and the critic's resident states."""
    s, b, N = inputs.shape, inputs.dtype_bytes, inputs.world_size
    actor = model_states("actor", inputs.actor, s.parameters(), inputs.actor_trained, b, N)
    critic = []
    if inputs.critic is not None:
        params = s.parameters(lm_head=False) + s.hidden + 1
        critic = model_states("critic", inputs.critic, params, params, b, N)
    return actor, critic


def moved_to_host(terms: list[Term], zero: ZeroSetup, *, frozen: bool = False) -> list[Term]:
    """``terms`` as ``colocation.offload_targets`` leaves them while the rollout engine is awake on a GPU: under
    ZeRO-3 every device state moves to the host, under ZeRO-1/2 all but the parameters (the push reads them); an
    engine with offloaded parameters moves nothing. ``frozen``: the engine trains part of its parameters (LoRA),
    and its ZeRO-3 partition stays on the device as well."""
    if zero.offload_param:
        return terms
    keeps_parameters = zero.stage != 3 or frozen
    return [
        term
        if keeps_parameters and term.name.endswith(" parameters") or not term.device
        else Term(term.name, 0, term.host + term.device, term.note + " -> host")
        for term in terms
    ]


def rollout_terms(inputs: PlanInputs, device: Device) -> tuple[list[Term], KvBudget, list[Term]]:
    """The rollout engine while it generates, its KV budget, and what it keeps while it sleeps."""
    s, rb, tp = inputs.shape, inputs.rollout_dtype_bytes, inputs.tensor_parallel
    length = inputs.prompt_length + inputs.response_length
    weights = s.parameters() * rb
    needed = inputs.n * inputs.prompts_per_rank * tp * length
    if inputs.rollout == "vllm":
        reserved = int(inputs.gpu_memory_utilization * device.bytes)
        kv_bytes = max(0, reserved - weights // tp - VLLM_RESERVE_BYTES)
        # Each of the engine's tp ranks keeps its share of the KV heads (at least one: fewer heads are replicated).
        kv = KvBudget(
            kv_bytes // kv_bytes_per_token(s.layers, max(1, s.kv_heads // tp), s.head_dim, rb), needed, length
        )
        awake = [Term("vLLM weights", weights // tp, 0, f"{rb} B x P / TP {tp}"),
                 Term("vLLM KV cache", kv_bytes, 0, f"gpu_memory_utilization {inputs.gpu_memory_utilization}"),
                 Term("vLLM working memory", min(VLLM_RESERVE_BYTES, reserved), 0,
                      "activation peak, CUDA graphs: unverified on GPU")]  # fmt: skip
        if not inputs.sleep_mode:
            asleep = awake
        elif inputs.sleep_level == 1:
            asleep = [Term("vLLM weights (asleep)", 0, weights // tp, "sleep level 1: pinned host copy")]
        else:
            asleep = []
        return awake, kv, asleep
    per_prompt = inputs.n * length * s.kv_bytes_per_token(rb)
    prompts = min(inputs.hf_micro_batch, inputs.prompts_per_rank)
    if inputs.hf_kv_max_bytes is not None:
        prompts = max(1, min(prompts, inputs.hf_kv_max_bytes // per_prompt))
    rows = prompts * inputs.n
    on_device = device.kind == "cuda"
    copy = Term("HF rollout weights", weights, 0, f"{rb} B x P, a plain copy")
    awake = [copy,
             Term("HF rollout KV cache", prompts * per_prompt, 0,
                  f"{rows:,} rows x {length:,} tokens per generate call"),
             Term("HF rollout prefill", rows * inputs.prompt_length * s.forward_working_bytes(rb), 0,
                  f"{rows:,} rows x {inputs.prompt_length:,} prompt tokens, no grad"),
             Term("HF rollout logits", 2 * rows * s.vocab * 4, 0, f"{rows:,} rows x vocab, float32")]  # fmt: skip
    asleep = (
        [Term(copy.name + " (asleep)", 0, weights, "moved to the host between generations")] if on_device else [copy]
    )
    return awake, KvBudget(prompts * inputs.n * length, needed, length), asleep
