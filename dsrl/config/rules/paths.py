"""The rules on the paths a run names: the data files (parquet, each file named once), the reward file, the model
directories or hub ids, and the run folder its checkpoints and final model are written to. What the files hold is
read by ``dsrl.config.files`` (headers only)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import ListConfig

from dsrl.config.files import (
    file_kind,
    model_config,
    model_dir_problems,
    model_path_problem,
    not_regular,
    packing_problem,
    parquet_paths,
    parquet_problem,
    sequence_parallel_problem,
)
from dsrl.config.keys import value_at
from dsrl.config.layout import FINAL_MODEL_DIR
from dsrl.config.names import PREPARED_TASKS
from dsrl.config.rules.need import Need, critic_used, is_missing
from dsrl.config.schema import Config


def file_rules(cfg: Config, need: Need) -> None:
    data = cfg.data
    for key in ("data.train_files", "data.val_files"):
        if is_missing(cfg, key) or (key == "data.val_files" and data.val_files is None):
            continue
        files = value_at(cfg, key)
        paths = list(files) if isinstance(files, ListConfig) else [files]
        if not paths or not all(isinstance(p, str) for p in paths):
            need(
                False,
                key,
                "must be a parquet path or a list of them",
                f"set {key}=path.parquet or {key}=[a.parquet,b.parquet]",
            )
            continue
        first_named: dict[tuple[int, int], tuple[int, str]] = {}  # (device, inode) -> (entry index, file)
        reported: set[tuple[int, int]] = set()
        for index, p in enumerate(paths):
            task = next((task for task in PREPARED_TASKS if task in Path(p).parts), "arithmetic")
            # The command as printed writes this folder: its default, outputs/data/<task>, or --out.
            folder = Path(p).parent if Path(p).suffix == ".parquet" else Path(p)
            out = "" if folder == Path("outputs", "data", task) else f" --out {folder}"
            prepare = f"python scripts/prepare_data.py --task {task}{out}"
            if not Path(p).expanduser().exists():
                need(
                    False,
                    key,
                    "file does not exist",
                    f"point it at existing parquet files, e.g. written by {prepare}",
                    value=p,
                )
                continue
            need(
                parquet_paths(p),
                key,
                "the directory holds no *.parquet files (a directory stands for the *.parquet files directly in it)",
                f"point it at a directory of parquet files or at the files, e.g. written by {prepare}",
                value=p,
            )
            for file in parquet_paths(p):
                problem = parquet_problem(Path(file).expanduser())
                if problem is not None:
                    fix = (
                        "write it (again) as parquet, e.g. pandas.read_json(path, lines=True).to_parquet(out), or with "
                        f"{prepare}"
                    )
                    need(False, key, problem, fix, value=file)
                    continue
                # One file named twice (the same path, another spelling, a link, or by a directory entry as well)
                # would feed each of its prompts twice per epoch.
                info = Path(file).expanduser().stat()
                first_index, first = first_named.setdefault((info.st_dev, info.st_ino), (index, file))
                if (first_index, first) != (index, file) and (first_index, index) not in reported:
                    reported.add((first_index, index))
                    named = (_named_by(first, paths[first_index]), _named_by(file, p))
                    twice = (
                        f"{named[0]} twice" if named[0] == named[1] else f"one file twice, as {named[0]} and {named[1]}"
                    )
                    need(
                        False,
                        key,
                        f"names {twice}: each of its prompts would be used twice per epoch",
                        "list each file once (to train on the data more than once, raise trainer.total_epochs)",
                    )
    reward_path = cfg.custom_reward_function.path
    if reward_path is not None:
        path = Path(reward_path).expanduser()
        problem = not_regular(path)
        need(
            path.exists() and problem is None,
            "custom_reward_function.path",
            problem or "file does not exist",
            "point it at a Python file defining custom_reward_function.name, or set it to null",
        )
    run_dir = None if cfg.trainer.val_only else _run_dir_problem(Path(cfg.trainer.default_local_dir).expanduser())
    if run_dir:  # a validation-only run writes nothing there
        need(False, "trainer.default_local_dir", *run_dir)
    model_keys = ["actor_rollout_ref.model.path"] + (
        ["critic.model.path"] if critic_used(cfg) and cfg.critic.model.path else []
    )
    model_keys += ["reward_model.model.path"] if cfg.reward_model.enable and cfg.reward_model.model.path else []
    teacher = "distillation.teacher_models.teacher_model.model_path"
    model_keys += [teacher] if cfg.distillation.enabled and value_at(cfg, teacher) else []
    for key in model_keys:
        if is_missing(cfg, key):
            continue
        path = value_at(cfg, key)
        problem = model_path_problem(path)
        out = "" if Path(path) == Path("outputs", "tiny_model") else f" --out {path}"  # the script's default, or --out
        need(
            problem is None,
            key,
            problem,
            "point it at a model directory or a hub id owner/name, e.g. create one with python "
            f"scripts/make_tiny_model.py{out}",
        )
        if problem is None and Path(path).expanduser().is_dir():  # a hub id is checked when it downloads
            # The run's tokenizer is the actor's (the critic shares it); the reward model's and the teacher's are
            # compared with it.
            found = model_dir_problems(Path(path).expanduser(), tokenizer=not key.startswith("critic"))
            for rule, fix in found:
                need(False, key, rule, fix)
            if key == "reward_model.model.path":  # its forward neither packs nor runs sequence-parallel
                continue
            # the teacher runs as the reference does: the actor's packing and sequence-parallel groups
            role = "critic" if key.startswith("critic") else "actor_rollout_ref"
            packing = f"{role}.model.use_remove_padding"
            # Read only a directory found sound: its config.json may be a FIFO, which a read would wait on.
            config = None if found else model_config(Path(path).expanduser())
            if config is not None and value_at(cfg, packing):
                problem = packing_problem(config)
                need(problem is None, packing, f"{path}: {problem}", f"set {packing}=false")
            sp_key = f"{'critic' if role == 'critic' else 'actor_rollout_ref.actor'}.ulysses_sequence_parallel_size"
            sp = value_at(cfg, sp_key)
            if config is not None and sp > 1:
                problem = sequence_parallel_problem(config, sp)
                need(problem is None, sp_key, f"{path}: {problem}", "set a divisor of the heads")


def _named_by(file: str, entry: str) -> str:
    """How a data-file list names ``file``: as itself, or through the directory ``entry``."""
    return file if file == entry else f"{file} (in the directory {entry})"


def _run_dir_problem(folder: Path) -> tuple[str, str] | None:
    """(rule, fix) when the run could not write its checkpoints and final model into ``folder`` (made when missing):
    something other than a folder in the way, a folder this user cannot write to, or something other than an
    earlier export where the final model goes; None when it can."""
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:  # the nearest part of the path that exists
        existing = existing.parent
    kind = file_kind(existing) or "a symlink that points nowhere"
    if kind != "a directory":
        where = "it" if existing == folder else f"{existing}, a folder it would be made in,"
        return (
            f"{where} is {kind}, not a folder (checkpoints and the final model are written there)",
            f"point it at a folder (one that is missing is made), or move {existing} away",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == folder else f"{existing}, where it would be made,"
        return (
            f"{where} is not writable by this user (checkpoints and the final model are written there)",
            "point it at a folder you can write to, or change its permissions",
        )
    final = folder / FINAL_MODEL_DIR
    final_kind = "a symlink" if final.is_symlink() else file_kind(final)
    if final_kind not in (
        None,
        "a directory",
    ):  # a directory there is an earlier run's export, which the new one replaces
        return (
            f"{final} is {final_kind}, where the final model is exported (only an earlier export, a folder, is "
            "replaced)",
            f"move {final} away, or point trainer.default_local_dir at another folder",
        )
    return None
