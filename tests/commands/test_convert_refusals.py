"""``dsrl-convert`` refuses, in one line with the fix and exit code 2, what is not a dsrl checkpoint or not a place to
write (damaged checkpoints and missing parts of real ones: ``tests/commands/test_convert.py``)."""

from __future__ import annotations

import pytest

from dsrl.commands.convert import main


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "no such directory; fix: point at a complete global_step_N directory"),
        ("model", "is a Hugging Face model already (config.json, no trainer_state.json): nothing to convert; load it"),
        ("run_folder", "is a run folder, not a checkpoint; fix: point at one of its checkpoints, e.g. "),
        ("empty", "no trainer_state.json (not a dsrl checkpoint, or its save never finished); fix: "),
        ("unfinished", "no trainer_state.json (not a dsrl checkpoint, or its save never finished); fix: "),
    ],
)
def test_what_is_not_a_checkpoint_is_refused(tiny_model_dir, tmp_path, capsys, kind, message):
    directory = {
        "missing": tmp_path / "nowhere",
        "model": tiny_model_dir,
        "run_folder": tmp_path,
        "empty": tmp_path / "global_step_4",
        "unfinished": tmp_path / ".tmp_global_step_5",
    }[kind]
    for step in (4, 5):
        (tmp_path / f"global_step_{step}").mkdir()
    (tmp_path / ".tmp_global_step_5" / "actor" / "ds").mkdir(parents=True)  # a save that never finished
    assert main([str(directory), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"dsrl-convert: {directory}") and error.count("\n") == 1 and message in error, error
    if kind == "run_folder":
        assert error.endswith(f"e.g. {tmp_path / 'global_step_5'}\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--universal", "--adapter-only"],
            "--adapter-only writes a model, --universal a DeepSpeed checkpoint; fix: drop one",
        ),
        (
            ["--adapter-only", "--role", "critic"],
            "--adapter-only: only the actor trains LoRA adapters; fix: drop --role critic",
        ),
    ],
)
def test_options_that_contradict_each_other_are_refused(tmp_path, capsys, options, message):
    assert main([str(tmp_path), str(tmp_path / "out"), *options]) == 2
    assert capsys.readouterr().err == f"dsrl-convert: {message}\n"


def test_an_output_that_holds_files_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"dsrl-convert: {tmp_path / 'out'} exists and is not an empty directory; fix: name "
        "a new directory, or remove it\n"
    )
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
