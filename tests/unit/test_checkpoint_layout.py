"""The checkpoint directory logic: which checkpoint a resume takes, what pruning deletes, how a
changed config is reported, and that RNG states round-trip through ``weights_only`` loading."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dsrl import checkpoint as ckpt
from dsrl.config import load_config


def fake_checkpoint(root, step, roles=("actor",), state_extra=None):
    """A global_step_<step> directory as save_checkpoint leaves it: role files, then the state with its manifest."""
    directory = ckpt.step_dir(root, step)
    for role in roles:
        (directory / role / "ds").mkdir(parents=True)
        (directory / role / "ds" / "weights.pt").write_bytes(b"x" * (10 + step))
    ckpt.write_state(directory, {"format": ckpt.FORMAT, "global_step": step, **(state_extra or {})})
    return directory


def test_resume_takes_the_newest_complete_checkpoint_and_says_why_it_skipped_others(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    (ckpt.step_dir(tmp_path, 8) / "actor" / "ds" / "weights.pt").write_bytes(b"short")  # truncated
    (ckpt.step_dir(tmp_path, 6) / ckpt.STATE_FILE).unlink()  # never finished
    (tmp_path / ".tmp_global_step_10").mkdir()  # a save that crashed: not a checkpoint at all
    (tmp_path / "global_step_12").write_text("")  # a file, not a directory
    path, skipped = ckpt.newest_complete(tmp_path)
    assert path == ckpt.step_dir(tmp_path, 4)
    assert skipped == [
        f"skipping {ckpt.step_dir(tmp_path, 8)}: actor/ds/weights.pt has 5 bytes, 18 were written",
        f"skipping {ckpt.step_dir(tmp_path, 6)}: no trainer_state.json (not a dsrl checkpoint, or its save never finished)",
    ]
    assert ckpt.newest_complete(tmp_path / "nothing-here") == (None, [])


def test_a_checkpoint_with_a_missing_or_unreadable_state_is_refused_with_the_fix(tmp_path):
    directory = fake_checkpoint(tmp_path, 2)
    (directory / "actor" / "ds" / "weights.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="actor/ds/weights.pt is missing; fix: point it at a global_step_N"):
        ckpt.read_state(directory)
    (directory / ckpt.STATE_FILE).write_text("{not json")
    assert ckpt.checkpoint_problem(directory).startswith("trainer_state.json is unreadable")
    (directory / ckpt.STATE_FILE).write_text(json.dumps({"format": 99, "files": {}}))
    assert "not a dsrl checkpoint state of format 1" in ckpt.checkpoint_problem(directory)


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
    # the half-kept step 3 is no longer resumable and is skipped with its reason
    assert ckpt.newest_complete(tmp_path)[0] == ckpt.step_dir(tmp_path, 4)
    assert ckpt.checkpoint_problem(ckpt.step_dir(tmp_path, 3)) == "actor/ds/weights.pt is missing"
    ckpt.prune(tmp_path, {"actor": None, "critic": None})  # null keeps everything
    assert sorted(ckpt.complete_steps(tmp_path)) == [3, 4]


def test_changed_settings_are_listed_and_harmless_ones_are_not(tmp_path):
    base = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet"]
    saved = ckpt.state_config(load_config(None, base), world_size=2)
    harmless = ["trainer.total_training_steps=100", "trainer.save_freq=5", "trainer.test_freq=3",
                "trainer.logger=[console,mlflow]", "trainer.resume_mode=disable", "data.val_batch_size=4"]
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


def test_rng_state_round_trips_through_weights_only_loading(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    ckpt.save_rng(tmp_path, rank=0)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.set_rng_state(torch.load(tmp_path / "rng" / "rank_0.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
