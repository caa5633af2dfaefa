"""Validation of the LoRA keys (``actor_rollout_ref.model.lora_*``, ``model.lora.merge``): the rules, the adapter
to start from, the reference setup a LoRA run never uses, and the critic's verl keys dsrl does not train with."""

from __future__ import annotations

import json

import pytest

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


def adapter(folder, **settings) -> str:
    """A saved adapter's settings (validation reads adapter_config.json alone)."""
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **settings}))
    return str(folder)


def test_a_saved_adapter_is_read_at_validation_rank_alpha_and_targets_against_the_keys(tmp_path):
    """security_3 E3 (lora_rank=16 with an r=8 adapter: a traceback after the model loaded), E4 (a cut
    adapter_config.json: the same), E5 (lora_alpha=16 with an alpha-64 adapter: silently 64)."""
    files = stub_file_overrides(tmp_path)
    path = adapter(tmp_path / "a", lora_alpha=64, target_modules=["q_proj", "v_proj"])
    start = f"{M}.lora_adapter_path={path}"
    (problem,) = config_problems(recipe("grpo"), [*files, start, f"{M}.lora_rank=16"])
    assert problem == (
        f"{M}.lora_rank=16: the adapter at lora_adapter_path has rank 8, which the run trains with; "
        f"fix: set {M}.lora_rank=8 (or 0: the adapter's rank)"
    )
    (problem,) = config_problems(recipe("grpo"), [*files, start, f"{M}.lora_alpha=16"])
    assert problem.startswith(f"{M}.lora_alpha=16: the adapter at lora_adapter_path has lora_alpha 64")
    assert problem.endswith(f"fix: set {M}.lora_alpha=64, or leave it out")
    (problem,) = config_problems(recipe("grpo"), [*files, start, f"{M}.target_modules=all-linear"])
    assert problem.startswith(f"{M}.target_modules=all-linear: the adapter at lora_adapter_path has target_modules")
    # the adapter's own values given again, or not given: accepted
    same = [f"{M}.lora_rank=8", f"{M}.lora_alpha=64", f"{M}.target_modules=[v_proj,q_proj]"]
    assert config_problems(recipe("grpo"), [*files, start, *same]) == []
    assert config_problems(recipe("grpo"), [*files, start]) == []

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA", ')
    (problem,) = config_problems(recipe("grpo"), [*files, f"{M}.lora_adapter_path={cut}"])
    assert problem.startswith(
        f"{M}.lora_adapter_path={cut}: not a LoRA adapter directory: adapter_config.json is not valid JSON"
    )


@pytest.mark.parametrize(
    "settings, what",
    [
        ({"use_dora": True}, "use_dora=True: DoRA rescales each column"),  # security_3 E6
        ({"bias": "all"}, "bias='all': trained biases are parameters outside lora_A and lora_B"),  # E7
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']: fully trained modules"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices=[1, 2]"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters=['mlp.experts.gate_up_proj']"),
        ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication="),
        ({"alora_invocation_tokens": [5]}, "alora_invocation_tokens=[5]"),
        ({"peft_type": "IA3"}, "not a LoRA adapter directory: a 'IA3' adapter, not LoRA"),
        ({"r": 0}, "adapter_config.json has r=0: a LoRA adapter's rank is a positive whole number"),
        ({"r": "8"}, "has r='8'"),
    ],
)
def test_adapter_settings_dsrl_does_not_train_are_refused(tmp_path, settings, what):
    files = stub_file_overrides(tmp_path)
    path = adapter(tmp_path / "a", **settings)
    (problem,) = config_problems(recipe("grpo"), [*files, f"{M}.lora_adapter_path={path}"])
    assert problem.startswith(f"{M}.lora_adapter_path={path}: ") and what in problem, problem
    assert "; fix: " in problem


@pytest.mark.parametrize(
    "settings", [{"use_dora": False, "bias": "none", "modules_to_save": None}, {"lora_dropout": 0.0}]
)
def test_a_plain_lora_adapter_with_peft_s_defaults_written_out_is_accepted(tmp_path, settings):
    files = stub_file_overrides(tmp_path)
    assert (
        config_problems(recipe("grpo"), [*files, f"{M}.lora_adapter_path={adapter(tmp_path / 'a', **settings)}"]) == []
    )


def test_an_adapter_s_dropout_is_set_to_0_with_a_note(tmp_path):
    """security_3 E7: PEFT applied the saved lora_dropout 0.5 in every training pass (and none in the rollout's):
    the rollout/actor gap rose from ~1e-7 to 0.015, silently. dsrl neutralises it and says so."""
    from dsrl.config import load_and_validate

    files = stub_file_overrides(tmp_path)
    path = adapter(tmp_path / "a", lora_dropout=0.5)
    _, notes = load_and_validate(recipe("grpo"), [*files, f"{M}.lora_adapter_path={path}"], 1)
    assert f"{M}.lora_adapter_path: the adapter's lora_dropout 0.5 is set to 0 for this run" in "\n".join(notes)
    _, notes = load_and_validate(recipe("grpo"), [*files, f"{M}.lora_adapter_path={adapter(tmp_path / 'b')}"], 1)
    assert not any("lora_dropout" in note for note in notes)


def test_validate_only_refuses_lora_targets_the_model_does_not_have(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """security_3 E8: target_modules=[nothing_matches] passed validation and failed 10 s into the run with PEFT's
    traceback. Now --validate-only refuses it (exit code 2), the model built on the meta device from config.json."""
    from dsrl.commands.train import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    files = [*stub_file_overrides(tmp_path)[:2], f"{M}.path={tiny_model_dir}"]
    args = [*recipe("grpo"), *files, f"{M}.lora_rank=8", "--validate-only"]
    assert main([*args, f"{M}.target_modules=[nothing_matches]"]) == 2
    err = capsys.readouterr().err
    assert f"  {M}.target_modules=['nothing_matches'] (exclude_modules=None) matched no module of the model" in err
    assert main([*args, f"{M}.target_modules=[q_proj]"]) == 0
