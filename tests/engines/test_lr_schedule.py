"""The lr schedule: verl's formulas (warm-up, constant, cosine with a floor), per training step."""

from __future__ import annotations

import math

import pytest
import torch

from dsrl.config import load_config
from dsrl.config.deepspeed_json import clip_grad
from dsrl.engines.deepspeed_setup import lr_scheduler
from tests.conftest import QUICKSTART
from tests.helpers.engines import stepped

LR = 0.1


def lrs(steps: int, total: int | None, *overrides: str) -> list[float]:
    """The lr of each of ``steps`` training steps under the actor's optim keys ``overrides``."""
    cfg = load_config(QUICKSTART, [f"actor_rollout_ref.actor.optim.lr={LR}", *overrides])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = lr_scheduler(optimizer, cfg.actor_rollout_ref.actor.optim, total_training_steps=total, prefix="actor")
    return stepped(scheduler, steps)


def verl_cosine(step: int, *, warmup: int, total: int, floor: float, cycles: float = 0.5) -> float:
    """verl 0.9's get_cosine_schedule_with_warmup factor (utils/torch_functional.py), written out."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(floor, math.cos(math.pi * cycles * 2 * progress) * ((1 - floor) * 0.5) + (1 + floor) * 0.5)


def test_constant_without_warm_up_is_the_default():
    assert lrs(3, None) == [LR, LR, LR]


def test_linear_warm_up_counts_training_steps_from_lr_zero():
    assert lrs(6, None, "actor_rollout_ref.actor.optim.lr_warmup_steps=4") == pytest.approx(
        [0, 0.025, 0.05, 0.075, 0.1, 0.1]
    )


def test_warm_up_ratio_takes_a_share_of_the_run():
    # int(0.25 * 8) = 2 warm-up steps, as verl rounds
    assert lrs(4, 8, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.25") == pytest.approx([0, 0.05, 0.1, 0.1])
    # an explicit step count wins over the ratio
    assert lrs(
        2,
        8,
        "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5",
    ) == pytest.approx([0, 0.1])


@pytest.mark.parametrize("key", ["lr_scheduler_type", "warmup_style"])
def test_cosine_matches_verls_formula_with_a_floor(key):
    total, warmup, floor = 10, 2, 0.1
    got = lrs(
        12,
        total,
        f"actor_rollout_ref.actor.optim.{key}=cosine",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={warmup}",
        f"actor_rollout_ref.actor.optim.min_lr_ratio={floor}",
    )
    want = [LR * verl_cosine(k, warmup=warmup, total=total, floor=floor) for k in range(12)]
    assert got == want  # to the last bit: tests/verl/test_lr_schedule_parity.py holds it against verl itself
    assert got[warmup] == pytest.approx(LR) and got[total] == pytest.approx(LR * floor)  # peak, then the floor
    assert got[6] == pytest.approx(LR * (0.5 * (1 + floor)))  # halfway down: the middle of lr and the floor


def test_cosine_cycles():
    got = lrs(
        9, 8, "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.num_cycles=1.0"
    )
    assert got == [LR * verl_cosine(k, warmup=0, total=8, floor=0.0, cycles=1.0) for k in range(9)]
    assert got[4] == pytest.approx(0.0, abs=1e-12) and got[8] == pytest.approx(LR)  # down and back up


def test_cosine_without_the_run_length_is_an_error():
    with pytest.raises(ValueError, match="total training steps"):
        lrs(1, None, "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine")


def test_grad_clip_is_verls_older_name_of_clip_grad():
    cfg = load_config(QUICKSTART, ["actor_rollout_ref.actor.optim.clip_grad=0.5"])
    assert clip_grad(cfg.actor_rollout_ref.actor) == 0.5
    cfg = load_config(QUICKSTART, ["actor_rollout_ref.actor.grad_clip=2.0"])  # over clip_grad's default
    assert clip_grad(cfg.actor_rollout_ref.actor) == 2.0
    assert clip_grad(cfg.critic) == 1.0
    # both set to different values is refused (tests/config/test_config_paths.py)
