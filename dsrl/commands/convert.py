"""The ``dsrl-convert`` command: a checkpoint of a run as a model, in one process, without GPUs or the launcher.

    dsrl-convert checkpoints/global_step_40 out/policy                     # the actor as a Hugging Face model
    dsrl-convert checkpoints/global_step_40 out/adapter --adapter-only     # a LoRA actor's adapter alone
    dsrl-convert checkpoints/global_step_40 out/value --role critic        # PPO's value model
    dsrl-convert checkpoints/global_step_40 out/universal --universal      # DeepSpeed's universal checkpoint

What OUT holds:

- the actor (default): what the trainer's own export (``dsrl.checkpoint.save.export_hf_model``, written into a
  checkpoint with ``hf_model`` in ``actor_rollout_ref.actor.checkpoint.save_contents``) writes for that step,
  file for file and bit for bit: safetensors shards with their index, ``config.json``, ``generation_config.json``
  and the tokenizer, in the run's ``actor_rollout_ref.model.dtype``; of a LoRA actor, the merged model
  (``W + (alpha / r) B A``, ``dsrl.engines.lora.iter_merged_parameters``) and its adapter in ``lora_adapter/``.
- ``--adapter-only``: a LoRA actor's adapter alone, as a PEFT directory (``dsrl.checkpoint.save.save_adapter``).
- ``--role critic``: PPO's value model, ``dsrl.engines.critic.ValueModel``: its backbone as a transformers base
  model directory (``AutoModel.from_pretrained(OUT)``: safetensors, ``config.json``, the tokenizer) and its value
  head in ``value_head.safetensors`` (``weight`` [1, hidden], ``bias`` [1]); a token's value is the head applied
  to the backbone's last hidden state at the position before it.
- ``--universal``: each trained role's (or ``--role``'s) DeepSpeed checkpoint in universal form under
  ``OUT/<role>/ds`` (``dsrl.checkpoint.universal.convert``, which ``trainer.resume_allow_world_size_change``
  runs by itself when a run resumes at another world size), for DeepSpeed's ``checkpoint.load_universal``.

How: the checkpoint is checked first, as a resume checks it (``state_problem``, ``fields_problem``, the SHA-256
of each file of the role against the manifest, and each torch file unpickled as data: ``pickled_code_problems``);
every file is loaded as data (``weights_only_loads``), DeepSpeed's loads included, so a checkpoint from elsewhere
runs no code. The base model's own code (``auto_map`` in its ``config.json``) runs only with
``--trust-remote-code``, never because the checkpoint's settings say so. DeepSpeed's ``zero_to_fp32`` reads the
fp32 master weights out of the ZeRO partitions (any stage, any world size), one tensor at a time. They are cast into the
model built as the engine builds it, from the run's ``actor_rollout_ref.model.path`` (``critic.model.path``) in
the run's dtype: DeepSpeed casts the master weights into the engine's own after every optimizer step, so
the cast gives the engine's weights bit for bit. The trainer's export function then writes them. A
DeepSpeed checkpoint holds weights alone: the config, generation config and tokenizer (and a LoRA actor's
frozen base) come from that model directory, which ``--model-path`` replaces when it has moved.

Exit codes: 0 written; 2 a directory that is not a complete dsrl checkpoint of the role (one line: what is
wrong and the fix), a file in it that holds more than data, a base model directory that is missing or not the
run's, a run with ``trust_remote_code`` converted without ``--trust-remote-code``, an OUT that is not empty.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_files
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForCausalLM

from dsrl.checkpoint.resume import fields_problem
from dsrl.checkpoint.save import (
    DS_TAG,
    STATE_FILE,
    CheckpointError,
    complete_steps,
    export_hf_model,
    file_problems,
    frozen_checksum,
    pickled_code_problems,
    save_adapter,
    state_problem,
    step_dir,
    weights_only_loads,
)
from dsrl.checkpoint.universal import convert as convert_to_universal
from dsrl.config.files import model_dir_problems, model_path_problem
from dsrl.config.schema import lora_enabled
from dsrl.data.datasets import load_tokenizer
from dsrl.engines.critic import ValueModel
from dsrl.engines.deepspeed_setup import DTYPES
from dsrl.engines.lora import add_adapters

ROLES = ("actor", "critic")
# The config section of each role's model in the checkpoint's saved settings.
MODEL_KEYS = {"actor": "actor_rollout_ref.model", "critic": "critic.model"}
VALUE_HEAD_FILE = "value_head.safetensors"
_FIX_CHECKPOINT = "fix: point at a complete global_step_N directory written by dsrl"


class ConvertError(ValueError):
    """A checkpoint, base model or output this command refuses: what is wrong and the fix, in one line."""


# ---- the checkpoint ----------------------------------------------------------------------------


def checked_state(directory: Path, role: str) -> dict[str, Any]:
    """The state of ``directory`` once it is a complete dsrl checkpoint that holds ``role``'s engine with every
    file of it as written (size and SHA-256 against the manifest); ConvertError otherwise."""
    if not directory.is_dir():
        raise ConvertError(f"{directory}: no such directory; {_FIX_CHECKPOINT}")
    if not (directory / STATE_FILE).exists():  # state_problem says so, after these two foreign kinds
        if (directory / "config.json").is_file():
            raise ConvertError(
                f"{directory} is a Hugging Face model already (config.json, no {STATE_FILE}): "
                "nothing to convert; load it with from_pretrained"
            )
        if steps := complete_steps(directory):
            raise ConvertError(
                f"{directory} is a run folder, not a checkpoint; fix: point at one of its checkpoints, "
                f"e.g. {step_dir(directory, max(steps))}"
            )
    elif not (directory / role / DS_TAG).is_dir():  # before the manifest, which still lists a pruned role's files
        held = [r for r in ROLES if (directory / r / DS_TAG).is_dir()]
        why = (
            "trainer.max_actor_ckpt_to_keep pruned the actor's state from it"
            if role == "actor"
            else "only algorithm.adv_estimator=gae (PPO) trains a critic"
        )
        raise ConvertError(
            f"{directory} holds no {role} state (it holds: {', '.join(held) or 'nothing'}; {why}); "
            f"fix: {'--role ' + held[0] + ', or ' if held else ''}a checkpoint that holds it"
        )
    state, problem = state_problem(directory)
    if problem is not None:
        raise ConvertError(
            f"{directory}: {problem}; {_FIX_CHECKPOINT} (a save that never finished leaves "
            ".tmp_global_step_N, which is not one)"
        )
    if problem := fields_problem(state, [role]):
        raise ConvertError(f"{directory}: {problem}; {_FIX_CHECKPOINT}")
    files = {name: entry for name, entry in state["files"].items() if name.startswith(f"{role}/")}
    if changed := file_problems(directory, files, rank=0, world=1):
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise ConvertError(
            f"{directory}: {changed[0]}{more}: the checkpoint is damaged; fix: convert another "
            "checkpoint, or restore this one from a copy"
        )
    if unsafe := pickled_code_problems(directory, files, rank=0, world=1):
        raise ConvertError(
            f"{directory}: {unsafe[0]}; fix: convert a checkpoint that dsrl wrote (one from elsewhere may carry "
            "code: docs/checkpoints.md)"
        )
    return state


def model_settings(state: dict[str, Any], role: str, model_path: str | None, trust_remote_code: bool) -> DictConfig:
    """``role``'s model settings as the run had them (``actor_rollout_ref.model``, ``critic.model``: path, LoRA,
    trust_remote_code), its path replaced by ``model_path`` when given. The base model's code runs only when the run
    ran it and the user allows it (``trust_remote_code``: ``--trust-remote-code``); a checkpoint, which anyone can
    edit, does not decide it: ConvertError when the run ran it and the user does not allow it."""
    section = MODEL_KEYS[role]
    tree = OmegaConf.create()
    for key, value in state["config"].items():
        if key.startswith(f"{section}."):
            OmegaConf.update(tree, key, value, force_add=True)
    settings = OmegaConf.select(tree, section)
    if model_path is not None:
        settings.path = model_path
    if settings.trust_remote_code and not trust_remote_code:
        raise ConvertError(
            f"{section}.trust_remote_code=true in the checkpoint: the run built its model with the code shipped in "
            f"{settings.path} (config.json's auto_map); dsrl-convert runs a model's code only when asked; fix: "
            "--trust-remote-code, if you trust the code in that directory"
        )
    return settings


def checked_base_model(settings: DictConfig, role: str, given: bool) -> None:
    """ConvertError unless ``settings.path`` is a complete model directory (config, weights, tokenizer) or a hub
    id: a DeepSpeed checkpoint holds the trained weights alone, the rest comes from there."""
    key = "--model-path" if given else f"{MODEL_KEYS[role]}.path"
    problem = model_path_problem(settings.path)
    local = Path(settings.path).expanduser()
    if problem is None and local.is_dir() and (problems := model_dir_problems(local, tokenizer=True)):
        problem = problems[0][0]
    if problem is not None:
        raise ConvertError(
            f"{key}={settings.path}: {problem}; the checkpoint holds the trained weights alone: config.json, "
            "generation_config.json and the tokenizer (and a LoRA actor's frozen base) come from the run's base "
            "model; fix: --model-path DIR, the run's base model (a copy of it, or its hub id)"
        )


# ---- the model ---------------------------------------------------------------------------------


def load_trained_weights(module: torch.nn.Module, role_dir: Path, *, trained_only: bool) -> None:
    """Put the fp32 master weights of the ZeRO checkpoint ``role_dir/ds`` (DeepSpeed's ``zero_to_fp32``: any stage,
    any world size, a tensor at a time) into ``module``'s parameters, each cast to the dtype the engine held it in
    (recorded in the checkpoint's module state) as DeepSpeed casts the master weights into the engine's after
    each step. ZeRO-1/2 engines hold every parameter in the run's dtype; ZeRO-3 ones leave the parameters made
    after loading (LoRA adapters: float32) as PEFT made them. ``trained_only``: the checkpoint holds the
    parameters that train alone (a LoRA actor's adapters); the frozen ones stay as loaded."""
    ds_dir = role_dir / DS_TAG
    # DeepSpeed's progress lines go to stderr: stdout says what was written
    with weights_only_loads(role_dir), contextlib.redirect_stdout(sys.stderr):
        saved = get_fp32_state_dict_from_zero_checkpoint(
            str(role_dir), tag=DS_TAG, exclude_frozen_parameters=trained_only, lazy_mode=True
        )
        engine_state = torch.load(
            get_model_state_files(str(ds_dir))[0], map_location="cpu", mmap=True, weights_only=True
        )
    dtypes = {name: tensor.dtype for name, tensor in engine_state["module"].items()}
    params = {name: p for name, p in module.named_parameters() if p.requires_grad or not trained_only}
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}  # tied weights under each name
    known |= {name for name, _ in module.named_buffers()}  # buffers are the base model's, not exported
    missing, foreign = sorted(params.keys() - (saved.keys() & dtypes.keys())), sorted(saved.keys() - known)
    if missing or foreign:
        raise ConvertError(
            f"{role_dir}: its parameters are not those of the model built from the base model (missing from the "
            f"checkpoint: {missing[:3] or 'none'}; not in the model: {foreign[:3] or 'none'}); fix: --model-path DIR, "
            "the run's base model"
        )
    for name, param in params.items():
        tensor = saved[name].contiguous()
        if tensor.shape != param.shape:
            raise ConvertError(
                f"{role_dir}: {name} is {tuple(tensor.shape)} in the checkpoint, {tuple(param.shape)} "
                "in the base model; fix: --model-path DIR, the run's base model"
            )
        param.data = tensor.to(dtypes[name])


def actor_model(settings: DictConfig, dtype: str, checkpoint: Path, state: dict[str, Any]) -> torch.nn.Module:
    """The actor as its engine held it at the checkpoint: loaded as ``ActorEngine`` loads it (a ``PeftModel`` for
    LoRA, whose base must be the one the adapters trained on: ``frozen_checksum``), the checkpoint's weights in."""
    module = AutoModelForCausalLM.from_pretrained(
        settings.path, dtype=DTYPES[dtype], trust_remote_code=settings.trust_remote_code
    )
    lora = lora_enabled(settings)
    if lora:
        try:
            module = add_adapters(module, settings)
        except ValueError as err:  # the run started from lora_adapter_path, which is gone: the key and the fix
            raise ConvertError(str(err)) from err
        if frozen_checksum(module) != state["frozen_checksums"]["actor"]:
            raise ConvertError(
                f"{settings.path}: not the base model the LoRA adapters of {checkpoint} were trained on (the frozen "
                "weights' checksum differs from the checkpoint's); fix: --model-path DIR, the run's base model"
            )
    load_trained_weights(module, checkpoint / "actor", trained_only=lora)
    return module


def critic_model(settings: DictConfig, dtype: str, checkpoint: Path) -> ValueModel:
    """PPO's value model as its engine held it: the backbone loaded as ``CriticEngine`` loads it and a value head,
    the checkpoint's weights in both."""
    backbone = AutoModel.from_pretrained(
        settings.path, dtype=DTYPES[dtype], trust_remote_code=settings.trust_remote_code
    )
    module = ValueModel(backbone, torch.nn.Linear(backbone.config.hidden_size, 1, dtype=DTYPES[dtype]))
    load_trained_weights(module, checkpoint / "critic", trained_only=False)
    return module


# ---- the command -------------------------------------------------------------------------------


def convert(
    checkpoint: Path,
    out: Path,
    *,
    role: str | None = None,
    adapter_only: bool = False,
    universal: bool = False,
    model_path: str | None = None,
    trust_remote_code: bool = False,
) -> str:
    """Write ``out`` from ``checkpoint`` (module doc); what was written, in words. ConvertError when refused."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} exists and is not an empty directory; fix: name a new directory, or remove it")
    if universal:
        if adapter_only:
            raise ConvertError("--adapter-only writes a model, --universal a DeepSpeed checkpoint; fix: drop one")
        roles = [role] if role else [r for r in ROLES if (checkpoint / r / DS_TAG).is_dir()] or ["actor"]
        for name in roles:
            checked_state(checkpoint, name)
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's progress lines
            convert_to_universal(checkpoint, roles, out)
        return f"the DeepSpeed universal checkpoint of {', '.join(roles)} ({', '.join(f'{r}/{DS_TAG}' for r in roles)})"
    role = role or "actor"
    if adapter_only and role != "actor":
        raise ConvertError("--adapter-only: only the actor trains LoRA adapters; fix: drop --role critic")
    state = checked_state(checkpoint, role)
    settings = model_settings(state, role, model_path, trust_remote_code)
    if adapter_only and not lora_enabled(settings):
        raise ConvertError(
            f"--adapter-only: {checkpoint} is of a full fine-tuning (actor_rollout_ref.model.lora_rank="
            f"{settings.lora_rank}), which has no adapter; fix: drop --adapter-only"
        )
    checked_base_model(settings, role, given=model_path is not None)
    dtype = state["config"]["actor_rollout_ref.model.dtype"]
    try:  # the run's tokenizer is the actor's; the critic reads the same tokens (the recipes give both one path)
        tokenizer = load_tokenizer(settings.path, trust_remote_code=settings.trust_remote_code)
    except ValueError as err:  # a hub id that does not load: the key, the reason, the fix
        raise ConvertError(str(err)) from err
    if role == "critic":
        value_model = critic_model(settings, dtype, checkpoint)
        export_hf_model(value_model.backbone, tokenizer, out)
        head = {name: tensor.detach().contiguous() for name, tensor in value_model.value_head.state_dict().items()}
        save_file(head, str(out / VALUE_HEAD_FILE), metadata={"format": "pt"})
        return f"the critic's backbone as a transformers base model ({dtype}) and its value head in {VALUE_HEAD_FILE}"
    module = actor_model(settings, dtype, checkpoint, state)
    if adapter_only:
        save_adapter(module, out)
        return "the actor's LoRA adapter (a PEFT directory)"
    export_hf_model(module, tokenizer, out)
    merged = ""
    if lora_enabled(settings):  # bfloat16 weights round a small update out of the merge; the adapter keeps it
        exact = ", the exact result" if dtype == "bfloat16" else ""
        merged = f" (merged; its adapter in lora_adapter/{exact})"
    return f"the actor as a Hugging Face model{merged} in {dtype}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dsrl-convert",
        description="A dsrl checkpoint (global_step_N) as a Hugging Face model, a LoRA adapter, PPO's value model or "
        "a DeepSpeed universal checkpoint; one process, no GPU, no launcher.",
    )
    parser.add_argument("checkpoint", type=Path, help="a global_step_N directory written by dsrl")
    parser.add_argument("out", type=Path, help="the directory to write (new, or empty)")
    parser.add_argument(
        "--role",
        choices=ROLES,
        help="actor (default) or critic: PPO's value model, its backbone as a transformers base model "
        f"and its value head in {VALUE_HEAD_FILE}; with --universal, the roles converted (default: all)",
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA actor's adapter alone (a PEFT directory), not the merged model with it",
    )
    parser.add_argument(
        "--universal",
        action="store_true",
        help="DeepSpeed's universal checkpoint in OUT/<role>/ds (loads at any world size with "
        "checkpoint.load_universal; dsrl-train makes its own when "
        "trainer.resume_allow_world_size_change is set)",
    )
    parser.add_argument(
        "--model-path",
        metavar="DIR",
        help="the run's base model, when it is no longer at the checkpoint's actor_rollout_ref.model."
        "path (critic.model.path): config, generation config and tokenizer come from it",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model code shipped in the base model's directory (config.json's auto_map), as a run with "
        "actor_rollout_ref.model.trust_remote_code=true (critic.model.trust_remote_code) did: only for a model "
        "you trust; the checkpoint's own setting never turns it on",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    try:
        written = convert(
            args.checkpoint,
            args.out,
            role=args.role,
            adapter_only=args.adapter_only,
            universal=args.universal,
            model_path=args.model_path,
            trust_remote_code=args.trust_remote_code,
        )
    except (ConvertError, CheckpointError) as err:  # CheckpointError: a file that does not load as data
        print(f"dsrl-convert: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {written}, from {args.checkpoint} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
