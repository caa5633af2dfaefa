"""``dsrl-convert`` on checkpoints of real runs (the tiny model, 2 steps, a checkpoint after each, the trainer's own
export in each): the converted model is the export file for file and bit for bit, and computes what the engine
computes; the critic, the LoRA adapter and merged model, DeepSpeed's universal form; and the refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrl.checkpoint.save import HF_DIR, sha256_file, step_dir
from dsrl.commands.convert import VALUE_HEAD_FILE, main
from dsrl.config.layout import ADAPTER_DIR
from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.helpers.engines import make_batch
from tests.helpers.resume import REPO
from tests.helpers.tampered import model_with_code, rewrite_state, with_payload
from tests.helpers.trainer import trainer_for

pytestmark = pytest.mark.e2e

EXPORT = (
    "trainer.save_freq=1",
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
)
# LoRA: no lr warm-up and a large lr, so that B leaves 0 at the first step and both steps move every adapter.
LORA = (
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
)


def files(directory: Path) -> dict[str, str]:
    """Every file under ``directory``, relative, with its SHA-256."""
    return {str(p.relative_to(directory)): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def convert_without_launcher(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m dsrl.commands.convert`` in a fresh process, without a launcher's variables or a chosen accelerator
    (``env``: variables to set)."""
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARIABLES, "DS_ACCELERATOR")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "dsrl.commands.convert", *map(str, args)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_same_tensors(converted: Path, exported: Path) -> None:
    from safetensors.torch import load_file

    def tensors(directory):
        return {k: v for shard in sorted(directory.glob("*.safetensors")) for k, v in load_file(shard).items()}

    got, expected = tensors(converted), tensors(exported)
    assert got.keys() == expected.keys() and got
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path_factory):
    """PPO in bfloat16 (the fp32 master weights cast into the engine's) on ZeRO-3 + offload, 2 steps: its trainer
    (the engines at step 2) and checkpoint root."""
    root = tmp_path_factory.mktemp("ppo_run")
    trainer = trainer_for(
        "ppo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        root,
        *EXPORT,
        "actor_rollout_ref.model.dtype=bfloat16",
        f"critic.model.path={tiny_model_dir}",
        f"critic.deepspeed_config={ds_test_config('zero3_offload')}",
    )
    trainer.fit()
    return trainer, root


def test_the_actor_converts_to_the_trainers_export_bit_for_bit(ppo_run, tmp_path):
    """Each step's DeepSpeed checkpoint gives the files the trainer exported at that step, byte for byte (step 2 in
    a process without a launcher or a process group, step 1 with its base model copied elsewhere); the model
    loads with transformers and its logits are the engine's."""
    from transformers import AutoModelForCausalLM

    trainer, root = ppo_run
    result = convert_without_launcher(step_dir(root, 2), tmp_path / "step2")
    assert result.returncode == 0, result.stderr[-3000:]
    last_line = result.stdout.splitlines()[-1]  # after DeepSpeed's note on the accelerator it picked
    assert last_line.startswith(f"{tmp_path / 'step2'}: the actor as a Hugging Face model in bfloat16")
    moved = shutil.copytree(trainer.cfg.actor_rollout_ref.model.path, tmp_path / "moved_base")  # the base moved away
    assert main([str(step_dir(root, 1)), str(tmp_path / "step1"), "--model-path", str(moved)]) == 0
    for step in (1, 2):
        exported = step_dir(root, step) / "actor" / HF_DIR
        assert files(tmp_path / f"step{step}") == files(exported)
        assert_same_tensors(tmp_path / f"step{step}", exported)
    assert files(tmp_path / "step1") != files(tmp_path / "step2")  # the second step moved the weights

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "step2", dtype=torch.bfloat16).eval()
    inputs, _ = model_inputs_of_test_batch()
    trainer.actor.engine.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, trainer.actor.engine(**inputs).logits)


def model_inputs_of_test_batch():
    from dsrl.engines.forward import model_inputs

    return model_inputs(make_batch(), torch.device("cpu"))


