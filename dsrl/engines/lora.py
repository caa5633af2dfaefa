"""LoRA on the actor: PEFT adapters on a frozen base model under DeepSpeed ZeRO (verl's
``actor_rollout_ref.model.{lora_rank, lora_alpha, target_modules, exclude_modules, lora_adapter_path}``).

- ``add_adapters`` wraps the loaded model (partitioned already under ZeRO-3) in a ``PeftModel``: the base
  weights stay in the run's dtype and are frozen; the adapters are the only parameters handed to DeepSpeed,
  so gradients, the optimizer's states and its fp32 master weights exist for them alone. DeepSpeed
  partitions the adapters when it wraps the model (they are created outside ``zero.Init``).
- The reference policy is the same network with its adapters off (``PeftModel.disable_adapter``), as in
  verl (its ``ref_in_actor``): no second model is loaded.
- The rollout engine gets either the merged weights (``iter_merged_parameters``: ``W + (alpha / r) B A`` for
  every adapted layer, under the base model's names, a bucket at a time as for full fine-tuning) or the
  adapters alone (``iter_adapter_parameters``, under the actor's own parameter names).

Only linear layers take adapters here (``target_modules: all-linear`` never adapts the output layer, nor a mixture of
experts' fused expert tensors and routers, which PEFT's all-linear would); an embedding or convolution named in
``target_modules`` is refused at start-up.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsrl.config.files import adapter_settings
from dsrl.engines.routers import moe_routers
from dsrl.engines.weight_sync import DEFAULT_BUCKET_BYTES, iter_gathered

# peft is imported by the functions that use it: a run without LoRA never imports it. (Most of its ~3 s import was
# transformers' model code, which the first model load imports anyway.)
if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora import LoraLayer

ADAPTER = "default"  # PEFT's name of the one adapter
ADAPTER_FILE = "adapter_model.safetensors"  # the file PEFT saves adapter weights in (vLLM reads it too)
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's parameter names


def _plain(value: Any) -> Any:
    """An OmegaConf list as a Python list (PEFT checks ``isinstance(..., list)``)."""
    return [str(v) for v in value] if value is not None and not isinstance(value, str) else value


def is_peft_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``PeftModel`` (without importing peft: none exists before peft is imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def lora_config(model_cfg: Any) -> LoraConfig:
    """The adapters of a run that starts without an adapter: verl's settings (no bias, no dropout)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        target_modules=_plain(model_cfg.target_modules),
        exclude_modules=_plain(model_cfg.exclude_modules),
        bias="none",
    )


def saved_adapter_settings(path: str) -> dict[str, Any]:
    """``adapter_config.json`` of a saved PEFT adapter directory; ValueError naming the key and the fix (validation
    refuses the same, ``dsrl.config.files.adapter_settings``)."""
    settings, problem = adapter_settings(Path(path).expanduser())
    if problem is not None:
        raise ValueError(
            f"actor_rollout_ref.model.lora_adapter_path={path!r}: not a LoRA adapter directory: {problem}; "
            "point it at a folder PeftModel.save_pretrained wrote"
        )
    return settings


def saved_adapter_config(path: str) -> LoraConfig:
    """The settings of the saved adapter at ``path`` as the run trains it: its ``lora_dropout`` 0, so that the
    rollout and every training pass see one network (``dsrl.config.rules.rollout.adapter_notes`` says so)."""
    from peft import LoraConfig

    saved_adapter_settings(path)  # a readable LoRA adapter, or the error naming the key
    config = LoraConfig.from_pretrained(str(Path(path).expanduser()))
    config.lora_dropout = 0.0
    return config


