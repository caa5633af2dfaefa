"""Inputs that used to fail late or mislead (issue 20, class 6), refused at validation as one line with the fix: the
run folder, files that are not regular files (a FIFO would hang validation), a data file listed twice, and an older
key name set together with the current one to a different value. Also the note on a secret that reached a path."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dsrl import config as C
from tests.conftest import REPO, recipe, run_train_without_torch, stub_file_overrides, write_parquet_stub

ACTOR = "actor_rollout_ref.model.path"
RUN_DIR = "trainer.default_local_dir"


@pytest.fixture
def inputs(tmp_path):
    """Overrides naming real files of every kind validation reads, all valid; the run folder does not exist yet."""
    return [*stub_file_overrides(tmp_path), f"{RUN_DIR}={tmp_path / 'run'}"]


def problems(overrides, files=None, seconds=30):
    """The violations of configs/grpo.yaml (CPU overlay, or ``files``) with ``overrides``; fails when validation does
    not return within ``seconds`` (opening a FIFO for reading blocks until something writes to it)."""
    found = []

    def validate():
        try:
            C.load_and_validate(recipe("grpo") if files is None else files, overrides, 1)
        except C.ConfigError as err:
            found.extend(err.violations)

    thread = threading.Thread(target=validate, daemon=True)  # a hung one must not keep pytest from exiting
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"validation did not return within {seconds} s"
    return found


def one_line(found, key, value, rule, fix):
    """``found`` is exactly the line ``key=value: rule...; fix: fix...``."""
    assert len(found) == 1, found
    assert found[0].startswith(f"{key}={value}: {rule}"), found[0]
    assert f"; fix: {fix}" in found[0], found[0]


def test_valid_inputs_pass(inputs):
    assert problems(inputs) == []


# ---------------------------------------------------------------- the run folder


def test_a_run_folder_that_is_a_file_is_refused(inputs, tmp_path):
    (tmp_path / "run").write_text("notes")
    one_line(problems(inputs), RUN_DIR, tmp_path / "run", "it is a regular file, not a folder", "point it at a folder")
    assert problems(inputs + ["trainer.val_only=true"]) == []  # validating only, the run writes nothing there


def test_a_run_folder_below_a_file_is_refused(inputs, tmp_path):
    (tmp_path / "notes").write_text("x")
    folder = tmp_path / "notes" / "dsrl" / "run"
    one_line(
        problems(inputs + [f"{RUN_DIR}={folder}"]),
        RUN_DIR,
        folder,
        f"{tmp_path / 'notes'}, a folder it would be made in, is a regular file, not a folder",
        f"point it at a folder (one that is missing is made), or move {tmp_path / 'notes'} away",
    )


def test_a_run_folder_that_is_a_dangling_link_or_a_fifo_is_refused(inputs, tmp_path):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    one_line(
        problems(inputs), RUN_DIR, tmp_path / "run", "it is a symlink that points nowhere, not a folder", "point it"
    )
    (tmp_path / "run").unlink()
    os.mkfifo(tmp_path / "run")
    one_line(problems(inputs), RUN_DIR, tmp_path / "run", "it is a FIFO, not a folder", "point it")


def without_override() -> list[str]:
    """The command prefix under which this user cannot write into a folder whose permissions forbid it: none for a
    normal user; for root, ``setpriv`` without CAP_DAC_OVERRIDE (the power by which root writes anywhere)."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    prefix = [shutil.which("setpriv") or "setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    try:
        usable = subprocess.run([*prefix, "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        usable = False
    if not usable:
        pytest.skip("root writes into any folder, and setpriv (util-linux) cannot take that power away here")
    return prefix


def test_a_run_folder_this_user_cannot_write_is_refused(inputs, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    prefix = without_override()
    for folder, where in ((locked, "it"), (locked / "a" / "b", f"{locked}, where it would be made,")):
        result = subprocess.run(
            [
                *prefix,
                sys.executable,
                str(REPO / "scripts" / "train.py"),
                *recipe("grpo"),
                *inputs,
                f"{RUN_DIR}={folder}",
                "--validate-only",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            env={**os.environ, "WORLD_SIZE": "1"},
        )
        assert result.returncode == 2, result.stderr
        one_line(
            [line.strip() for line in result.stderr.splitlines()[1:]],
            RUN_DIR,
            folder,
            f"{where} is not writable by this user",
            "point it at a folder you can write to, or change its permissions",
        )


IN_THE_WAY = {  # what is at the final model's path, by how validation names it
    "a regular file": lambda path, folder: path.write_text("x"),
    "a FIFO": lambda path, folder: os.mkfifo(path),
    "a symlink": lambda path, folder: path.symlink_to(folder),  # to a folder of the user's own
}


@pytest.mark.parametrize("shown", IN_THE_WAY)
def test_something_other_than_an_earlier_export_where_the_final_model_goes_is_refused(inputs, tmp_path, shown):
    final = tmp_path / "run" / "huggingface"
    final.parent.mkdir()
    (tmp_path / "mine").mkdir()
    IN_THE_WAY[shown](final, tmp_path / "mine")
    one_line(
        problems(inputs),
        RUN_DIR,
        tmp_path / "run",
        f"{final} is {shown}, where the final model is exported",
        f"move {final} away, or point trainer.default_local_dir at another folder",
    )


def test_an_earlier_export_is_a_folder_the_run_replaces(inputs, tmp_path):
    (tmp_path / "run" / "huggingface").mkdir(parents=True)
    assert problems(inputs) == []


# ---------------------------------------------------------------- files that are not regular files


@pytest.fixture
def fifo(tmp_path):
    """``fifo(path)``: a named pipe at ``path``; nothing ever writes to it, so a read would block forever."""

    def make(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return path

    return make


def test_a_fifo_as_a_data_file_is_refused_without_hanging(inputs, tmp_path, fifo):
    pipe = fifo(tmp_path / "stream.parquet")
    one_line(
        problems(inputs + [f"data.train_files={pipe}"]),
        "data.train_files",
        pipe,
        "not a regular file (a FIFO)",
        "write it",
    )


def test_a_fifo_or_socket_in_a_data_directory_is_refused(inputs, tmp_path, fifo):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet_stub(folder / "a.parquet")
    pipe = fifo(folder / "b.parquet")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(folder / "c.parquet"))
        found = problems(inputs + [f"data.train_files={folder}"])
    assert [line.split("; fix:")[0] for line in found] == [
        f"data.train_files={pipe}: not a regular file (a FIFO)",
        f"data.train_files={folder / 'c.parquet'}: not a regular file (a socket)",
    ]


def test_a_device_as_a_data_file_is_refused(inputs):
    one_line(
        problems(inputs + ["data.val_files=/dev/zero"]),
        "data.val_files",
        "/dev/zero",
        "not a regular file (a character device)",
        "write it",
    )


def test_a_fifo_as_the_reward_file_or_a_user_module_is_refused(inputs, tmp_path, fifo):
    reward = fifo(tmp_path / "reward.py")
    one_line(
        problems(inputs + [f"custom_reward_function.path={reward}"]),
        "custom_reward_function.path",
        reward,
        "not a regular file (a FIFO)",
        "point it at a Python file",
    )
    module = fifo(tmp_path / "estimators.py")
    one_line(
        problems(inputs + [f"algorithm.import_modules=[{module}]"]),
        "algorithm.import_modules",
        module,
        f"import failed: {module} is not a regular file (a FIFO)",
        "fix that module",
    )


def test_a_fifo_as_a_deepspeed_json_is_refused(inputs, tmp_path, fifo):
    pipe = fifo(tmp_path / "zero3.json")
    key = "actor_rollout_ref.actor.deepspeed_config"
    one_line(problems(inputs + [f"{key}={pipe}"]), key, pipe, f"{pipe} is not a regular file (a FIFO)", "pass the path")


def test_a_fifo_as_a_config_file_is_refused(inputs, tmp_path, fifo):
    pipe = fifo(tmp_path / "mine.yaml")
    [line] = problems(inputs, files=[*recipe("grpo"), str(pipe)])
    assert line.startswith(f"config file {pipe}: not a regular file (a FIFO); fix: pass a YAML file"), line


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_in_the_model_directory_is_refused(inputs, tmp_path, fifo, name):
    model = tmp_path / "model"
    (model / name).unlink()
    fifo(model / name)
    one_line(problems(inputs), ACTOR, model, f"{name} is not a regular file (a FIFO)", "put the file itself there")


def test_the_command_refuses_a_fifo_in_a_second(inputs, tmp_path, fifo):
    """The CLI as a user runs it: exit code 2, the line, no traceback; a hang fails on the helper's timeout."""
    pipe = fifo(tmp_path / "stream.parquet")
    result = run_train_without_torch([*recipe("grpo"), *inputs, f"data.train_files={pipe}", "--validate-only"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"  data.train_files={pipe}: not a regular file (a FIFO); fix: " in result.stderr


# ---------------------------------------------------------------- a data file listed twice


def twice(found, key, entries, named):
    """``found`` is the one line saying that the list ``entries`` names a file twice, as ``named``."""
    rule = f"names {named}: each of its prompts would be used twice per epoch"
    fix = "list each file once (to train on the data more than once, raise trainer.total_epochs)"
    one_line(found, key, f"[{','.join(str(e) for e in entries)}]", rule, fix)


def test_a_data_file_listed_twice_is_refused_however_it_is_spelled(inputs, tmp_path):
    train = tmp_path / "train.parquet"
    other = tmp_path / "model" / ".." / "train.parquet"  # another spelling
    link, hard = tmp_path / "link.parquet", tmp_path / "hard.parquet"
    link.symlink_to(train)
    os.link(train, hard)
    for entries, named in (
        ([train, train], f"{train} twice"),
        ([train, other], f"one file twice, as {train} and {other}"),
        ([train, link], f"one file twice, as {train} and {link}"),
        ([hard, train], f"one file twice, as {hard} and {train}"),
    ):
        found = problems(inputs + [f"data.train_files=[{','.join(map(str, entries))}]"])
        twice(found, "data.train_files", entries, named)


def test_a_file_also_covered_by_a_directory_entry_is_refused(inputs, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for name in ("a.parquet", "b.parquet"):
        write_parquet_stub(folder / name)
    twice(
        problems(inputs + [f"data.val_files=[{folder / 'b.parquet'},{folder}]"]),
        "data.val_files",
        [folder / "b.parquet", folder],
        f"one file twice, as {folder / 'b.parquet'} and {folder / 'b.parquet'} (in the directory {folder})",
    )
    # the same directory twice doubles every file: one line for the pair of entries, not one per file
    twice(
        problems(inputs + [f"data.train_files=[{folder},{folder}]"]),
        "data.train_files",
        [folder, folder],
        f"{folder / 'a.parquet'} (in the directory {folder}) twice",
    )


def test_distinct_files_with_equal_content_are_two_files(inputs, tmp_path):
    copy = tmp_path / "copy.parquet"
    copy.write_bytes((tmp_path / "train.parquet").read_bytes())
    assert problems(inputs + [f"data.train_files=[{tmp_path / 'train.parquet'},{copy}]"]) == []


# ---------------------------------------------------------------- an older key name and the current one


@pytest.mark.parametrize(
    "old, new, old_value, new_value",
    [
        ("actor_rollout_ref.actor.grad_clip", "actor_rollout_ref.actor.optim.clip_grad", "2.0", "0.5"),
        ("critic.grad_clip", "critic.optim.clip_grad", "0.0", "1.0"),
        (
            "actor_rollout_ref.actor.optim.warmup_style",
            "actor_rollout_ref.actor.optim.lr_scheduler_type",
            "cosine",
            "constant",
        ),
        ("critic.optim.warmup_style", "critic.optim.lr_scheduler_type", "constant", "cosine"),
    ],
)
def test_an_older_name_set_to_another_value_than_the_current_one_is_refused(inputs, old, new, old_value, new_value):
    assert set(C.loading.OLDER_NAMES.items()) >= {(old, new)}
    critic = [inputs[2].replace(ACTOR, "critic.model.path")]
    ppo = recipe("ppo")  # trains a critic
    one_line(
        problems(inputs + critic + [f"{old}={old_value}", f"{new}={new_value}"], files=ppo),
        old,
        old_value,
        f"is verl's older name of {new}, which the config sets to {new_value}: two values for one setting",
        f"set only {new} (to {old_value} if that is the value you meant)",
    )
    for alone in ([f"{old}={old_value}"], [f"{new}={new_value}"], [f"{old}={new_value}", f"{new}={new_value}"]):
        assert problems(inputs + critic + alone, files=ppo) == [], alone  # one of them, or both alike


def test_the_older_name_is_refused_across_layers_and_used_when_alone(inputs, tmp_path):
    layer = tmp_path / "mine.yaml"
    layer.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      clip_grad: 0.5\n")
    found = problems(inputs + ["actor_rollout_ref.actor.grad_clip=2.0"], files=[*recipe("grpo"), str(layer)])
    assert [line.split(": ")[0] for line in found] == ["actor_rollout_ref.actor.grad_clip=2.0"]
    assert problems(inputs + ["actor_rollout_ref.actor.grad_clip=null"], files=[*recipe("grpo"), str(layer)]) == []
    cfg, _ = C.load_and_validate(
        recipe("grpo"),
        inputs + ["actor_rollout_ref.actor.optim.warmup_style=cosine", "trainer.total_training_steps=4"],
        1,
    )
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine"  # read by the schedule in its place


def test_every_older_name_is_a_key_documented_as_one():
    for old, new in C.loading.OLDER_NAMES.items():
        assert old in C.SCHEMA and new in C.SCHEMA
        assert "name of" in C.SCHEMA[old].help and "refused" in C.SCHEMA[old].help, old
    olders = {key for key, info in C.SCHEMA.items() if re.search(r"\b(older|deprecated)\b", info.help)}
    assert olders == set(C.loading.OLDER_NAMES)


# ---------------------------------------------------------------- a secret in a path


def test_a_secret_in_a_path_gets_a_note_that_the_folder_on_disk_holds_it(inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", "tok-51c2a7e9d04b8f36")
    cfg, notes = C.load_and_validate(recipe("grpo"), inputs + [f"{RUN_DIR}={tmp_path}/run/${{oc.env:MY_API_TOKEN}}"], 1)
    assert cfg.trainer.default_local_dir == f"{tmp_path}/run/tok-51c2a7e9d04b8f36"
    [note] = [note for note in notes if "MY_API_TOKEN" in note]
    assert note.startswith(f"{RUN_DIR} holds the value of the secret environment variable MY_API_TOKEN")
    assert "show as ***" in note and "holds the value itself on disk" in note
    assert "tok-51c2a7e9d04b8f36" not in json.dumps(notes)
    from dsrl.runtime.redaction import redact_text  # the CLI prints the notes redacted: the note must survive that

    assert redact_text(note) == note
