"""dsrl's lr schedule gives verl 0.9.1's lr at every training step, bit for bit: the constant schedule with warm-up
and the cosine with a floor (``verl.utils.torch_functional``, as verl's FSDP engine builds them), over warm-ups,
run lengths, floors and cycle counts that include the edge cases (no warm-up, a warm-up as long as the run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from dsrl.engines.deepspeed_setup import lr_scheduler
from tests.helpers.engines import stepped

LR = 3e-6


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)


def dsrl_lrs(kind: str, warmup: int, total: int, floor: float = 0.0, cycles: float = 0.5) -> list[float]:
    optim = SimpleNamespace(warmup_style=None, lr_scheduler_type=kind, lr_warmup_steps=warmup,
                            lr_warmup_steps_ratio=0.0, min_lr_ratio=floor, num_cycles=cycles)  # fmt: skip
    return stepped(lr_scheduler(optimizer(), optim, total_training_steps=total, prefix="actor"), total + 3)


@pytest.mark.parametrize("warmup", [0, 1, 7, 40])
@pytest.mark.parametrize("total", [40, 137, 1000])
@pytest.mark.parametrize(("floor", "cycles"), [(0.0, 0.5), (0.1, 0.5), (0.05, 0.5), (0.3, 1.0), (0.0, 2.0)])
def test_cosine_is_verls_to_the_last_bit(warmup, total, floor, cycles):
    verl = get_cosine_schedule_with_warmup(optimizer(), warmup, total, min_lr_ratio=floor, num_cycles=cycles)
    assert dsrl_lrs("cosine", warmup, total, floor, cycles) == stepped(verl, total + 3)


@pytest.mark.parametrize("warmup", [0, 1, 7, 40])
def test_constant_is_verls_to_the_last_bit(warmup):
    assert dsrl_lrs("constant", warmup, 100) == stepped(get_constant_schedule_with_warmup(optimizer(), warmup), 103)