def add_adapters(module: torch.nn.Module, model_cfg: Any) -> PeftModel:
    """``module`` with trainable LoRA adapters (from ``lora_adapter_path`` when set) and its base frozen."""
    from peft import PeftModel

    if model_cfg.lora_adapter_path is not None:
        settings = saved_adapter_settings(model_cfg.lora_adapter_path)
        if model_cfg.lora_rank not in (0, settings["r"]):
            raise ValueError(
                f"actor_rollout_ref.model.lora_rank={model_cfg.lora_rank} but the adapter at lora_adapter_path has "
                f"rank {settings['r']}; set lora_rank={settings['r']} (or 0: the adapter's rank is used)"
            )
        path = model_cfg.lora_adapter_path
        config = saved_adapter_config(path)
        peft_model = PeftModel.from_pretrained(module, path, config=config, is_trainable=True)
    else:
        peft_model = _wrapped(module, lora_config(model_cfg))
    _check_linear(peft_model)
    return peft_model


def _wrapped(module: torch.nn.Module, config: LoraConfig, adapter_path: str | None = None) -> PeftModel:
    """``get_peft_model``, its refusal of targets that leave no module to adapt said with the keys and the fix
    (``adapter_path``: the targets are a saved adapter's)."""
    from peft import get_peft_model

    linear = sorted({name.rpartition(".")[2] for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)})
    targets = f"target_modules={_shown(config.target_modules)} (exclude_modules={_shown(config.exclude_modules)})"
    if adapter_path is None:
        where = f"actor_rollout_ref.model.{targets}"
        fix = f"use all-linear or names from the model's linear modules ({', '.join(linear)})"
    else:
        where = f"actor_rollout_ref.model.lora_adapter_path={adapter_path}: the adapter's {targets}"
        fix = "start from an adapter trained on actor_rollout_ref.model.path's model"
    if config.target_modules == "all-linear" and moe_routers(module):
        # PEFT's all-linear also adapts a mixture of experts' fused expert tensors and its routers, which are not
        # linear layers: dsrl's all-linear names the linear layers themselves (attention, shared experts), as for a
        # dense model, so the experts stay out
        head = module.get_output_embeddings()
        names = {name.rpartition(".")[2] for name, m in module.named_modules() if m is not head}
        config = dataclasses.replace(config, target_modules=sorted(names & set(linear)))
    try:
        return get_peft_model(module, config)
    except ValueError as err:
        raise ValueError(f"{where} matched no module of the model ({' '.join(str(err).split())}); fix: {fix}") from err


def _check_linear(peft_model: PeftModel) -> None:
    from peft.tuners.lora import Linear as LoraLinear

    other = sorted(name for name, layer in lora_layers(peft_model).items() if not isinstance(layer, LoraLinear))
    if other:
        raise ValueError(
            f"actor_rollout_ref.model.target_modules adapts {other[:3]}, which are not linear layers; dsrl trains "
            "LoRA on linear layers only: name linear modules (or all-linear), or exclude these with exclude_modules"
        )


def _shown(value: Any) -> str:
    """A target or exclude setting as the user wrote it: a pattern, or a list of names (PEFT keeps a set)."""
    return repr(sorted(value)) if isinstance(value, (set, list, tuple)) else repr(value)


def lora_target_problems(model_cfg: Any, config_file: Path | None) -> list[str]:
    """The adapters of ``model_cfg`` (``actor_rollout_ref.model``) put on the model built on the meta device from its
    ``config_file`` (no weights are read: a second or two): ``target_modules`` that match no module or a module
    that is not linear, ``exclude_modules`` that exclude nothing the targets match (a typo), a saved adapter's
    targets missing from this model. What ``--validate-only`` and the start of a run refuse before any weight
    loads; [] also when the model cannot be built here (no config.json, remote code): its load then reports it."""
    config = (
        saved_adapter_config(model_cfg.lora_adapter_path) if model_cfg.lora_adapter_path else lora_config(model_cfg)
    )
    with warnings.catch_warnings():  # PEFT's and transformers' advice on a model that is never run
        warnings.simplefilter("ignore")
        model = _meta_model(config_file)
        if model is None:
            return []
        try:
            peft_model = _wrapped(model, config, model_cfg.lora_adapter_path)
            _check_linear(peft_model)
        except ValueError as err:
            return [str(err)]
        if config.exclude_modules and not model_cfg.lora_adapter_path:
            unexcluded = dataclasses.replace(config, exclude_modules=None)
            everything = lora_layers(_wrapped(_meta_model(config_file), unexcluded))
            if set(everything) == set(lora_layers(peft_model)):
                return [
                    f"actor_rollout_ref.model.exclude_modules={_shown(config.exclude_modules)}: excludes none of the "
                    f"{len(everything)} modules target_modules={_shown(config.target_modules)} adapts (a name no "
                    "module has is ignored); fix: name modules the targets match (e.g. o_proj, or a regex of full "
                    "names), or null"
                ]
    return []


