"""``dsrl.engines.lora.add_adapters`` on a plain model: each LoRA key does what its help says (which layers get
adapters, their rank and scaling), and targets dsrl cannot train are refused naming the key."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from dsrl.engines.lora import add_adapters, base_name, iter_merged_parameters, lora_layers

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def model_cfg(**overrides):
    keys = {
        "lora_rank": 4,
        "lora_alpha": 16,
        "target_modules": "all-linear",
        "exclude_modules": None,
        "lora_adapter_path": None,
    }
    return OmegaConf.create({**keys, **overrides})


def adapted(tiny_model_dir, **overrides):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return add_adapters(model, model_cfg(**overrides))


def test_rank_alpha_targets_and_exclusions_shape_the_adapters(tiny_model_dir):
    layers = lora_layers(adapted(tiny_model_dir, lora_rank=4, lora_alpha=16))
    assert {name.rpartition(".")[2] for name in layers} == LINEAR  # all-linear: every linear layer but lm_head
    assert all(layer.r["default"] == 4 and layer.scaling["default"] == 16 / 4 for layer in layers.values())
    layers = lora_layers(adapted(tiny_model_dir, lora_rank=2, lora_alpha=8, exclude_modules=["down_proj", "o_proj"]))
    assert {name.rpartition(".")[2] for name in layers} == LINEAR - {"down_proj", "o_proj"}
    assert all(layer.scaling["default"] == 4.0 for layer in layers.values())
    model = adapted(tiny_model_dir, target_modules=["q_proj", "v_proj"])
    assert {name.rpartition(".")[2] for name in lora_layers(model)} == {"q_proj", "v_proj"}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)  # the base is frozen


def test_targets_dsrl_cannot_train_are_refused_naming_the_key(tiny_model_dir):
    with pytest.raises(ValueError, match=r"target_modules adapts .*embed_tokens.*not linear layers"):
        adapted(tiny_model_dir, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"target_modules=.*matched no module"):
        adapted(tiny_model_dir, target_modules=["q_proj"], exclude_modules=["q_proj"])


def target_problems(tiny_model_dir, **overrides) -> list[str]:
    from pathlib import Path

    from dsrl.engines.lora import lora_target_problems

    return lora_target_problems(model_cfg(**overrides), Path(tiny_model_dir) / "config.json")


def test_targets_are_checked_on_the_meta_device_model_before_any_weight_loads(tiny_model_dir):
    """security_3 E8 (no module matched), E9 (an embedding), E10 (an exclusion that excludes nothing: silently
    ignored): refused at validation, from config.json alone, with the model's linear modules named."""
    (problem,) = target_problems(tiny_model_dir, target_modules=["nothing_matches"])
    assert problem.startswith("actor_rollout_ref.model.target_modules=['nothing_matches'] (exclude_modules=None) ")
    assert "matched no module of the model" in problem
    assert problem.endswith("fix: use all-linear or names from the model's linear modules (down_proj, gate_proj, "
                            "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)")  # fmt: skip
    (problem,) = target_problems(tiny_model_dir, target_modules=["embed_tokens"])
    assert "target_modules adapts ['base_model.model.model.embed_tokens'], which are not linear layers" in problem
    (problem,) = target_problems(tiny_model_dir, exclude_modules="all-linear")
    assert problem.startswith("actor_rollout_ref.model.exclude_modules='all-linear': excludes none of the 28 modules")
    (problem,) = target_problems(tiny_model_dir, target_modules=["q_proj"], exclude_modules=["v_proj"])
    assert "exclude_modules=['v_proj']: excludes none of the 4 modules target_modules=['q_proj'] adapts" in problem
    for fine in ({}, {"exclude_modules": ["o_proj"]}, {"exclude_modules": r"model\.layers\.0\..*"}):
        assert target_problems(tiny_model_dir, **fine) == [], fine
    # No config.json here: nothing to check against (the model's load reports it)
    from dsrl.engines.lora import lora_target_problems

    assert lora_target_problems(model_cfg(target_modules=["nothing_matches"]), None) == []


def saved_adapter(tiny_model_dir, folder, **settings) -> str:
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **settings)
    get_peft_model(model, config).save_pretrained(folder)
    return str(folder)


