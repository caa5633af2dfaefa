"""The memory plan of a run (``dsrl-train ... --plan``): what each rank holds in each phase of a step, in device
and host memory, from the resolved config, the roles' DeepSpeed JSON files and the model's ``config.json`` alone
(no weights, no torch), and the check ``--validate-only`` applies (``trainer.memory_plan_check``).

Phases, in the order of a step (``dsrl.trainer.loop``): ``rollout`` (generation; ``dsrl.rollout.colocation`` moves the
trained engines' device states to the host first, unless the rollout engine keeps its memory for good),
``old_log_prob`` (no-grad actor forward), ``ref`` (reference forward, with a KL term), ``values`` and
``update_critic`` (gae), ``update_actor``. Each phase lists every role's resident states (a sleeping rollout
engine's too) plus the working memory of the phase itself.

Terms (bytes per rank; N = world size, P = parameters, T = trained parameters, b = bytes of
``actor_rollout_ref.model.dtype``, g = bytes of the JSON's ``data_types.grad_accum_dtype`` (b when absent)):

- parameters: ZeRO-3 keeps ``b P / N`` (on the host under ``offload_param``), stages 0-2 the whole ``b P``.
- gradients: ZeRO-3 its partition buffer ``g T / N`` (on the host under ``offload_optimizer``), allocated once;
  stages 1-2 the factors of DeepSpeed's own estimator, ``b T / N`` plus ``4 T / N`` fp32 (the fp32 part on the host
  under ``offload_optimizer``), in the update only: the optimizer step frees them.
- master weights ``4 T / N`` and Adam's two moments ``8 T / N`` (on the host under ``offload_optimizer``); a
  float32 model under ZeRO-3 without optimizer offload trains its partition in place (no separate master copy).
- DeepSpeed buffers: the reduce bucket (``reduce_bucket_size`` elements, contiguous gradients), kept by a
  trained engine; under ZeRO-3 the gathered parameters, at most
  ``stage3_max_live_parameters`` elements (the whole model when smaller) plus the prefetch bucket, held from the
  engine's first pass of a step on (on a CPU from the step before: only a GPU's generation empties them).
- activations of one micro-batch of ``t`` tokens (a count of rows times prompt + response length, each row at
  its maximum; or a token budget, filled with full-length rows): without gradient checkpointing every layer
  keeps ``t A`` (``layer_activation_bytes``), and backward holds one more layer's worth of gradients; with it
  each layer keeps its input ``t h b`` and one layer is recomputed at a time. A no-grad forward holds one
  layer's working set (``forward_working_bytes``). ``model.shared_prompt_forward`` runs each group's prompt once
  (fewer tokens) and keeps its KV cache, indexed out to every row and concatenated with the responses'.
- the log-prob head (``dsrl.engines.forward``): logits only for the response positions, ``rows x (R + 1) x V``
  in the model dtype; an update also holds their gradient and the slice's zero-padded gradient (three such
  tensors), plus a few float32 chunks of ``LOGIT_CHUNK_ELEMENTS``.
- rollout: vLLM takes ``gpu_memory_utilization`` of the device for weights, KV cache and its own working memory
  (``VLLM_RESERVE_BYTES``, unverified on GPU); its KV cache holds ``kv_tokens`` tokens against the
  ``n x prompts x (prompt + response)`` a step generates. The transformers rollout keeps a full copy of the
  weights and one generate call's KV cache (``rollout.kv_cache_max_gb``, ``rollout.micro_batch_size``).

On a CPU machine (``Device.kind == "cpu"``) device and host are the same memory: a phase needs its device and
host terms together, times the ranks on the machine, and nothing is moved between them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsrl.config.deepspeed_json import read_ds_json, zero_stage
from dsrl.config.loading import rollout_name
from dsrl.config.names import ADV_ESTIMATORS, SUM_PI_SQUARED_ESTIMATORS
from dsrl.config.schema import lora_enabled

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "bf16": 2, "fp32": 4, "fp16": 2}
# dsrl.engines.forward.CHUNK_ELEMENTS and dsrl.engines.weight_sync.DEFAULT_BUCKET_BYTES, restated here (this
# module must not import torch); a test keeps them equal.
LOGIT_CHUNK_ELEMENTS = 2**26
PUSH_BUCKET_BYTES = 256 * 2**20
LOGIT_CHUNK_TEMPORARIES = 3  # float32 tensors of one chunk alive at once: the scaled logits, log-softmax, gather
# vLLM's device memory that is neither weights nor KV cache: its profiled activation peak, the sampler's logits
# and CUDA graphs. Not derivable from the shapes; an assumption, unverified on GPU.
VLLM_RESERVE_BYTES = 2 * GIB
# DeepSpeed's defaults for the ZeRO keys the plan reads, where the JSON leaves them out.
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # "all-linear"


class PlanError(ValueError):
    """The plan cannot be made (no config.json, an architecture it does not know): one line with the fix."""


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache of one token in every layer: keys and values, KV heads x head size each."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# ---- the model's shape ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shape, as its ``config.json`` gives it (Qwen2/Qwen3/Llama/Mistral/SmolLM layouts)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool  # biases on q, k, v (Qwen2's always; others say so in attention_bias)
    qk_norm: bool  # Qwen3's RMSNorm of each head's q and k

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> ModelShape:
        """The shape in ``config`` (a parsed config.json read from ``source``); raises PlanError."""
        if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise PlanError(f"{source}: a mixture-of-experts model; the memory plan knows dense decoders only")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size") if k not in config]
        if missing:
            raise PlanError(f"{source}: config.json has no {', '.join(missing)}; fix: point at a transformers model's config.json")
        heads = config["num_attention_heads"]
        model_type = config.get("model_type", "")
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """One decoder layer: attention (q, k, v, o and their biases, Qwen3's q/k norms), the gated MLP, two norms."""
        h = self.hidden
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention + 3 * h * self.intermediate + 2 * h

    def parameters(self, *, lm_head: bool = True) -> int:
        """The model's parameters; ``lm_head=False``: the backbone (a critic's, before its value head)."""
        embeddings = self.vocab * self.hidden
        head = embeddings if lm_head and not self.tied_embeddings else 0
        return embeddings + self.layers * self.layer_parameters() + self.hidden + head

    def lora_parameters(self, rank: int, targets: Any) -> int:
        """Trained parameters of LoRA adapters of ``rank`` on ``targets`` ("all-linear" or module names)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
        names = LORA_TARGETS if targets == "all-linear" else [name for name in targets if name in shapes]
        return self.layers * sum(rank * sum(shapes[name]) for name in names)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes)

    def layer_activation_bytes(self, dtype_bytes: int) -> int:
        """Bytes one token keeps for the backward of one decoder layer: the two norms' inputs (and their float32
        upcasts), q, k, v before and after rotary embedding, the attention output, and the MLP's gate, up, its
        activation and their product (SDPA keeps no attention matrix)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        model_dtype = 2 * h + 2 * h + 2 * (q + 2 * kv) + q + 4 * i
        return model_dtype * dtype_bytes + 2 * h * 4

    def forward_working_bytes(self, dtype_bytes: int) -> int:
        """Bytes one token holds at once in a no-grad forward: the residual stream and a norm's output, then the
        larger of q, k, v and the MLP's gate, up and activation."""
        return (2 * self.hidden + max(self.q_dim + 2 * self.kv_dim, 3 * self.intermediate)) * dtype_bytes