def _meta_model(config_file: Path | None) -> torch.nn.Module | None:
    """The causal LM of ``config_file`` (a config.json) on the meta device, or None when transformers cannot build it
    without the model's own code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config_file is None:
        return None
    try:
        config = AutoConfig.from_pretrained(str(config_file.parent))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 -- remote code, an architecture this transformers lacks: the load says so
        return None


def lora_layers(module: torch.nn.Module) -> dict[str, LoraLayer]:
    """The adapted layers of a ``PeftModel`` by their module name."""
    from peft.tuners.lora import LoraLayer

    return {name: layer for name, layer in module.named_modules() if isinstance(layer, LoraLayer)}


def trainable_parameter_count(module: torch.nn.Module) -> int:
    """Elements of the parameters that train (full sizes under ZeRO-3)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def base_name(peft_name: str) -> str:
    """The base model's name of a parameter of the wrapped model (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``)."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def iter_merged_parameters(
    module: PeftModel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(base model name, full tensor)`` of the policy with its adapters merged: ``W + s * (B @ A)``
    (``s`` the layer's scaling, computed in float32, cast to ``W``'s dtype) for every adapted layer, every
    other parameter as it is. Gathered a bucket at a time (``iter_gathered``); a layer's weight waits for
    its two adapter matrices, which follow it in parameter order. Collective under ZeRO-3."""
    layers = lora_layers(module)
    parts: dict[str, dict[str, torch.Tensor]] = {}  # adapted layer -> what of it was gathered so far
    for name, tensor in iter_gathered(module.named_parameters(), bucket_bytes=bucket_bytes):
        layer_name, part = _layer_part(name, layers)
        if layer_name is None:
            yield base_name(name), tensor
            continue
        held = parts.setdefault(layer_name, {})
        held[part] = tensor
        if len(held) == len(_PARTS):
            del parts[layer_name]
            weight = held["weight"]
            delta = held["lora_B"].float() @ held["lora_A"].float() * layers[layer_name].scaling[ADAPTER]
            yield base_name(f"{layer_name}.weight"), (weight.float() + delta).to(weight.dtype)
    if parts:
        raise RuntimeError(f"iter_merged_parameters: adapted layers missing a part: {sorted(parts)[:3]}")


_PARTS = {".base_layer.weight": "weight", f".lora_A.{ADAPTER}.weight": "lora_A", f".lora_B.{ADAPTER}.weight": "lora_B"}


def _layer_part(name: str, layers: dict[str, LoraLayer]) -> tuple[str | None, str]:
    """(adapted layer, ``weight`` | ``lora_A`` | ``lora_B``) of a parameter that merges; (None, "") for any
    other parameter (a base layer's bias included)."""
    for suffix, part in _PARTS.items():
        if name.endswith(suffix) and name[: -len(suffix)] in layers:
            return name[: -len(suffix)], part
    return None, ""


def adapter_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapters' ``(name, parameter)`` pairs, in parameter order."""
    return [(name, p) for name, p in module.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def iter_adapter_parameters(
    module: PeftModel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` of the adapters only (the actor's own names,
    ``base_model.model....lora_A.default.weight``). Collective under ZeRO-3."""
    yield from iter_gathered(adapter_parameters(module), bucket_bytes=bucket_bytes)


def saved_adapter_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Adapter tensors as PEFT saves them: on CPU, contiguous, named without the adapter's name
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return {name.replace(f".{ADAPTER}.", "."): tensor.detach().cpu().contiguous() for name, tensor in named_tensors}