def test_a_saved_adapter_trains_without_its_dropout_and_exports_saying_so(tiny_model_dir, tmp_path):
    """security_3 E7: an adapter saved with lora_dropout 0.5 made every training forward drop a random half of
    the adapters' input. Loaded by dsrl, two forwards in train mode agree and the config says 0."""
    path = saved_adapter(tiny_model_dir, tmp_path / "adapter", lora_dropout=0.5)
    model = adapted(tiny_model_dir, lora_rank=0, lora_adapter_path=path)
    assert model.peft_config["default"].lora_dropout == 0.0
    for layer in lora_layers(model).values():  # the B matrices start at 0: make the adapters matter
        torch.nn.init.normal_(layer.lora_B["default"].weight)
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(model(ids).logits, model(ids).logits)
    (tmp_path / "export").mkdir()
    model.peft_config["default"].save_pretrained(tmp_path / "export")  # what dsrl.checkpoint.save writes
    assert json.loads((tmp_path / "export" / "adapter_config.json").read_text())["lora_dropout"] == 0.0


def test_a_saved_adapter_s_targets_are_checked_against_this_model(tiny_model_dir, tmp_path):
    path = saved_adapter(tiny_model_dir, tmp_path / "adapter")
    assert target_problems(tiny_model_dir, lora_rank=0, lora_adapter_path=path) == []
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**settings, "target_modules": ["wq"]}))
    (problem,) = target_problems(tiny_model_dir, lora_rank=0, lora_adapter_path=path)
    assert problem.startswith(f"actor_rollout_ref.model.lora_adapter_path={path}: the adapter's target_modules=['wq']")
    assert problem.endswith("fix: start from an adapter trained on actor_rollout_ref.model.path's model")


def moved_adapters(tiny_model_dir, steps: int, lr: float = 3e-5):
    """A rank-32 actor (grpo_lora's adapters) whose ``B`` moved ``lr`` a step for ``steps`` steps, each element in a
    random direction (Adam's step size at grpo_lora's learning rate), in float32."""
    torch.manual_seed(steps)
    model = adapted(tiny_model_dir, lora_rank=32, lora_alpha=32)
    for layer in lora_layers(model).values():
        weight = layer.lora_B["default"].weight
        weight.data = steps * lr * torch.sign(torch.randn_like(weight))
    return model


def merged_share_of_the_update(model) -> float:
    """Of the adapters' update ``s B A`` (float32), the share that survives merging into bfloat16 weights: the
    projection of ``merged - W`` on it, over all adapted layers."""
    merged = dict(iter_merged_parameters(copy.deepcopy(model).to(torch.bfloat16)))
    along = squared = 0.0
    for name, layer in lora_layers(model.requires_grad_(False)).items():
        weight = layer.base_layer.weight.to(torch.bfloat16).float()
        update = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        kept = merged[base_name(f"{name}.weight")].float() - weight
        along, squared = along + float((kept * update).sum()), squared + float((update * update).sum())
    return along / squared


def test_a_bfloat16_merge_rounds_early_updates_away_but_moves_the_logits_no_further_than_bfloat16_does(
    tiny_model_dir,
):
    """gpu_path_3 G2: merged into bfloat16 weights, most of an early update is rounded away (its elements are below
    half a bfloat16 step of the weights they add to). The actor's own bfloat16 forward loses it too: PEFT adds
    ``B A x`` into a bfloat16 activation (vLLM's LoRA kernels do the same), so a merged push samples no further
    from the bfloat16 actor than that actor is from its exact (float32) self. This is why lora.merge stays true in
    bfloat16; the adapter (lora_adapter/ of an export) remains the exact trained result."""
    ids = torch.randint(0, 100, (4, 48), generator=torch.Generator().manual_seed(0))
    shares = {}
    for steps in (1, 10, 30):
        model = moved_adapters(tiny_model_dir, steps)
        shares[steps] = merged_share_of_the_update(model)
        with torch.no_grad():
            exact = model(ids).logits
            actor = copy.deepcopy(model).to(torch.bfloat16)(ids).logits.float()
            plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
            plain.load_state_dict(dict(iter_merged_parameters(copy.deepcopy(model).to(torch.bfloat16))), strict=False)
            rollout = plain(ids).logits.float()
        assert (rollout - actor).norm() <= 1.5 * (actor - exact).norm(), steps
    assert shares[1] < 0.5 and shares[30] > 0.9, shares
