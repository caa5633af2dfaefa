"""The rollout's rules: the engine and its sampling settings, the vLLM-only keys, rollout correction (verl 0.9.1's
vocabulary, on the algorithm and on the bypass_mode loss), the rollout-mismatch stop, multi-turn tool calling,
and LoRA on the actor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

from omegaconf import ListConfig

from dsrl.config.deepspeed_json import DeepSpeedJsonError, read_ds_json
from dsrl.config.files import adapter_settings
from dsrl.config.keys import value_at
from dsrl.config.loading import rollout_name
from dsrl.config.names import (
    BYPASS_LOSS_TYPES,
    MODEL_DTYPES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_NAMES,
    ROLLOUT_RS_OPTIONS,
    ROUTER_REPLAY_MODES,
    SLEEP_LEVELS,
    TOOL_FORMATS,
    TRUNCATE_SIDES,
)
from dsrl.config.problems import show
from dsrl.config.rules.need import Need, critic_used, whole_forward_rules
from dsrl.config.schema import (
    BypassCorrectionConfig,
    Config,
    RolloutCorrectionConfig,
    lora_enabled,
    pushes_lora_adapters,
)
from dsrl.config.user_code import estimator_needs


def rollout_rules(cfg: Config, world_size: int, need: Need) -> None:
    rollout, name = cfg.actor_rollout_ref.rollout, rollout_name(cfg)
    prefix = "actor_rollout_ref.rollout"
    need(
        name in ROLLOUT_NAMES,
        f"{prefix}.name",
        "unknown rollout engine",
        f"use one of {', '.join(ROLLOUT_NAMES)}",
    )
    need(
        rollout.temperature > 0,
        f"{prefix}.temperature",
        "must be > 0: training samples from the policy",
        "set it to 1.0",
    )
    need(0 < rollout.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]", "set it to 1.0")
    need(rollout.top_k == -1 or rollout.top_k > 0, f"{prefix}.top_k", "must be -1 (off) or > 0", "set it to -1")
    need(
        0 < rollout.gpu_memory_utilization <= 1,
        f"{prefix}.gpu_memory_utilization",
        "must be in (0, 1]",
        "set it to 0.5",
    )
    tp = rollout.tensor_model_parallel_size
    need(
        tp >= 1 and world_size % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"must divide the world size {world_size} (tensor-parallel groups are contiguous ranks)",
        "set it to 1 or a divisor of the world size",
    )
    need(
        tp == 1 or name == "vllm",
        f"{prefix}.tensor_model_parallel_size",
        "tensor parallel generation needs the vllm engine",
        f"set {prefix}.name=vllm or tensor_model_parallel_size=1",
    )
    val = rollout.val_kwargs
    need(val.n >= 1, f"{prefix}.val_kwargs.n", "must be >= 1", "set it to 1")
    need(val.temperature >= 0, f"{prefix}.val_kwargs.temperature", "must be >= 0", "set it to 0 (greedy)")
    need(0 < val.top_p <= 1, f"{prefix}.val_kwargs.top_p", "must be in (0, 1]", "set it to 1.0")
    need(val.top_k == -1 or val.top_k > 0, f"{prefix}.val_kwargs.top_k", "must be -1 (off) or > 0", "set it to -1")
    need(
        not val.do_sample or val.temperature > 0,
        f"{prefix}.val_kwargs.temperature",
        "val_kwargs.do_sample=true samples, which needs a temperature > 0",
        f"set {prefix}.val_kwargs.temperature=1.0, or val_kwargs.do_sample=false for greedy decoding",
    )
    need(
        val.do_sample or val.n <= 1,
        f"{prefix}.val_kwargs.n",
        "greedy decoding (val_kwargs.do_sample=false) gives n identical responses",
        f"set {prefix}.val_kwargs.n=1, or val_kwargs.do_sample=true with a temperature > 0",
    )


def vllm_rules(cfg: Config, need: Need) -> None:
    """The vllm-only keys: sleep mode needs a colocated vLLM, and level 1 with LoRA adapter pushes; the engine must
    hold a whole sequence."""
    rollout, data, name = cfg.actor_rollout_ref.rollout, cfg.data, rollout_name(cfg)
    prefix = "actor_rollout_ref.rollout"
    need(
        not rollout.enable_sleep_mode or name == "vllm",
        f"{prefix}.enable_sleep_mode",
        f"sleep mode is vLLM's way of freeing device memory; the {name} rollout has none",
        f"set {prefix}.name=vllm, or {prefix}.enable_sleep_mode=null",
    )
    need(
        rollout.sleep_level in SLEEP_LEVELS,
        f"{prefix}.sleep_level",
        "must be 1 (weights kept in CPU memory) or 2 (weights dropped)",
        "set it to 2",
    )
    need(
        rollout.dtype is None or rollout.dtype in MODEL_DTYPES,
        f"{prefix}.dtype",
        "unsupported rollout precision",
        f"use one of {', '.join(MODEL_DTYPES)}, or null (= actor_rollout_ref.model.dtype)",
    )
    need(
        rollout.micro_batch_size >= 1,
        f"{prefix}.micro_batch_size",
        "must be >= 1 (prompts per generate call)",
        "set it to 64",
    )
    need(
        rollout.kv_cache_max_gb is None or rollout.kv_cache_max_gb > 0,
        f"{prefix}.kv_cache_max_gb",
        "must be > 0 (GB of KV cache per generate call)",
        "set it to the device memory generation may use beside the model's weights, or null for micro_batch_size "
        "prompts",
    )
    if name == "vllm":
        need(
            not (
                pushes_lora_adapters(cfg.actor_rollout_ref.model)
                and rollout.sleep_level == 2
                and rollout.enable_sleep_mode is not False
            ),
            f"{prefix}.sleep_level",
            "a level-2 sleep drops vLLM's base weights, and LoRA adapter pushes "
            "(actor_rollout_ref.model.lora.merge=false) never bring them back",
            f"set {prefix}.sleep_level=1 (base weights kept in CPU memory), or actor_rollout_ref.model.lora.merge=true",
        )
        for key in (f"{prefix}.temperature", f"{prefix}.val_kwargs.temperature"):
            need(
                value_at(cfg, key) <= 2,
                key,
                "vLLM samples with temperatures in [0, 2] only",
                "set it to at most 2 (1.0 samples from the policy itself)",
            )
    sequence = data.max_prompt_length + data.max_response_length
    need(
        rollout.max_model_len is None or rollout.max_model_len >= sequence,
        f"{prefix}.max_model_len",
        f"must hold the longest prompt plus response, data.max_prompt_length + data.max_response_length = {sequence}",
        f"set it to null or at least {sequence}",
    )


def offload_on_cpu_rules(cfg: Config, need: Need) -> None:
    """``rollout.offload_states_on_cpu`` needs a rollout that lets the trained engines offload on a CPU (the
    transformers one: vLLM has no sleep mode there, so it keeps its memory and nothing is offloaded) and a trained
    engine with states to offload (DeepSpeed refuses ``offload_states`` under ZeRO parameter offload)."""
    if not cfg.actor_rollout_ref.rollout.offload_states_on_cpu:
        return
    key, name = "actor_rollout_ref.rollout.offload_states_on_cpu", rollout_name(cfg)
    need(
        name == "hf",
        key,
        f"the {name} rollout keeps its memory on a CPU (no sleep mode), so the trained engines never offload there",
        "set actor_rollout_ref.rollout.name=hf, or remove the key",
    )
    roles = ["actor_rollout_ref.actor"] + (["critic"] if critic_used(cfg) else [])
    try:
        zero = {role: read_ds_json(value_at(cfg, role).deepspeed_config, f"{role}.deepspeed_config")
                .get("zero_optimization", {}) for role in roles}  # fmt: skip
    except DeepSpeedJsonError:
        return  # reported by the DeepSpeed rules
    need(
        any((section.get("offload_param") or {}).get("device", "none") in ("none", None) for section in zero.values()),
        key,
        "every trained engine offloads its parameters (zero_optimization.offload_param), and DeepSpeed's "
        "offload_states refuses those: nothing would be offloaded",
        f"set {roles[0]}.deepspeed_config=zero3 (or zero2), or remove the key",
    )


def router_replay_rules(cfg: Config, need: Need) -> None:
    """Routing replay (``actor.router_replay.mode``, verl's): R3 replays what the rollout recorded, so the rollout
    records exactly when R3 is on; R2 records in the old-log-prob pass, which bypass mode does not run. Replay maps
    each token of a forward to its recorded experts, which dsrl does for one whole forward per micro-batch."""
    arr = cfg.actor_rollout_ref
    key, mode, record = (
        "actor_rollout_ref.actor.router_replay.mode",
        arr.actor.router_replay.mode,
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
    )
    need(
        mode in ROUTER_REPLAY_MODES, key, "unknown routing replay mode", f"use one of {', '.join(ROUTER_REPLAY_MODES)}"
    )
    need(
        (mode == "R3") == arr.rollout.enable_rollout_routing_replay,
        record,
        "the rollout records routes for R3 alone (R2 records them in the old-log-prob pass)",
        f"set it to {str(mode == 'R3').lower()} with {key}={mode}",
        arr.rollout.enable_rollout_routing_replay,
    )
    if mode not in ("R2", "R3"):
        return
    need(
        mode != "R2" or not cfg.algorithm.rollout_correction.bypass_mode,
        key,
        "R2 records the routes in the old-log-prob pass, which bypass mode does not run",
        "use R3, or set algorithm.rollout_correction.bypass_mode=false",
    )
    need(
        mode != "R3" or rollout_name(cfg) == "hf",
        key,
        f"R3 reads the routes the rollout recorded; dsrl records them in the transformers rollout only, not in "
        f"{rollout_name(cfg)} (vLLM 0.32 returns them with enable_return_routed_experts on its V2 model runner, which "
        "needs Triton, so not on the CPU build dsrl tests with: dsrl does not read them yet)",
        "set actor_rollout_ref.rollout.name=hf, or use R2",
    )
    need(
        mode != "R3" or not arr.rollout.multi_turn.enable,
        key,
        "a multi-turn rollout generates each turn on the conversation so far; dsrl records one generate's routes",
        "use R2, or set actor_rollout_ref.rollout.multi_turn.enable=false",
    )
    whole_forward_rules(cfg, key, "the mode to disabled", need)


def rollout_correction_rules(cfg: Config, need: Need) -> None:
    """verl 0.9.1's vocabulary in both correction sections (the decoupled one on the algorithm, bypass_mode's on
    the policy loss), and bypass mode set consistently on both sides."""
    algo_prefix, loss_prefix = "algorithm.rollout_correction", "actor_rollout_ref.actor.policy_loss.rollout_correction"
    corr, loss_corr = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss.rollout_correction
    _correction_rules(corr, algo_prefix, need)
    _correction_rules(loss_corr, loss_prefix, need)
    loss_key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    bypass = value_at(cfg, loss_key) == "bypass_mode"
    need(
        not corr.bypass_mode or bypass,
        f"{algo_prefix}.bypass_mode",
        "bypass mode trains with the bypass_mode policy loss (verl switches the loss itself; dsrl does not rewrite "
        "a setting)",
        f"set {loss_key}=bypass_mode, or {algo_prefix}.bypass_mode=false",
    )
    need(
        corr.bypass_mode or not bypass,
        loss_key,
        "bypass_mode takes the rollout engine's log-probs as the old log-probs, which only bypass mode provides "
        "(it skips the old-log-prob pass)",
        f"set {algo_prefix}.bypass_mode=true, or another loss_mode",
    )
    for name in dataclasses.fields(BypassCorrectionConfig):
        key, value = f"{loss_prefix}.{name.name}", getattr(loss_corr, name.name)
        if not bypass:
            need(
                value == name.default,
                key,
                f"configures the bypass_mode loss, not {value_at(cfg, loss_key)}",
                f"set {loss_key}=bypass_mode, or leave {key} at {show(name.default)}",
            )
        elif corr.bypass_mode:  # verl hands algorithm.rollout_correction to the loss: the two must agree
            need(
                getattr(corr, name.name) == value,
                f"{algo_prefix}.{name.name}",
                f"in bypass mode verl's loss takes its settings from {algo_prefix}, dsrl's from {loss_prefix}, "
                f"which has {name.name}={show(value)}",
                "set both keys to the same value",
            )
    need(
        corr.bypass_mode or corr.loss_type == RolloutCorrectionConfig.loss_type,
        f"{algo_prefix}.loss_type",
        "has no effect without bypass mode",
        f"set {algo_prefix}.bypass_mode=true, or leave loss_type at {RolloutCorrectionConfig.loss_type}",
    )
    if corr.bypass_mode:
        estimator, actor = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.actor
        for ok, key, what in (
            (
                "sum_pi_squared" not in estimator_needs(estimator),
                "algorithm.adv_estimator",
                f"{estimator} needs sum_pi_squared",
            ),
            (not actor.calculate_sum_pi_squared, "actor_rollout_ref.actor.calculate_sum_pi_squared", "sum_pi_squared"),
        ):
            need(
                ok,
                key,
                f"{what} from the old-log-prob pass, which bypass mode skips",
                f"set {algo_prefix}.bypass_mode=false (and another loss_mode), or turn it off",
            )


def _correction_rules(section: Any, prefix: str, need: Need) -> None:
    """One correction section: known names, thresholds that parse and accept an exactly on-policy token (ratio 1),
    no threshold set in vain. Mirrors ``dsrl.algorithms.rollout_correction.parse_*`` (which needs torch)."""
    if "loss_type" in section:
        need(
            section.loss_type in BYPASS_LOSS_TYPES,
            f"{prefix}.loss_type",
            "unknown loss type",
            f"use one of {', '.join(BYPASS_LOSS_TYPES)}",
        )
    need(
        section.rollout_is in (None, *ROLLOUT_IS_LEVELS),
        f"{prefix}.rollout_is",
        "unknown level",
        f"use null (off) or one of {', '.join(ROLLOUT_IS_LEVELS)}",
    )
    is_rule = "a number U > 1 (TIS: an on-policy weight 1 is not cut) or a string 'L_U' with 0 < L <= 1 <= U (IcePop)"
    need(
        _threshold_problem(section.rollout_is_threshold, "is") is None,
        f"{prefix}.rollout_is_threshold",
        f"must be {is_rule}: {_threshold_problem(section.rollout_is_threshold, 'is')}",
        "set it to 2.0, or e.g. '0.5_5.0' for IcePop",
    )
    need(
        section.rollout_is is not None or not section.rollout_is_batch_normalize,
        f"{prefix}.rollout_is_batch_normalize",
        "has no effect while rollout_is is null",
        f"set {prefix}.rollout_is=token or sequence, or rollout_is_batch_normalize=false",
    )
    if section.rollout_rs is None:
        need(
            section.rollout_rs_threshold is None,
            f"{prefix}.rollout_rs_threshold",
            "has no effect while rollout_rs is null",
            f"set {prefix}.rollout_rs (e.g. token_k1), or {prefix}.rollout_rs_threshold=null",
        )
        return
    options = [part.strip() for part in str(section.rollout_rs).split(",") if part.strip()]
    renamed = {"token": "token_k1", "sequence": "seq_sum_k1"}  # dsrl's older levels, as verl names them
    unknown = [option for option in options if option not in ROLLOUT_RS_OPTIONS]
    need(
        options and not unknown,
        f"{prefix}.rollout_rs",
        f"must list options (comma-separated) among {', '.join(ROLLOUT_RS_OPTIONS)}",
        "use e.g. token_k1 or seq_mean_k3"
        + "".join(
            f"; for {old!r} write {new} (with rollout_rs_threshold 'L_U')"
            for old, new in renamed.items()
            if old in unknown
        ),
    )
    options = list(dict.fromkeys(options))
    specs = (
        []
        if section.rollout_rs_threshold is None
        else [p.strip() for p in str(section.rollout_rs_threshold).split(",") if p.strip()]
    )
    problem = None
    if not specs:
        problem = "rejection needs a threshold"
    elif len(specs) not in (1, len(options)):
        problem = f"{len(specs)} thresholds for {len(options)} rollout_rs options"
    else:
        for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs, strict=True):
            if problem is None and (found := _threshold_problem(spec, "k1" if option.endswith("k1") else "k")):
                problem = f"{option}: {found}"
    need(
        problem is None,
        f"{prefix}.rollout_rs_threshold",
        "must give one bound for all rollout_rs options or one per option (comma-separated): k2/k3 an upper bound > 0, "
        f"k1 'L_U' with 0 < L <= 1 <= U or a single U >= 1 (L = 1/U): {problem}",
        "set it to e.g. 0.01 (k2, k3) or '0.5_2.0' (k1)",
    )


def _threshold_problem(spec: Any, kind: str) -> str | None:
    """What is wrong with a threshold of ``kind`` (``is``: rollout_is_threshold, ``k1``: a k1 option's, ``k``: a k2/k3
    option's) such that an exactly on-policy ratio 1 is kept; None when nothing is. A number U: > 1 (is), >= 1 (k1),
    > 0 (k); 'L_U' (is, k1): 0 < L <= 1 <= U."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        return f"{spec!r} is not a number"
    text = str(spec).strip()
    if "_" in text:
        if kind == "k":
            return f"{text!r} is an interval; only k1 options and rollout_is_threshold take 'L_U'"
        lower, _, upper = (_number(part) for part in text.partition("_"))
        if lower is None or upper is None or not 0 < lower <= 1 <= upper:
            return f"{text!r} is not 'L_U' with 0 < L <= 1 <= U"
        return None
    value = _number(text)
    least, strict = {"is": (1.0, True), "k1": (1.0, False), "k": (0.0, True)}[kind]
    if value is None or value < least or (strict and value == least):
        return f"{text} is not a number {'>' if strict else '>='} {least:g}"
    return None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def rollout_mismatch_rules(cfg: Config, need: Need) -> None:
    """The bound is a probability gap that can be crossed and tolerates rounding; patience counts steps."""
    gate, prefix = cfg.algorithm.rollout_mismatch, "algorithm.rollout_mismatch"
    need(
        gate.max_probs_diff is None or 0 < gate.max_probs_diff < 1,
        f"{prefix}.max_probs_diff",
        "must be in (0, 1), or null for never: the mean |p_rollout - p_actor| is at most 1, and a healthy run's "
        "is above 0 by rounding (~1e-7 in fp32, ~1e-3 to 1e-2 with a bf16 rollout)",
        "set it to 0.05, or null to train on whatever the gap",
    )
    need(
        gate.patience >= 1,
        f"{prefix}.patience",
        "must be >= 1 (training steps in a row above max_probs_diff that stop the run)",
        "set it to 3",
    )


def multi_turn_rules(cfg: Config, need: Need) -> None:
    """Multi-turn rollouts: bounds, names, and tools to call (what is in the tool files is read by the command,
    ``dsrl.rollout.tools.check_tool_files``, and at start-up). With enable false the other keys are accepted
    unread, as with algorithm.filter_groups: a recipe with tools stays usable without them (enable=false)."""
    mt, prefix = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not mt.enable:
        return
    need(
        mt.tool_config_path or mt.function_tool_path,
        f"{prefix}.tool_config_path",
        f"{prefix}.enable=true needs tools for the model to call",
        f"set {prefix}.tool_config_path (verl's tool YAML, or a shipped one's name: calculator) or "
        f"{prefix}.function_tool_path (a .py of functions)",
    )
    for key in ("max_assistant_turns", "max_user_turns"):
        value = getattr(mt, key)
        need(
            value is None or value >= 1,
            f"{prefix}.{key}",
            "must be >= 1 or null (no limit)",
            f"set {prefix}.{key}=5, or null",
        )
    for key in ("max_parallel_calls", "max_tool_response_length"):
        need(getattr(mt, key) >= 1, f"{prefix}.{key}", "must be >= 1", f"set {prefix}.{key} to a positive count")
    need(mt.tool_timeout > 0, f"{prefix}.tool_timeout", "must be > 0 seconds", f"set {prefix}.tool_timeout=10")
    need(
        mt.tool_memory_limit_mb == 0 or mt.tool_memory_limit_mb >= 256,
        f"{prefix}.tool_memory_limit_mb",
        "must be 0 (no limit) or >= 256 MB (as reward.memory_limit_mb: a worker holds about 25 MB before it builds "
        "the tools; a negative limit would be no limit at all)",
        f"set {prefix}.tool_memory_limit_mb=4096, or 0 for no limit",
    )
    need(
        mt.tool_response_truncate_side in TRUNCATE_SIDES,
        f"{prefix}.tool_response_truncate_side",
        f"must be one of {', '.join(TRUNCATE_SIDES)}",
        f"set {prefix}.tool_response_truncate_side=middle",
    )
    need(
        mt.format in TOOL_FORMATS,
        f"{prefix}.format",
        f"must be one of {', '.join(TOOL_FORMATS)}",
        f"set {prefix}.format=hermes",
    )
    need(
        cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        f"{prefix}.enable=true: the ranks sharing a tensor-parallel engine generate together, but each rank's "
        "conversations take their own number of turns",
        "set actor_rollout_ref.rollout.tensor_model_parallel_size=1 (one engine per rank)",
    )


# What a saved adapter may hold that dsrl's LoRA does not train or push (dsrl.engines.lora: W + s * B @ A on linear
# layers, lora_A and lora_B the only trainable and exported tensors): the setting, when it is in use, and why.
_ADAPTER_REFUSED: dict[str, tuple[Any, str]] = {
    "use_dora": (
        lambda v: bool(v),
        "DoRA rescales each column of W + s * B @ A by a trained magnitude, which dsrl's merge and export leave out",
    ),
    "bias": (
        lambda v: v not in (None, "none"),
        "trained biases are parameters outside lora_A and lora_B: dsrl would neither push nor export them",
    ),
    "lora_bias": (lambda v: bool(v), "a bias on lora_B is left out of dsrl's merge W + s * B @ A"),
    "modules_to_save": (
        lambda v: bool(v),
        "fully trained modules beside the adapters are neither merged nor exported by dsrl",
    ),
    "trainable_token_indices": (lambda v: bool(v), "trained embedding rows are neither merged nor exported by dsrl"),
    "target_parameters": (lambda v: bool(v), "adapters on bare parameters (not linear layers) are not dsrl's LoRA"),
    "layer_replication": (lambda v: bool(v), "a model with replicated layers is not the base model dsrl loads"),
    "alora_invocation_tokens": (
        lambda v: bool(v),
        "activated LoRA turns on mid-sequence; dsrl's adapters are always on",
    ),
}


def adapter_rules(cfg: Config, adapter: Path, given: Collection[str], need: Need) -> None:
    """The saved adapter at ``lora_adapter_path`` against the run: its rank and alpha against the keys (a key set
    to another value would be ignored), and the PEFT settings dsrl would not honour, refused. Its ``lora_dropout``
    is not refused: it is set to 0 for the run (``adapter_notes``)."""
    model, prefix = cfg.actor_rollout_ref.model, "actor_rollout_ref.model"
    key = f"{prefix}.lora_adapter_path"
    settings, problem = adapter_settings(adapter)
    need(
        problem is None,
        key,
        f"not a LoRA adapter directory: {problem}",
        "point it at a folder PeftModel.save_pretrained wrote, or null",
    )
    if problem is not None:
        return
    rank, alpha = settings["r"], settings.get("lora_alpha", 8)  # 8: PEFT's default when the file has none
    need(
        model.lora_rank in (0, rank),
        f"{prefix}.lora_rank",
        f"the adapter at lora_adapter_path has rank {rank}, which the run trains with",
        f"set {prefix}.lora_rank={rank} (or 0: the adapter's rank)",
    )
    need(
        f"{prefix}.lora_alpha" not in given or model.lora_alpha == alpha,
        f"{prefix}.lora_alpha",
        f"the adapter at lora_adapter_path has lora_alpha {alpha}, which the run trains with",
        f"set {prefix}.lora_alpha={alpha}, or leave it out",
    )
    for name in ("target_modules", "exclude_modules"):
        mine, saved = _module_names(getattr(model, name)), _module_names(settings.get(name))
        need(
            f"{prefix}.{name}" not in given or mine == saved,
            f"{prefix}.{name}",
            f"the adapter at lora_adapter_path has {name} {settings.get(name)!r}, which the run trains with",
            f"leave {prefix}.{name} out (or set it to the adapter's)",
        )
    for name, (in_use, why) in _ADAPTER_REFUSED.items():
        need(
            not in_use(settings.get(name)),
            key,
            f"the adapter sets {name}={settings.get(name)!r}: {why}",
            "start from a plain LoRA adapter (PEFT's LoraConfig defaults for it), or without lora_adapter_path",
        )


def adapter_notes(cfg: Config) -> list[str]:
    """What dsrl changes of a saved adapter's settings for the run: a ``lora_dropout`` above 0 becomes 0, since the
    rollout, the old log-probs and the update must see one network (PEFT would drop a random part of the adapters'
    input in every training forward and none in the rollout's). dsrl's own adapters have none either (verl's)."""
    model = cfg.actor_rollout_ref.model
    if model.lora_adapter_path is None:
        return []
    settings, problem = adapter_settings(Path(model.lora_adapter_path).expanduser())
    dropout = settings.get("lora_dropout") or 0
    if problem is not None or not dropout:
        return []
    return [
        f"actor_rollout_ref.model.lora_adapter_path: the adapter's lora_dropout {dropout} is set to 0 for this run: "
        "the rollout and the training passes must see the same network (the exported adapter says 0)"
    ]


def _module_names(value: Any) -> Any:
    """``target_modules``/``exclude_modules`` comparable across a config (a ListConfig) and a file (a list): a
    set of names, or the pattern string."""
    return set(value) if isinstance(value, (list, ListConfig)) else value


def lora_rules(cfg: Config, given: Collection[str], need: Need) -> None:
    """LoRA on the actor (``dsrl.engines.lora``): its settings, the adapter to start from, and the reference's
    DeepSpeed setup, which a LoRA run never uses (its reference is the actor with the adapters off)."""
    model, prefix = cfg.actor_rollout_ref.model, "actor_rollout_ref.model"
    need(
        model.lora_rank >= 0, f"{prefix}.lora_rank", "must be >= 0 (0 = full fine-tuning)", f"set {prefix}.lora_rank=32"
    )
    if not lora_enabled(model):
        return
    need(
        model.lora_alpha > 0,
        f"{prefix}.lora_alpha",
        "must be > 0 (the update is scaled by alpha / rank)",
        f"set {prefix}.lora_alpha to the rank or twice it",
    )
    for key, allow_none in (("target_modules", False), ("exclude_modules", True)):
        value = getattr(model, key)
        names = list(value) if isinstance(value, ListConfig) else None
        ok = (
            (value is None and allow_none)
            or (isinstance(value, str) and value != "")
            or (names is not None and bool(names) and all(isinstance(name, str) and name for name in names))
        )
        need(
            ok,
            f"{prefix}.{key}",
            "must be all-linear, a module name pattern, or a list of module names",
            f"set {prefix}.{key}=all-linear or [q_proj,v_proj]" + (" (or null)" if allow_none else ""),
        )
    if model.lora_adapter_path is not None:
        adapter = Path(model.lora_adapter_path).expanduser()
        need(
            (adapter / "adapter_config.json").is_file(),
            f"{prefix}.lora_adapter_path",
            "not a PEFT adapter directory (no adapter_config.json in it)",
            "point it at a folder PeftModel.save_pretrained wrote (dsrl exports one beside its final model), or null",
        )
        if (adapter / "adapter_config.json").is_file():
            adapter_rules(cfg, adapter, given, need)
    key = "actor_rollout_ref.ref.deepspeed_config"
    need(
        key not in given,
        key,
        "a LoRA run builds no reference engine: its reference is the actor with its "
        "adapters off, so this setup would go unused",
        f"remove it (or set {prefix}.lora_rank=0 for full fine-tuning)",
    )
