"""DeepSpeed's C++ Adam steps exactly alike in a live process and after a resume at any step count.

Both of its builds keep ``beta ** t`` in C++ (multiplied step by step while the process lives, ``pow``
when the step count jumps, as after a resume): ``dsrl.engines.deepspeed_setup.bias_correction_from_step``
makes every step take ``pow``. Each case trains one optimizer for 8 steps, and again with the optimizer
rebuilt from a saved state at step k (a resume), for every k from 1 to 7; the weights must be bit-identical.
Without the fix, resumes at k = 2 and 5 differ (and at 11, 13, ...: beta2 = 0.999 in float32).

A resume is a new process. A new CPU Adam gets a new C++ object anyway; FusedAdam's CPU build shares one
object per process, created with placeholder betas (0): ``_new_process`` puts it back in that state.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsrl.engines.deepspeed_setup import bias_correction_from_step

pytestmark = pytest.mark.e2e  # builds DeepSpeed's CPU ops (minutes on a fresh machine), then ~30 s of steps

STEPS = 8


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.1}]  # ZeRO steps several groups
    if kind == "cpu_adam":
        optimizer = DeepSpeedCPUAdam(groups, lr=1e-2, betas=(0.9, 0.999), adamw_mode=True)
    else:
        optimizer = FusedAdam(groups, lr=1e-2, betas=(0.9, 0.999), adam_w_mode=True)
    bias_correction_from_step(optimizer)
    return optimizer


def _new_process(optimizer: torch.optim.Optimizer) -> None:
    """FusedAdam's shared C++ object as a new process has it: betas 0 (one update of a dummy with them)."""
    if hasattr(optimizer, "multi_tensor_adam"):
        dummy = [[torch.zeros(1)] for _ in range(4)]
        optimizer.multi_tensor_adam(1, torch.zeros(1, dtype=torch.int), dummy, 0.0, 0.0, 0.0, 1.0, 1, 1, 1, 0.0)


def _train(kind: str, resume_at: int | None) -> list[torch.Tensor]:
    init = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(257, generator=init)) for _ in range(2)]
    optimizer = _optimizer(kind, params)
    grads = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        if step == resume_at:  # a new process: the weights and the optimizer's saved state, nothing else
            state = copy.deepcopy(optimizer.state_dict())
            params = [torch.nn.Parameter(p.detach().clone()) for p in params]
            optimizer = _optimizer(kind, params)
            _new_process(optimizer)
            optimizer.load_state_dict(state)
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("kind", ["cpu_adam", "fused_adam"])
def test_resumed_steps_equal_live_ones_at_every_step_count(kind, deepspeed_cpu_ops):
    live = _train(kind, None)
    differing = [k for k in range(1, STEPS) if not all(map(torch.equal, live, _train(kind, k)))]
    assert differing == []


def test_other_optimizers_are_left_alone():
    """torch's Adam computes the correction from its step count already: nothing is wrapped."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    bias_correction_from_step(optimizer)
    assert "step" not in vars(optimizer)


def test_an_lr_scheduler_wraps_the_exact_step(deepspeed_cpu_ops):
    """torch's LR schedulers wrap ``optimizer.step`` as a bound method (the trainer builds one per engine)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = DeepSpeedCPUAdam([weight], lr=0.1)
    bias_correction_from_step(optimizer)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    weight.grad = torch.ones(2)
    optimizer.step()
    assert torch.allclose(weight.detach(), torch.full((2,), -0.1))  # Adam's first step: lr * sign(grad)
