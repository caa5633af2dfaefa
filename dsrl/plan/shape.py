"""A model's shape, read from its ``config.json`` alone (no weights, no torch): parameters, activation bytes and
KV cache bytes per token, for the memory plan (``dsrl.plan.plan``) and the transformers rollout's KV budget
(``dsrl.rollout.hf``). Dense decoders, and mixture-of-experts ones laid out as Qwen3-MoE, Qwen2-MoE and Mixtral
(routed experts of one width, optionally a shared expert); anything else raises ``PlanError``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "bf16": 2, "fp32": 4, "fp16": 2}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # "all-linear"


class PlanError(ValueError):
    """The plan cannot be made (no config.json, an architecture it does not know): one line with the fix."""


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache of one token in every layer: keys and values, KV heads x head size each."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, as its ``config.json`` gives it (Qwen2/Qwen3/Llama/Mistral/SmolLM layouts); with
    ``experts``, ``moe_layers`` of its layers route each token to ``experts_per_token`` of ``experts`` MLPs of width
    ``expert_intermediate`` (plus a shared one of ``shared_intermediate``), the others a dense MLP."""

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
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (with its one-output gate)
    moe_layers: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> ModelShape:
        """The shape in ``config`` (a parsed config.json read from ``source``); raises PlanError for a model that is
        not a dense decoder (experts at any depth: ``ffn_config.moe_num_experts``, ``text_config.num_local_experts``)
        and for sizes that are not positive whole numbers or do not fit together."""
        if not isinstance(config, dict):
            raise PlanError(f"{source}: config.json holds a JSON {type(config).__name__}; fix: {_FIX}")
        moe = _experts(config, source)
        missing = [k for k in _SIZES if k not in config]
        if missing:
            nested = [key for key, value in config.items() if isinstance(value, dict) and "hidden_size" in value]
            inside = f" (they are in {nested[0]}: a multimodal model, not a plain decoder)" if nested else ""
            raise PlanError(f"{source}: config.json has no {', '.join(missing)}{inside}; fix: {_FIX}")
        sizes = {key: config[key] for key in _SIZES}
        sizes.update({key: config[key] for key in ("num_key_value_heads", "head_dim") if config.get(key) is not None})
        wrong = [f"{key}={value!r}" for key, value in sizes.items() if not _positive_int(value)]
        if wrong:
            raise PlanError(f"{source}: {', '.join(wrong)}: sizes must be positive whole numbers; fix: {_FIX}")
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise PlanError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} (each KV "
                f"head serves a whole group of query heads); fix: {_FIX}"
            )
        if config.get("head_dim") is None and config["hidden_size"] % heads:
            raise PlanError(
                f"{source}: hidden_size={config['hidden_size']} is not a multiple of num_attention_heads={heads} and "
                f"no head_dim is given; fix: {_FIX}"
            )
        model_type = config.get("model_type", "")
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe,
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self, moe: bool = False) -> int:
        """One decoder layer: attention (q, k, v, o and their biases, Qwen3's q/k norms), the gated MLP (``moe``: the
        router, every expert and the shared one), two norms."""
        h = self.hidden
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += 2 * self.head_dim
        if not moe:
            return attention + 3 * h * self.intermediate + 2 * h
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return attention + self.experts * (h + 3 * h * self.expert_intermediate) + shared + 2 * h

    def parameters(self, *, lm_head: bool = True) -> int:
        """The model's parameters; ``lm_head=False``: the backbone (a critic's, before its value head)."""
        embeddings = self.vocab * self.hidden
        head = embeddings if lm_head and not self.tied_embeddings else 0
        layers = (self.layers - self.moe_layers) * self.layer_parameters() + self.moe_layers * self.layer_parameters(
            True
        )
        return embeddings + layers + self.hidden + head

    def classifier_parameters(self) -> int:
        """A sequence-classification model's parameters (a reward model's): the backbone and a score head
        ``hidden -> 1`` without a bias, in place of the LM head."""
        return self.parameters(lm_head=False) + self.hidden

    def active_parameters(self) -> int:
        """The parameters one token runs through: its ``experts_per_token`` experts of each mixture-of-experts layer
        (``parameters()`` for a dense model)."""
        idle = self.moe_layers * (self.experts - self.experts_per_token) * 3 * self.hidden * self.expert_intermediate
        return self.parameters() - idle

    def lora_parameters(self, rank: int, targets: Any) -> int:
        """Trained parameters of LoRA adapters of ``rank`` on ``targets`` ("all-linear" or module names)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
        names = LORA_TARGETS if targets == "all-linear" else [name for name in targets if name in shapes]
        mlp = ("gate_proj", "up_proj", "down_proj")
        attention_adapters = sum(rank * sum(shapes[name]) for name in names if name not in mlp)
        mlp_adapters = sum(rank * sum(shapes[name]) for name in names if name in mlp)
        # a mixture-of-experts layer's experts are fused 3-D tensors, no Linear modules: no adapters on them
        return self.layers * attention_adapters + (self.layers - self.moe_layers) * mlp_adapters

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes)

    def layer_activation_bytes(self, dtype_bytes: int) -> int:
        """Bytes one token keeps for the backward of a decoder layer (the mean over the layers): the two norms'
        inputs (and their float32 upcasts), q, k, v before and after rotary embedding, the attention output, and the
        MLP's gate, up, its activation and their product (SDPA keeps no attention matrix); in a mixture-of-experts
        layer those of each chosen expert, with the token's copy going in and the expert's output before its
        routing weight, and the router's float32 logits and probabilities."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attention = 2 * h + 2 * h + 2 * (q + 2 * kv) + q
        dense = (attention + 4 * i) * dtype_bytes + 2 * h * 4
        if not self.moe_layers:
            return dense
        routed = self.experts_per_token * (2 * h + 4 * self.expert_intermediate) + 4 * self.shared_intermediate
        moe = (attention + routed) * dtype_bytes + 2 * h * 4 + 2 * self.experts * 4
        return -(-(self.moe_layers * moe + (self.layers - self.moe_layers) * dense) // self.layers)

    def forward_working_bytes(self, dtype_bytes: int) -> int:
        """Bytes one token holds at once in a no-grad forward: the residual stream and a norm's output, then the
        larger of q, k, v and the MLP's gate, up and activation (a mixture-of-experts layer's chosen experts')."""
        mlp = 3 * max(self.intermediate if self.moe_layers < self.layers else 0,
                      self.experts_per_token * self.expert_intermediate + self.shared_intermediate)  # fmt: skip
        return (2 * self.hidden + max(self.q_dim + 2 * self.kv_dim, mlp)) * dtype_bytes


_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_FIX = "point at a transformers model's config.json (or correct it)"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _experts(config: dict, source: str) -> dict[str, int]:
    """``ModelShape``'s mixture-of-experts fields of ``config`` ({} for a dense decoder); PlanError for experts the
    plan cannot lay out (nested in a sub-config, another layout's keys)."""
    key = _experts_key(config)
    if key is None:
        return {}
    width = config.get("moe_intermediate_size") or (
        config.get("intermediate_size") if "num_local_experts" in config else None
    )
    experts, per_token = config.get(key), config.get("num_experts_per_tok")
    if "." in key or not all(_positive_int(v) for v in (experts, per_token, width)):
        raise PlanError(
            f"{source}: a mixture-of-experts model ({key}) the memory plan cannot lay out: it reads num_experts (or "
            "num_local_experts), num_experts_per_tok and moe_intermediate_size at the top of config.json, as "
            f"Qwen3-MoE, Qwen2-MoE and Mixtral write them; fix: {_FIX}"
        )
    layers = config.get("num_hidden_layers", 0)
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    return {
        "experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate": width,
        "shared_intermediate": config.get("shared_expert_intermediate_size") or 0,
        "moe_layers": sum(1 for i in range(layers) if (i + 1) % step == 0 and i not in dense),
    }


def _experts_key(config: dict, prefix: str = "") -> str | None:
    """The dotted key of a number of experts above 1 anywhere in ``config`` (nested ``*_config`` dicts too)."""
    for key, value in config.items():
        if key in _EXPERTS and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
            return f"{prefix}{key}"
        if isinstance(value, dict):
            found = _experts_key(value, f"{prefix}{key}.")
            if found:
                return found
    return None


def model_config_path(model_path: str) -> Path | None:
    """``config.json`` of ``model_path``: in the directory, or in the Hugging Face cache for a hub id (nothing is
    downloaded); None when neither has it."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache  # no torch

    cached = try_to_load_from_cache(model_path, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def read_shape(model_path: str, model_config: str | None = None, *, key: str | None = None) -> ModelShape:
    """The shape of ``model_path`` (from ``model_config``, a config.json path, when given); raises PlanError.
    ``key``: the config key naming a model beside the actor (the reward model, the teacher), for which
    ``--model-config`` does not stand."""
    if model_config:
        path = Path(model_config).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            what = "a directory without a config.json" if path.name == "config.json" else "no such file"
            raise PlanError(f"--model-config {model_config}: {what}; fix: pass the path of a model's config.json")
    else:
        path = model_config_path(model_path)
    if path is None or not path.is_file():
        other = (
            " (--model-config gives the actor's shape alone)" if key else ", or pass --model-config PATH/TO/config.json"
        )
        raise PlanError(
            f"{key + ': ' if key else ''}no config.json for {model_path} here (not a local directory, not in the "
            f"Hugging Face cache); fix: `hf download {model_path} config.json`{other}"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise PlanError(
            f"{path} cannot be read as JSON ({err}); fix: point at a transformers model's config.json"
        ) from None
    return ModelShape.from_config(config, str(path))
