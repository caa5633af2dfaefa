"""The checkpoint directory logic: which checkpoint a resume takes, what pruning deletes, how a
changed config is reported, and that RNG states round-trip through ``weights_only`` loading."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dsrl.checkpoint import save as ckpt
from dsrl.config import load_config


def fake_checkpoint(root, step, roles=("actor",), state_extra=None):
    """A global_step_<step> directory as save_checkpoint leaves it: role files, then the state with its manifest."""
    directory = ckpt.step_dir(root, step)
    for role in roles:
        (directory / role / "ds").mkdir(parents=True)
        (directory / role / "ds" / "weights.pt").write_bytes(b"x" * (10 + step))
    digests = {name: ckpt.sha256_file(directory / name) for name in ckpt._files(directory)}
    ckpt.write_state(directory, {"format": ckpt.FORMAT, "global_step": step, **(state_extra or {})}, digests)
    return directory


def problem(directory):
    """What a resume finds wrong with ``directory``: its state, then its files' contents (one rank), or None."""
    state, why = ckpt.state_problem(directory)
    return why or next(iter(ckpt.file_problems(directory, state["files"], rank=0, world=1)), None)


def test_a_checkpoint_checks_out_only_as_it_was_written(tmp_path):
    directory = fake_checkpoint(tmp_path, 8)
    assert problem(directory) is None
    weights = directory / "actor" / "ds" / "weights.pt"
    weights.write_bytes(b"short")
    assert problem(directory) == "actor/ds/weights.pt has 5 bytes, 18 were written"
    weights.write_bytes(b"y" * 18)  # the right size, other bytes
    assert problem(directory) == "actor/ds/weights.pt changed since it was written (its SHA-256 does not match)"
    weights.unlink()
    assert problem(directory) == "actor/ds/weights.pt is missing"
    (directory / ckpt.STATE_FILE).unlink()
    assert problem(directory) == "no trainer_state.json (not a dsrl checkpoint, or its save never finished)"


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda state: state.update(global_step=9), "trainer_state.json was changed after it was written"),
        (lambda state: state.pop("files"), "trainer_state.json was changed after it was written"),
        (lambda state: state.update(format=1), "in checkpoint format 1, which this dsrl"),
    ],
)
def test_an_edited_state_is_refused(tmp_path, edit, why):
    directory = fake_checkpoint(tmp_path, 2)
    state = json.loads((directory / ckpt.STATE_FILE).read_text())
    edit(state)
    (directory / ckpt.STATE_FILE).write_text(json.dumps(state))
    assert why in problem(directory)


def test_a_state_for_another_step_or_unreadable_is_refused(tmp_path):
    directory = fake_checkpoint(tmp_path, 2)
    directory.rename(ckpt.step_dir(tmp_path, 3))  # a copy under another step's name
    assert problem(ckpt.step_dir(tmp_path, 3)) == "trainer_state.json is for step 2, not 3"
    (ckpt.step_dir(tmp_path, 3) / ckpt.STATE_FILE).write_text("{not json")
    assert problem(ckpt.step_dir(tmp_path, 3)).startswith("trainer_state.json is unreadable")
    (ckpt.step_dir(tmp_path, 3) / ckpt.STATE_FILE).write_text("[1, 2]")
    assert problem(ckpt.step_dir(tmp_path, 3)) == "trainer_state.json is not a dsrl checkpoint state"


def test_publish_replaces_the_pointer_and_an_older_copy_of_the_step(tmp_path):
    old = fake_checkpoint(tmp_path, 4)
    (old / "stale").write_text("from an earlier run")
    tmp = tmp_path / ".tmp_global_step_4"
    (tmp / "actor").mkdir(parents=True)
    ckpt.publish(tmp, ckpt.step_dir(tmp_path, 4))
    assert not tmp.exists() and not (ckpt.step_dir(tmp_path, 4) / "stale").exists()
    assert (tmp_path / ckpt.LATEST_FILE).read_text() == "4"
    assert not list(tmp_path.glob(".*"))  # no temporary or trash directory is left


def test_prune_keeps_each_roles_newest_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step, roles=("actor", "critic"))
    ckpt.prune(tmp_path, {"actor": 1, "critic": 2})
    assert sorted(ckpt.complete_steps(tmp_path)) == [3, 4]
    assert (ckpt.step_dir(tmp_path, 4) / "actor").is_dir()
    assert not (ckpt.step_dir(tmp_path, 3) / "actor").exists() and (ckpt.step_dir(tmp_path, 3) / "critic").is_dir()
    # the half-kept step 3 is no longer resumable, with its reason
    assert problem(ckpt.step_dir(tmp_path, 3)) == "actor/ds/weights.pt is missing"
    ckpt.prune(tmp_path, {"actor": None, "critic": None})  # null keeps everything
    assert sorted(ckpt.complete_steps(tmp_path)) == [3, 4]


def test_changed_settings_are_listed_and_harmless_ones_are_not(tmp_path):
    base = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet"]
    saved = ckpt.state_config(load_config(None, base), world_size=2)
    harmless = [
        "trainer.total_training_steps=100",
        "trainer.save_freq=5",
        "trainer.test_freq=3",
        "trainer.logger=[console,mlflow]",
        "trainer.resume_mode=disable",
        "data.val_batch_size=4",
    ]
    assert ckpt.config_differences(saved, ckpt.state_config(load_config(None, base + harmless), world_size=2)) == []
    changed = ckpt.state_config(
        load_config(None, base + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "trainer.seed=7"]),
        world_size=4,
    )
    assert ckpt.config_differences(saved, changed) == [
        "actor_rollout_ref.rollout.n: 1 -> 4",
        "algorithm.adv_estimator: 'gae' -> 'grpo'",
        "trainer.seed: 1 -> 7",
        "world_size: 2 -> 4",
    ]
    assert ckpt.config_hash(saved) != ckpt.config_hash(changed)
    # A key dsrl gained after the checkpoint was written: no difference at its default, one otherwise
    older = {key: value for key, value in saved.items() if key != "data.gen_batch_size"}
    assert ckpt.config_differences(older, saved) == []
    assert ckpt.config_differences(older, {**saved, "data.gen_batch_size": 64}) == [
        "data.gen_batch_size: '<unset>' -> 64"
    ]


def test_rng_state_round_trips_through_weights_only_loading(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    ckpt.save_rng(tmp_path, rank=0)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.set_rng_state(torch.load(tmp_path / "rng" / "rank_0.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