def model_config_path(model_path: str) -> Path | None:
    """``config.json`` of ``model_path``: in the directory, or in the Hugging Face cache for a hub id (nothing is
    downloaded); None when neither has it."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache  # no torch

    cached = try_to_load_from_cache(model_path, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def read_shape(model_path: str, model_config: str | None = None) -> ModelShape:
    """The shape of ``model_path`` (from ``model_config``, a config.json path, when given); raises PlanError."""
    path = Path(model_config).expanduser() if model_config else model_config_path(model_path)
    if path is None or not path.is_file():
        raise PlanError(
            f"no config.json for {model_path} here (not a local directory, not in the Hugging Face cache); fix: "
            f"`hf download {model_path} config.json`, or pass --model-config PATH/TO/config.json"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlanError(f"{path} cannot be read as JSON ({err}); fix: point at a transformers model's config.json") from None
    return ModelShape.from_config(config, str(path))


# ---- the device ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """The memory one rank's device has (``kind`` "cuda"), or the machine's memory all its ranks share ("cpu")."""

    kind: str
    bytes: int
    source: str  # how it was found, for the header


def parse_size(text: str) -> int:
    """Bytes of a size such as ``141GiB``, ``80GB``, ``512MiB`` (a bare number is GiB); raises ValueError."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r}: not a size; write e.g. 141GiB, 80GB or 512MiB")
    number, unit = float(match[1]), (match[2] or "GiB").upper().rstrip("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(number * scale)


def detect_device() -> Device | None:
    """This machine's accelerator, without torch: the smallest GPU ``nvidia-smi`` lists; with ``DS_ACCELERATOR=cpu``
    the CPU, whose memory is the machine's (``MemTotal``); None when neither (a machine without GPUs that may be
    checking a config for one: the plan then needs ``--device-memory``)."""
    if os.environ.get("DS_ACCELERATOR", "") == "cpu":
        meminfo = Path("/proc/meminfo").read_text()
        total_kib = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo)[1])
        return Device("cpu", total_kib * 1024, "DS_ACCELERATOR=cpu: the machine's memory")
    if shutil.which("nvidia-smi"):
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        sizes = [int(line) for line in result.stdout.split() if line.strip().isdigit()]
        if result.returncode == 0 and sizes:
            return Device("cuda", min(sizes) * 2**20, "nvidia-smi")
    return None