def test_the_critic_converts_to_a_base_model_and_a_value_head_giving_the_engines_values(ppo_run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModel

    from dsrl.engines.critic import ValueModel

    trainer, root = ppo_run
    assert main([str(step_dir(root, 2)), str(tmp_path / "value"), "--role", "critic"]) == 0
    backbone = AutoModel.from_pretrained(tmp_path / "value", dtype=torch.bfloat16)
    head = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=torch.bfloat16)
    head.load_state_dict(load_file(tmp_path / "value" / VALUE_HEAD_FILE))
    inputs, width = model_inputs_of_test_batch()
    trainer.critic.engine.eval()
    with torch.no_grad():
        expected = trainer.critic.engine(**inputs, response_width=width)
        assert torch.equal(ValueModel(backbone, head).eval()(**inputs, response_width=width), expected)


def test_universal_form_holds_each_roles_fp32_weights(ppo_run, tmp_path):
    """DeepSpeed's universal checkpoint of both roles: each parameter's fp32 master weight as zero_to_fp32 reads it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, root = ppo_run
    checkpoint = step_dir(root, 2)
    assert main([str(checkpoint), str(tmp_path / "universal"), "--universal"]) == 0
    for role in ("actor", "critic"):
        master = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / role), tag="ds")
        saved = tmp_path / "universal" / role / "ds" / "zero"
        first_names = {}  # a tied weight is one parameter under its first name (the actor's LM head: the embedding)
        for name, tensor in master.items():
            first_names.setdefault(id(tensor), name)
        assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == sorted(first_names.values())
        for name in first_names.values():  # ZeRO-3's fp32.pt: the tensor alone, flat
            assert torch.equal(torch.load(saved / name / "fp32.pt"), master[name].flatten()), name


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "were written; fix: point at a complete global_step_N directory"),
        ("changed", "changed since it was written (its SHA-256 does not match): the checkpoint is damaged"),
        ("no_actor", "holds no actor state (it holds: critic; trainer.max_actor_ckpt_to_keep pruned"),
        ("no_critic", "holds no critic state (it holds: actor; only algorithm.adv_estimator=gae"),
        ("model_path", "--model-path=/nonexistent/base: no such model directory"),
        ("no_tokenizer", "no tokenizer files"),
        ("adapter_only", "--adapter-only: "),
    ],
)
def test_a_damaged_checkpoint_or_a_missing_part_is_refused_in_one_line(
    ppo_run, tiny_model_dir, tmp_path, capsys, damage, message
):
    _, root = ppo_run
    checkpoint = tmp_path / "global_step_2"
    shutil.copytree(step_dir(root, 2), checkpoint)
    out, options = tmp_path / "out", []
    ds_file = next((checkpoint / "actor" / "ds").glob("*optim_states.pt"))
    if damage == "truncated":
        ds_file.write_bytes(ds_file.read_bytes()[:-1])
    elif damage == "changed":
        data = bytearray(ds_file.read_bytes())
        data[-100] ^= 1
        ds_file.write_bytes(bytes(data))
    elif damage == "no_actor":
        shutil.rmtree(checkpoint / "actor")
    elif damage == "no_critic":
        shutil.rmtree(checkpoint / "critic")
        options = ["--role", "critic"]
    elif damage == "model_path":
        options = ["--model-path", "/nonexistent/base"]
    elif damage == "no_tokenizer":
        base = tmp_path / "base"
        shutil.copytree(tiny_model_dir, base, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
        options = ["--model-path", str(base)]
    elif damage == "adapter_only":
        options = ["--adapter-only"]
    assert main([str(checkpoint), str(out), *options]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("dsrl-convert: ") and message in error, error
    assert "fix: " in error
    assert not out.exists()


@pytest.mark.parametrize("layer", ["check", "load"])
@pytest.mark.parametrize(
    "options, file",
    [
        ([], "actor/ds/zero_pp_rank_0_mp_rank_00_model_states.pt"),
        (["--role", "critic"], "critic/ds/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        (["--universal"], "critic/ds/zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ],
)
def test_a_checkpoint_whose_files_hold_code_is_refused_naming_the_file_and_the_code_never_runs(
    ppo_run, tmp_path, capsys, monkeypatch, options, file, layer
):
    """The review's F7: a pickled call of os.system in one of DeepSpeed's files, the manifest's SHA-256 and the
    state's checksum recomputed. Refused in one line naming the file, by the check before anything loads
    (``check``) and, with that check skipped, by the loads themselves, DeepSpeed's included (``load``); the
    payload never runs. Loaded as DeepSpeed 0.19.8 loads it (weights_only=False), it does."""
    import dsrl.commands.convert

    _, root = ppo_run
    marker = tmp_path / "marker"
    checkpoint = with_payload(step_dir(root, 2), tmp_path / "global_step_2", marker, file)
    if layer == "load":
        monkeypatch.setattr(dsrl.commands.convert, "pickled_code_problems", lambda *args, **kwargs: [])
    assert main([str(checkpoint), str(tmp_path / "out"), *options]) == 2
    error = capsys.readouterr().err
    if layer == "check":  # before anything loads: the refusal alone
        assert error.count("\n") == 1, error
    else:  # after the progress lines of what loaded before that file
        error = error.splitlines()[-1]
    assert error.startswith(f"dsrl-convert: {checkpoint}"), error
    named = file if layer == "check" else file.partition("/")[2]  # the loads name it within the role's folder
    assert f"{named} holds pickled Python beyond tensors and plain values (a reference to posix.system)" in error
    assert "fix: " in error
    assert not marker.exists()
    if layer == "check":
        assert not (tmp_path / "out").exists()
    torch.load(checkpoint / file, weights_only=False)
    assert marker.read_text().startswith("code ran in pid")


def test_trust_remote_code_comes_from_the_command_line_never_from_the_checkpoint(ppo_run, tiny_model_dir, tmp_path):
    """The review's F9: the checkpoint's state edited to run the code of a model that leaves a mark when imported
    (``actor_rollout_ref.model.trust_remote_code: true``, its path that model; hashes recomputed). Without
    --trust-remote-code it is refused, with or without --model-path, and the code never runs; a checkpoint that
    does not ask for it loads the built-in class from the same directory; --trust-remote-code runs it."""
    _, root = ppo_run
    marker = tmp_path / "marker"
    model = model_with_code(tiny_model_dir, tmp_path / "model_with_code", marker)
    checkpoint = tmp_path / "global_step_2"
    shutil.copytree(step_dir(root, 2), checkpoint)
    trusting = {"actor_rollout_ref.model.trust_remote_code": True, "actor_rollout_ref.model.path": str(model)}
    rewrite_state(checkpoint, config=trusting)
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers copies a model's code to import it
    for options in ([], ["--model-path", str(model)]):
        result = convert_without_launcher(checkpoint, tmp_path / "refused", *options, env=env)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "actor_rollout_ref.model.trust_remote_code=true in the checkpoint" in result.stderr
        assert "fix: --trust-remote-code, if you trust the code in that directory" in result.stderr
        assert not marker.exists() and not (tmp_path / "refused").exists()

    rewrite_state(checkpoint, config={"actor_rollout_ref.model.trust_remote_code": False})
    result = convert_without_launcher(checkpoint, tmp_path / "built_in", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()
    assert files(tmp_path / "built_in") != {}

    rewrite_state(checkpoint, config={"actor_rollout_ref.model.trust_remote_code": True})
    result = convert_without_launcher(checkpoint, tmp_path / "asked", "--trust-remote-code", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.read_text() == "remote code imported\n"


@pytest.mark.parametrize("stage", ["zero3_offload", pytest.param("zero2", marks=pytest.mark.slow)])
def test_lora_converts_to_the_trainers_merged_model_and_adapter_bit_for_bit(
    stage, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """A LoRA actor's checkpoint holds the adapters alone: with the base from model.path, the merged model and its
    lora_adapter/ are the trainer's export, byte for byte; --adapter-only writes the adapter alone. In bfloat16,
    where ZeRO-2 holds the adapters in bfloat16 and ZeRO-3 in float32 (PEFT's)."""
    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path / "run",
        *EXPORT,
        *LORA,
        "actor_rollout_ref.model.dtype=bfloat16",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config(stage)}",
    )
    trainer.fit()
    checkpoint = step_dir(tmp_path / "run", 2)
    exported = checkpoint / "actor" / HF_DIR
    assert (exported / ADAPTER_DIR).is_dir()
    assert main([str(checkpoint), str(tmp_path / "merged")]) == 0
    assert files(tmp_path / "merged") == files(exported)
    assert_same_tensors(tmp_path / "merged", exported)
    assert main([str(checkpoint), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert files(tmp_path / "adapter") == files(exported / ADAPTER_DIR)
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "merged" / "model-00001-of-00001.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q_proj], base[q_proj].to(torch.bfloat16))  # the adapters moved the merged weights
