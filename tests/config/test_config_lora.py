"""Validation of the LoRA keys (``actor_rollout_ref.model.lora_*``, ``model.lora.merge``): the rules, the adapter
to start from, the reference setup a LoRA run never uses, and the critic's verl keys dsrl does not train with."""

from __future__ import annotations

import json

from tests.conftest import config_problems, recipe, stub_file_overrides

M = "actor_rollout_ref.model"


def test_the_lora_recipe_and_lora_on_every_recipe_validate(tmp_path):
    files = stub_file_overrides(tmp_path)
    assert config_problems(recipe("grpo_lora"), files) == []
    for name in ("grpo", "ppo", "rloo", "opo", "otb", "dapo", "reinforce_pp"):
        assert config_problems(recipe(name), [*files, f"{M}.lora_rank=8", f"{M}.lora.merge=true"]) == [], name


def test_bad_lora_settings_are_refused_naming_the_key(tmp_path):
    files = stub_file_overrides(tmp_path)
    assert any(
        p.startswith(f"{M}.lora_rank=-1: must be >= 0")
        for p in config_problems(recipe("grpo"), [*files, f"{M}.lora_rank=-1"])
    )
    problems = config_problems(
        recipe("grpo"),
        [*files, f"{M}.lora_rank=8", f"{M}.lora_alpha=0", f"{M}.target_modules=[]", f"{M}.exclude_modules=''"],
    )
    assert any(p.startswith(f"{M}.lora_alpha=0: must be > 0") for p in problems), problems
    assert any(p.startswith(f"{M}.target_modules=[]: must be all-linear") for p in problems), problems
    assert any(p.startswith(f"{M}.exclude_modules=: must be all-linear") for p in problems), problems
    # at lora_rank 0 (full fine-tuning) the other settings are not read
    assert config_problems(recipe("grpo"), [*files, f"{M}.lora_alpha=0"]) == []


def test_the_adapter_to_start_from_must_be_a_peft_directory(tmp_path):
    files = stub_file_overrides(tmp_path)
    problems = config_problems(recipe("grpo"), [*files, f"{M}.lora_adapter_path={tmp_path}"])
    assert any(p.startswith(f"{M}.lora_adapter_path={tmp_path}: not a PEFT adapter directory") for p in problems), (
        problems
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    assert config_problems(recipe("grpo"), [*files, f"{M}.lora_adapter_path={tmp_path}"]) == []


def test_a_reference_setup_is_refused_with_lora_and_critic_lora_keys_always(tmp_path):
    files = stub_file_overrides(tmp_path)
    ref = "actor_rollout_ref.ref.deepspeed_config=zero3_offload_inference"
    problems = config_problems(recipe("grpo"), [*files, f"{M}.lora_rank=8", ref])
    assert any(p.startswith(f"{ref}: a LoRA run builds no reference engine") for p in problems), problems
    assert config_problems(recipe("grpo"), [*files, ref]) == []
    problems = config_problems(recipe("ppo"), [*files, "critic.model.lora_rank=8"])
    assert any(p.startswith("critic.model.lora_rank=8: the critic trains in full") for p in problems), problems