# ---- what the plan reads of the config -------------------------------------------------------------------------


@dataclass(frozen=True)
class Zero:
    """A role's ZeRO setup, as its DeepSpeed JSON gives it."""

    stage: int
    offload_param: bool
    offload_optimizer: bool
    pinned: bool
    reduce_bucket: int
    prefetch_bucket: int
    max_live_parameters: int
    grad_accum_dtype: str | None
    sub_group_size: int = ZERO_DEFAULTS["sub_group_size"]  # ZeRO-3 steps the optimizer this many elements at a time

    @classmethod
    def from_json(cls, ds: dict[str, Any]) -> Zero:
        zero = {**ZERO_DEFAULTS, **ds.get("zero_optimization", {})}

        def offloaded(name: str) -> bool:
            return (zero.get(name) or {}).get("device", "none") not in ("none", None)

        pinned = any(offloaded(name) and zero[name].get("pin_memory", False) for name in ("offload_param", "offload_optimizer"))
        return cls(
            stage=zero_stage(ds),
            offload_param=offloaded("offload_param"),
            offload_optimizer=offloaded("offload_optimizer"),
            pinned=pinned,
            reduce_bucket=int(zero["reduce_bucket_size"]),
            prefetch_bucket=int(zero["stage3_prefetch_bucket_size"]),
            max_live_parameters=int(zero["stage3_max_live_parameters"]),
            grad_accum_dtype=ds.get("data_types", {}).get("grad_accum_dtype"),
            sub_group_size=int(zero["sub_group_size"]),
        )

    def describe(self) -> str:
        offload = [name for name, on in (("params", self.offload_param), ("optimizer", self.offload_optimizer)) if on]
        return f"ZeRO-{self.stage}" + (f", {' + '.join(offload)} offloaded" if offload else "")


