"""A checkpoint is data: every torch file of a real checkpoint (and of its universal form) loads with
``weights_only=True`` and exactly the DeepSpeed classes ``DEEPSPEED_TYPES`` allows; one that holds a pickled call
(the security review's F8: a payload in a DeepSpeed file, the manifest recomputed) is not resumed, and its code
never runs, whether the check before loading finds it or the loads themselves (DeepSpeed's, the universal
conversion's) refuse it. ``dsrl-convert``'s refusals: ``tests/commands/test_convert.py``."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from omegaconf import OmegaConf

from dsrl.checkpoint.save import DEEPSPEED_TYPES, CheckpointError, load_checkpoint, pickled_code_problem, step_dir
from tests.helpers.tampered import with_payload
from tests.helpers.trainer import trainer_for

pytestmark = pytest.mark.e2e

RUN = (
    "trainer.total_training_steps=1",
    "trainer.save_freq=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
)


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path_factory):
    """PPO for one step, the actor on ZeRO-2 and the critic on ZeRO-3 + offload (DeepSpeed's two optimizer state
    layouts): its trainer and checkpoint root."""
    root = tmp_path_factory.mktemp("ppo_run")
    trainer = trainer_for(
        "ppo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        root,
        *RUN,
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero2')}",
        f"critic.model.path={tiny_model_dir}",
        f"critic.deepspeed_config={ds_test_config('zero3_offload')}",
    )
    trainer.fit()
    return trainer, root


def test_deepspeed_files_need_exactly_the_allowed_classes(ppo_run, tmp_path):
    """Every torch file of the checkpoint and of its universal form loads as data; together they hold each class of
    DEEPSPEED_TYPES (none is allowed for nothing) and no other beyond torch's own."""
    from dsrl.checkpoint.universal import convert

    _, root = ppo_run
    checkpoint = step_dir(root, 1)
    convert(checkpoint, ["actor", "critic"], tmp_path / "universal")
    paths = sorted(checkpoint.rglob("*.pt")) + sorted((tmp_path / "universal").rglob("*.pt"))
    assert len(paths) > 100  # the universal form: a folder of files per parameter
    held = set()
    for path in paths:
        held |= set(torch.serialization.get_unsafe_globals_in_checkpoint(path))  # beyond torch's own
        assert pickled_code_problem(path, path.name) is None, path
    assert held == {f"{cls.__module__}.{cls.__qualname__}" for cls in DEEPSPEED_TYPES}


@pytest.fixture
def tampered(ppo_run, tmp_path):
    """A copy of the checkpoint whose critic's ZeRO-3 model states hold a pickled call of os.system, the manifest
    recomputed; the marker file the call would write."""
    _, root = ppo_run
    marker = tmp_path / "marker"
    checkpoint = with_payload(
        step_dir(root, 1),
        tmp_path / "run" / "global_step_1",
        marker,
        "critic/ds/zero_pp_rank_0_mp_rank_00_model_states.pt",
    )
    yield checkpoint, marker
    torch.load(checkpoint / "critic/ds/zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    assert marker.exists()  # the payload runs where a file is loaded as DeepSpeed loads it


def test_a_resume_refuses_a_checkpoint_whose_files_hold_code_before_any_model_loads(ppo_run, tampered, caplog):
    """``resume_path``: refused, naming the file; ``auto``: skipped, saying why (here no other checkpoint is left, so
    the run would start over). The payload never runs."""
    from dsrl.checkpoint.resume import checkpoint_to_resume

    trainer, _ = ppo_run
    checkpoint, marker = tampered
    why = (
        "critic/ds/zero_pp_rank_0_mp_rank_00_model_states.pt holds pickled Python beyond tensors and plain values "
        "(a reference to posix.system), which loading could run"
    )
    explicit = OmegaConf.merge(
        trainer.cfg, {"trainer": {"resume_mode": "resume_path", "resume_from_path": str(checkpoint)}}
    )
    with pytest.raises(
        CheckpointError, match=re.escape(f"resume_from_path={checkpoint}: not a complete dsrl checkpoint: {why}")
    ):
        checkpoint_to_resume(explicit, checkpoint.parent, ["actor", "critic"])
    auto = OmegaConf.merge(trainer.cfg, {"trainer": {"resume_mode": "auto"}})
    with caplog.at_level(logging.INFO, logger="dsrl"):
        assert checkpoint_to_resume(auto, checkpoint.parent, ["actor", "critic"]) == (None, None)
    assert f"resume: skipping {checkpoint}: {why}" in caplog.text
    assert not marker.exists()


def test_the_loads_themselves_refuse_a_file_that_holds_code(ppo_run, tampered, tmp_path):
    """With the check before loading passed by (a file changed after it), DeepSpeed's engine load and the universal
    conversion (a resume at another world size, dsrl-convert --universal) load the files as data and refuse."""
    from dsrl.checkpoint.universal import convert

    trainer, _ = ppo_run
    checkpoint, marker = tampered
    why = r"critic: ds/zero_pp_rank_0_mp_rank_00_model_states.pt holds pickled Python .*posix.system"
    with pytest.raises(CheckpointError, match=why):
        load_checkpoint(checkpoint, {"critic": trainer.critic.engine}, rank=0)
    with pytest.raises(CheckpointError, match=why):
        convert(checkpoint, ["critic"], tmp_path / "universal")
    assert not marker.exists()