@dataclass(frozen=True)
class Pass:
    """One pass's micro-batch: ``rows`` sequences of ``prompt + response`` tokens (``rows`` already bounded by the
    rows a rank has in that pass), or ``budget`` tokens (``use_dynamic_bsz``) filled with full-length rows."""

    rows: int
    budget: int | None = None

    def sequences(self, length: int) -> int:
        return max(1, self.budget // length) if self.budget is not None else self.rows


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads, taken from the config (``inputs_from_config``); fixes are tried by replacing
    fields of it."""

    shape: ModelShape
    world_size: int
    dtype_bytes: int
    prompt_length: int
    response_length: int
    actor: Zero
    actor_trained: int  # trained parameters: all, or LoRA's adapters
    actor_checkpointing: bool
    shared_prompts: bool  # model.shared_prompt_forward: actor and reference forwards run each prompt once
    update: Pass
    old_log_prob: Pass | None  # None when folded into the update
    ref: Zero | None  # the reference engine; None without a KL term or with LoRA
    ref_pass: Pass | None  # the reference forward (the actor's engine with LoRA); None without a KL term
    critic: Zero | None
    critic_checkpointing: bool
    critic_update: Pass | None
    critic_values: Pass | None
    rollout: str  # vllm | hf
    rollout_dtype_bytes: int
    n: int
    prompts_per_rank: int
    gpu_memory_utilization: float
    tensor_parallel: int
    sleep_mode: bool
    sleep_level: int
    hf_micro_batch: int
    hf_kv_max_bytes: int | None


def _pass(rows: int, micro: int, dynamic: bool, budget: int) -> Pass:
    return Pass(rows=min(micro, max(1, rows)), budget=budget if dynamic else None)


def inputs_from_config(cfg: Any, world_size: int, shape: ModelShape, device: Device) -> PlanInputs:
    """The plan's inputs from a validated, resolved config at ``world_size`` ranks on ``device``."""
    arr, data, algo = cfg.actor_rollout_ref, cfg.data, cfg.algorithm
    model, actor, rollout = arr.model, arr.actor, arr.rollout
    n, N = rollout.n, world_size
    batch_rows = data.train_batch_size * n // N  # rows per rank in a step
    mini_rows = actor.ppo_mini_batch_size * n // N
    lora = lora_enabled(model)
    needs_kl = actor.use_kl_loss or algo.use_kl_in_reward
    needs_ref = needs_kl and not lora  # a LoRA actor is its own reference, with the adapters off
    gae = algo.adv_estimator == "gae"
    correction = algo.rollout_correction
    # Trainer.folds_old_log_prob: an exactly on-policy update whose step reads no old log-probs before it runs
    # the pass inside the update; the built-in estimators but those of sum_pi_squared read no policy.
    folds = correction.bypass_mode or (
        actor.ppo_mini_batch_size == data.train_batch_size
        and actor.ppo_epochs == 1
        and not algo.use_kl_in_reward
        and not (correction.rollout_is or correction.rollout_rs)
        and not actor.calculate_sum_pi_squared
        and algo.adv_estimator in ADV_ESTIMATORS
        and algo.adv_estimator not in SUM_PI_SQUARED_ESTIMATORS
        and not actor.mask_truncated_completions
    )
    name = rollout_name(cfg)
    sleep = rollout.enable_sleep_mode
    if sleep is None:
        sleep = device.kind == "cuda"
    critic = cfg.critic
    return PlanInputs(
        shape=shape,
        world_size=N,
        dtype_bytes=DTYPE_BYTES[model.dtype],
        prompt_length=data.max_prompt_length,
        response_length=data.max_response_length,
        actor=Zero.from_json(read_ds_json(actor.deepspeed_config, "actor_rollout_ref.actor.deepspeed_config")),
        actor_trained=shape.lora_parameters(model.lora_rank, model.target_modules) if lora else shape.parameters(),
        actor_checkpointing=model.enable_gradient_checkpointing,
        shared_prompts=model.shared_prompt_forward,
        update=_pass(mini_rows, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
        old_log_prob=None if folds else _pass(
            batch_rows, rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu,
        ),
        ref=Zero.from_json(read_ds_json(arr.ref.deepspeed_config, "actor_rollout_ref.ref.deepspeed_config")) if needs_ref else None,
        ref_pass=_pass(batch_rows, arr.ref.log_prob_micro_batch_size_per_gpu, arr.ref.log_prob_use_dynamic_bsz,
                       arr.ref.log_prob_max_token_len_per_gpu) if needs_kl else None,
        critic=Zero.from_json(read_ds_json(critic.deepspeed_config, "critic.deepspeed_config")) if gae else None,
        critic_checkpointing=critic.model.enable_gradient_checkpointing,
        critic_update=_pass(critic.ppo_mini_batch_size * n // N, critic.ppo_micro_batch_size_per_gpu,
                            critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu) if gae else None,
        critic_values=_pass(batch_rows, critic.forward_micro_batch_size_per_gpu, critic.use_dynamic_bsz,
                            critic.forward_max_token_len_per_gpu) if gae else None,
        rollout=name,
        rollout_dtype_bytes=DTYPE_BYTES[rollout.dtype or model.dtype],
        n=n,
        prompts_per_rank=data.train_batch_size // N,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        tensor_parallel=rollout.tensor_model_parallel_size,
        sleep_mode=bool(sleep) and name == "vllm",
        sleep_level=rollout.sleep_level,
        hf_micro_batch=rollout.micro_batch_size,
        hf_kv_max_bytes=None if rollout.kv_cache_max_gb is None else int(rollout.kv_cache_max_gb * 1e9),
    )


# ---- the terms -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One line of a phase: bytes per rank on the device and on the host, and how they were counted."""

    name: str
    device: int = 0
    host: int = 0
    note: str = ""


def model_states(role: str, zero: Zero, params: int, trained: int, b: int, N: int) -> list[Term]:
    """The resident states of a DeepSpeed engine (``trained`` 0: the reference, no optimizer). ZeRO-3's gradient
    partition is allocated once and stays; the gradients of stages 1-2 live in the update only
    (``update_gradients``)."""
    stage3 = zero.stage == 3
    pinned = " (pinned)" if zero.pinned else ""
    lp = b * params // N if stage3 else b * params
    terms = [Term(f"{role} parameters", *((0, lp) if stage3 and zero.offload_param else (lp, 0)),
                  f"{b} B x {params / 1e6:,.1f} M" + (f" / {N}" if stage3 else "") + (pinned if zero.offload_param else ""))]  # fmt: skip
    if not trained:
        return terms
    oo = zero.offload_optimizer
    where = (lambda size: (0, size)) if oo else (lambda size: (size, 0))
    if stage3:
        g = DTYPE_BYTES[zero.grad_accum_dtype] if zero.grad_accum_dtype else b
        terms.append(Term(f"{role} gradients", *where(g * trained // N), f"{g} B x T / {N} partition{pinned if oo else ''}"))
    if not (stage3 and b == 4 and not oo):  # else the fp32 partition itself is trained in place
        terms.append(Term(f"{role} fp32 master weights", *where(4 * trained // N), f"4 B x T / {N}"))
    terms.append(Term(f"{role} Adam moments", *where(8 * trained // N), f"8 B x T / {N}"))
    return terms


def update_gradients(role: str, zero: Zero, trained: int, b: int, N: int) -> list[Term]:
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
        return [Term(f"{role} fp32 gradient copy", *where(4 * elements), "4 B x min(T / N, sub_group_size), optimizer step")]
    return [Term(f"{role} gradients", b * trained // N, 0, f"{b} B x T / {N}"),
            Term(f"{role} fp32 gradients", *where(4 * trained // N), f"4 B x T / {N}")]


def buckets(role: str, zero: Zero, params: int, b: int, *, touched_only: bool) -> list[Term]:
    """A trained engine's reduce bucket (contiguous gradients), allocated once and kept. ``touched_only`` (a CPU):
    it counts only as far as the model fills it (pages never written are not resident). Stage 2's all-gather
    bucket only chunks a collective into the parameters themselves: nothing kept."""
    elements = min(zero.reduce_bucket, params) if touched_only else zero.reduce_bucket
    return [Term(f"{role} reduce bucket", b * elements, 0, f"{zero.reduce_bucket:,} elements")]


def gathered(role: str, zero: Zero, params: int, b: int) -> list[Term]:
    """ZeRO-3's gathered parameters: at most ``stage3_max_live_parameters`` plus the prefetch bucket. They stay
    gathered after the engine ran (within the reuse distance) until the colocation empties the partition cache
    before a generation, which it does on a GPU only."""
    if zero.stage != 3:
        return []
    live = min(params, zero.max_live_parameters + zero.prefetch_bucket)
    return [Term(f"{role} gathered parameters", b * live, 0, "ZeRO-3 live parameters + prefetch")]


def activations(inputs: PlanInputs, micro: Pass, *, grad: bool, checkpointing: bool, shared: bool) -> list[Term]:
    """A micro-batch's activations through the decoder layers (see the module docstring). ``shared``
    (``model.shared_prompt_forward``, actor and reference): a group's prompt runs once, and its KV cache, indexed
    out to every row, stays while the responses run."""
    shape, b = inputs.shape, inputs.dtype_bytes
    P, R = inputs.prompt_length, inputs.response_length
    rows = micro.sequences(P + R)
    tokens = -(-rows // inputs.n) * P + rows * R if shared else rows * (P + R)
    per_layer = shape.layer_activation_bytes(b)
    # The prompts' cache indexed out to every row, then concatenated with the responses' keys and values.
    cache_bytes = rows * (P + (P + R)) * shape.kv_bytes_per_token(b)
    cache = [Term("shared prompts' KV cache", cache_bytes, 0, f"{rows:,} rows x (P + P + R) tokens")] if shared else []
    if not grad:
        return [Term("activations (no grad)", tokens * shape.forward_working_bytes(b), 0, f"{tokens:,} tokens"), *cache]
    if checkpointing:
        size = tokens * (shape.layers * shape.hidden * b + per_layer)
        return [Term("activations (checkpointed)", size, 0, f"{tokens:,} tokens x (L x h + 1 layer)"), *cache]
    size = tokens * (shape.layers + 1) * per_layer  # + the gradients of the layer in backward
    return [Term("activations", size, 0, f"{tokens:,} tokens x (L + 1) layers"), *cache]


def log_prob_head(shape: ModelShape, micro: Pass, inputs: PlanInputs, *, grad: bool) -> Term:
    """The response logits of a micro-batch in the model dtype (and, in an update, their two gradients), plus the
    float32 chunks the log-softmax runs in."""
    length = inputs.prompt_length + inputs.response_length
    positions = micro.sequences(length) * (inputs.response_length + 1)
    logits = positions * shape.vocab * inputs.dtype_bytes
    chunks = LOGIT_CHUNK_TEMPORARIES * 4 * min(positions * shape.vocab, LOGIT_CHUNK_ELEMENTS)
    copies = 3 if grad else 1
    return Term("log-prob head", copies * logits + chunks, 0, f"{copies} x {positions:,} x {shape.vocab:,} vocab + fp32 chunks")


# ---- the plan ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One phase of a step: every term a rank holds during it."""

    name: str
    terms: list[Term]
    asleep: str  # what sleeps or was moved off the device in this phase

    @property
    def device(self) -> int:
        return sum(term.device for term in self.terms)

    @property
    def host(self) -> int:
        return sum(term.host for term in self.terms)


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


@dataclass(frozen=True)
class Plan:
    """Per-rank phases of a run on a device, and its rollout's KV budget."""

    inputs: PlanInputs
    device: Device
    phases: list[Phase]
    kv: KvBudget

    def need(self, phase: Phase) -> int:
        """What ``phase`` needs of the memory ``device`` counts: the device's share per rank on a GPU; on a CPU
        machine device and host terms of every rank together."""
        if self.device.kind == "cpu":
            return (phase.device + phase.host) * self.inputs.world_size
        return phase.device

    def over(self) -> list[Phase]:
        return [phase for phase in self.phases if self.need(phase) > self.device.bytes]


def _trained_states(inputs: PlanInputs) -> tuple[list[Term], list[Term]]:
    """The actor's and the critic's resident states."""
    s, b, N = inputs.shape, inputs.dtype_bytes, inputs.world_size
    actor = model_states("actor", inputs.actor, s.parameters(), inputs.actor_trained, b, N)
    critic = []
    if inputs.critic is not None:
        params = s.parameters(lm_head=False) + s.hidden + 1
        critic = model_states("critic", inputs.critic, params, params, b, N)
    return actor, critic


def _moved_to_host(terms: list[Term], zero: Zero) -> list[Term]:
    """``terms`` as ``colocation.offload_targets`` leaves them while the rollout engine is awake on a GPU: under
    ZeRO-3 every device state moves to the host, under ZeRO-1/2 all but the parameters (the push reads them); an
    engine with offloaded parameters moves nothing."""
    if zero.offload_param:
        return terms
    return [
        term if zero.stage != 3 and term.name.endswith(" parameters") or not term.device
        else Term(term.name, 0, term.host + term.device, term.note + " -> host")
        for term in terms
    ]


def _rollout_terms(inputs: PlanInputs, device: Device) -> tuple[list[Term], KvBudget, list[Term]]:
    """The rollout engine while it generates, its KV budget, and what it keeps while it sleeps."""
    s, rb, tp = inputs.shape, inputs.rollout_dtype_bytes, inputs.tensor_parallel
    length = inputs.prompt_length + inputs.response_length
    weights = s.parameters() * rb
    needed = inputs.n * inputs.prompts_per_rank * tp * length
    if inputs.rollout == "vllm":
        reserved = int(inputs.gpu_memory_utilization * device.bytes)
        kv_bytes = max(0, reserved - weights // tp - VLLM_RESERVE_BYTES)
        # Each of the engine's tp ranks keeps its share of the KV heads (at least one: fewer heads are replicated).
        kv = KvBudget(kv_bytes // kv_bytes_per_token(s.layers, max(1, s.kv_heads // tp), s.head_dim, rb), needed, length)
        awake = [Term("vLLM weights", weights // tp, 0, f"{rb} B x P / TP {tp}"),
                 Term("vLLM KV cache", kv_bytes, 0, f"gpu_memory_utilization {inputs.gpu_memory_utilization}"),
                 Term("vLLM working memory", min(VLLM_RESERVE_BYTES, reserved), 0, "activation peak, CUDA graphs: unverified on GPU")]  # fmt: skip
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
             Term("HF rollout KV cache", prompts * per_prompt, 0, f"{rows:,} rows x {length:,} tokens per generate call"),
             Term("HF rollout prefill", rows * inputs.prompt_length * s.forward_working_bytes(rb), 0,
                  f"{rows:,} rows x {inputs.prompt_length:,} prompt tokens, no grad"),
             Term("HF rollout logits", 2 * rows * s.vocab * 4, 0, f"{rows:,} rows x vocab, float32")]  # fmt: skip
    asleep = [Term(copy.name + " (asleep)", 0, weights, "moved to the host between generations")] if on_device else [copy]
    return awake, KvBudget(prompts * inputs.n * length, needed, length), asleep


def plan_memory(inputs: PlanInputs, device: Device) -> Plan:
    """The per-rank, per-phase plan of ``inputs`` on ``device``."""
    s, b = inputs.shape, inputs.dtype_bytes
    actor, critic = _trained_states(inputs)
    on_gpu = device.kind == "cuda"
    actor += buckets("actor", inputs.actor, s.parameters(), b, touched_only=not on_gpu)
    if critic:
        critic += buckets("critic", inputs.critic, s.parameters(lm_head=False), b, touched_only=not on_gpu)
    ref = model_states("ref", inputs.ref, s.parameters(), 0, b, inputs.world_size) if inputs.ref else []
    rollout_awake, kv, rollout_asleep = _rollout_terms(inputs, device)
    static = inputs.rollout == "vllm" and not inputs.sleep_mode
    resident = actor + critic + ref
    engines = {"actor": gathered("actor", inputs.actor, s.parameters(), b)}
    if inputs.ref is not None:
        engines["ref"] = gathered("ref", inputs.ref, s.parameters(), b)
    if inputs.critic is not None:
        engines["critic"] = gathered("critic", inputs.critic, s.parameters(lm_head=False), b)
    # On a CPU every engine's gathered parameters stay from the step before; on a GPU they come back as each runs.
    live = {} if on_gpu else dict(engines)

    phases = []
    if on_gpu and not static:
        during_gen = _moved_to_host(actor, inputs.actor) + (_moved_to_host(critic, inputs.critic) if critic else []) + ref
        asleep = "trained engines' device states moved to the host (ZeRO-3: all; ZeRO-1/2: all but the parameters)"
    else:
        during_gen = resident
        asleep = "nothing moves (" + ("vLLM keeps its memory for good)" if static else "a CPU: device and host are one memory)")
    push = [Term("weight push bucket", min(PUSH_BUCKET_BYTES, s.parameters() * b), 0, "full tensors gathered for the push")]
    phases.append(Phase("rollout", during_gen + [t for terms in live.values() for t in terms] + rollout_awake + push, asleep))

    rollout_note = ("vLLM awake (no sleep mode)" if static else
                    f"rollout asleep (level {inputs.sleep_level})" if inputs.rollout == "vllm" else
                    "HF rollout copy on the host" if on_gpu else "HF rollout copy resident")  # fmt: skip

    def running(role: str) -> list[Term]:
        live[role] = engines[role]
        return [t for terms in live.values() for t in terms]

    def forward_phase(name: str, role: str, micro: Pass, head: bool) -> Phase:
        terms = resident + rollout_asleep + running(role)
        terms += activations(inputs, micro, grad=False, checkpointing=False, shared=head and inputs.shared_prompts)
        if head:
            terms.append(log_prob_head(s, micro, inputs, grad=False))
        return Phase(name, terms, rollout_note)

    def update_phase(name: str, role: str, zero: Zero, micro: Pass, trained: int, checkpointing: bool, head: bool) -> Phase:
        terms = resident + rollout_asleep + running(role) + update_gradients(role, zero, trained, b, inputs.world_size)
        terms += activations(inputs, micro, grad=True, checkpointing=checkpointing, shared=head and inputs.shared_prompts)
        if head:
            terms.append(log_prob_head(s, micro, inputs, grad=True))
        return Phase(name, terms, rollout_note)

    if inputs.old_log_prob is not None:
        phases.append(forward_phase("old_log_prob", "actor", inputs.old_log_prob, True))
    if inputs.ref_pass is not None:  # with LoRA, the actor with its adapters off
        phases.append(forward_phase("ref", "ref" if inputs.ref is not None else "actor", inputs.ref_pass, True))
    if inputs.critic is not None:
        backbone = s.parameters(lm_head=False)
        phases.append(forward_phase("values", "critic", inputs.critic_values, False))
        phases.append(update_phase("update_critic", "critic", inputs.critic, inputs.critic_update, backbone + s.hidden + 1,
                                   inputs.critic_checkpointing, False))  # fmt: skip
    phases.append(update_phase("update_actor", "actor", inputs.actor, inputs.update, inputs.actor_trained,
                               inputs.actor_checkpointing, True))  # fmt: skip
    return Plan(inputs, device, phases, kv)


def plan_for_config(cfg: Any, world_size: int, device: Device, model_config: str | None = None) -> Plan:
    """The plan of a validated, resolved config; ``model_config``: a config.json standing for the model's."""
    shape = read_shape(cfg.actor_rollout_ref.model.path, model_config)
    return plan_memory(inputs_from_config(cfg, world_size, shape, device), device)


# ---- the report and the check --------------------------------------------------------------------------------


def _gib(size: int) -> str:
    return f"{size / GIB:8.3f}"


def render(plan: Plan, header: str) -> str:
    """The plan as text: a header, then per phase its terms (device and host GiB per rank) and total."""
    i, dev = plan.inputs, plan.device
    lines = [
        f"memory plan: {header}",
        f"  {i.world_size} rank(s); device {dev.bytes / GIB:.1f} GiB ({dev.kind}, {dev.source}); model "
        f"{i.shape.parameters() / 1e6:,.1f} M parameters, {i.shape.layers} layers, hidden {i.shape.hidden}, vocab "
        f"{i.shape.vocab:,}; {i.dtype_bytes} B/param; actor {i.actor.describe()}"
        + (f"; ref {i.ref.describe()}" if i.ref else "") + (f"; critic {i.critic.describe()}" if i.critic else ""),
    ]
    if dev.kind == "cpu":
        lines.append(f"  CPU: device and host are one memory; a phase needs (device + host) x {i.world_size} rank(s)")
    for phase in plan.phases:
        lines.append(f"  phase {phase.name} ({phase.asleep})")
        lines.append(f"    {'term':36} {'device GiB':>10} {'host GiB':>10}  detail")
        for term in phase.terms:
            if term.device or term.host:
                lines.append(f"    {term.name:36} {_gib(term.device):>10} {_gib(term.host):>10}  {term.note}")
        verdict = "fits" if plan.need(phase) <= dev.bytes else f"EXCEEDS the device by {(plan.need(phase) - dev.bytes) / GIB:.2f} GiB"
        lines.append(f"    {'total per rank':36} {_gib(phase.device):>10} {_gib(phase.host):>10}  {verdict}")
    lines.append("  " + plan.kv.describe())
    return "\n".join(lines)


def _fits(inputs: PlanInputs, device: Device, phase_name: str) -> bool:
    plan = plan_memory(inputs, device)
    return all(plan.need(p) <= device.bytes for p in plan.phases if p.name == phase_name)


def _largest(low: int, high: int, fits: Any) -> int | None:
    """The largest value in ``[low, high]`` for which ``fits(value)`` holds (it holds for every smaller one too);
    None when not even ``low`` does."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _largest_micro_batch(inputs: PlanInputs, device: Device, phase: str, field: str) -> int | None:
    """The largest micro-batch (rows, or token budget) of ``field`` (a Pass of ``inputs``) with which ``phase``
    fits; None when not even the smallest does."""
    current: Pass = getattr(inputs, field)
    attr = "budget" if current.budget is not None else "rows"
    smallest = inputs.prompt_length + inputs.response_length if attr == "budget" else 1

    def fits(value: int) -> bool:
        return _fits(dataclasses.replace(inputs, **{field: dataclasses.replace(current, **{attr: value})}), device, phase)

    return _largest(smallest, getattr(current, attr), fits)


# The micro-batch keys of each phase: (count key, budget key, PlanInputs field).
_MICRO_KEYS = {
    "old_log_prob": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "old_log_prob"),
    "ref": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "ref_pass"),
    "values": ("critic.forward_micro_batch_size_per_gpu", "critic.forward_max_token_len_per_gpu", "critic_values"),
    "update_critic": ("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu", "critic_update"),
    "update_actor": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "update"),
}  # fmt: skip
_ROLE_KEYS = {"actor": "actor_rollout_ref.actor.deepspeed_config", "critic": "critic.deepspeed_config",
              "ref": "actor_rollout_ref.ref.deepspeed_config"}  # fmt: skip


def fixes(plan: Plan, phase: Phase) -> list[str]:
    """What makes ``phase`` fit, each checked against the plan: the largest micro-batch or budget that fits (or
    prompts per generate call), gradient checkpointing, offloading the engines' states, a lower
    ``gpu_memory_utilization``."""
    i, device = plan.inputs, plan.device
    found = []
    if phase.name == "rollout" and i.rollout == "vllm":
        others = phase.device - sum(t.device for t in phase.terms if t.name.startswith("vLLM"))
        utilization = (device.bytes - others) / device.bytes
        if utilization > 0:
            found.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={int(utilization * 100) / 100} "
                         f"(leaves {kv_tokens_at(i, device, utilization):,} KV tokens)")  # fmt: skip
    if phase.name == "rollout" and i.rollout == "hf":
        prompts = _largest(1, i.hf_micro_batch, lambda k: _fits(dataclasses.replace(i, hf_micro_batch=k), device, "rollout"))
        if prompts is not None and prompts < min(i.hf_micro_batch, i.prompts_per_rank):
            found.append(f"actor_rollout_ref.rollout.micro_batch_size={prompts}")
    if phase.name in _MICRO_KEYS:
        count_key, budget_key, field = _MICRO_KEYS[phase.name]
        largest = _largest_micro_batch(i, device, phase.name, field)
        if largest is not None and largest < max(getattr(i, field).rows, getattr(i, field).budget or 0):
            found.append(f"{budget_key if getattr(i, field).budget is not None else count_key}={largest}")
    if phase.name == "update_actor" and not i.actor_checkpointing:
        # The config refuses gradient checkpointing beside shared prompt forwards.
        changed = dataclasses.replace(i, actor_checkpointing=True, shared_prompts=False)
        if _fits(changed, device, phase.name):
            shared = " actor_rollout_ref.model.shared_prompt_forward=false" if i.shared_prompts else ""
            found.append(f"actor_rollout_ref.model.enable_gradient_checkpointing=true{shared}")
    critic_checkpointed = dataclasses.replace(i, critic_checkpointing=True)
    if phase.name == "update_critic" and not i.critic_checkpointing and _fits(critic_checkpointed, device, phase.name):
        found.append("critic.model.enable_gradient_checkpointing=true")
    for role, key in _ROLE_KEYS.items():
        zero = getattr(i, role)
        if zero is None or zero.offload_param:
            continue
        name = "zero3_offload_inference" if role == "ref" else "zero3_offload"  # the shipped offload setups
        offloaded = dataclasses.replace(i, **{role: Zero.from_json(read_ds_json(name, key))})
        if _fits(offloaded, device, phase.name):
            found.append(f"{key}={name}")
    return found or ["a larger device, more ranks (ZeRO partitions shrink with the world size) or shorter sequences"]


def kv_tokens_at(inputs: PlanInputs, device: Device, utilization: float) -> int:
    """vLLM's KV tokens per engine at ``utilization``."""
    return _rollout_terms(dataclasses.replace(inputs, gpu_memory_utilization=utilization), device)[1].tokens


def plan_problems(plan: Plan) -> list[str]:
    """One line per phase that does not fit, with its fixes (``trainer.memory_plan_check``'s report)."""
    lines = []
    for phase in plan.over():
        lines.append(
            f"trainer.memory_plan_check: phase {phase.name} needs {plan.need(phase) / GIB:.2f} GiB, more than the "
            f"{plan.device.bytes / GIB:.2f} GiB of the {plan.device.kind} device; fix: {' or '.join(fixes(plan, phase))}"
        )
    return lines
