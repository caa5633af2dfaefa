"""Exact resume on two CPU ranks under the real ``deepspeed`` launcher, in every configuration dsrl ships
(each recipe under the CPU overlay, and the quickstart): a run resumed from the uninterrupted run's
step-3 checkpoint (tests/checkpoint/test_resume.py resumes at step 2), in PPO's case killed with SIGKILL on
the way (the launcher then stops the other rank) and resumed again, is bit-identical to the uninterrupted
run at every later step: each rank's metrics, partitions, optimizer state and RNG.

What two ranks add to a resume is the same code in every recipe (each rank's partitions, RNG and share of
the prompts, rows moved between ranks); what a recipe adds is resumed on one rank in every configuration.
So the default run keeps PPO (the one with a second trained engine); the quickstart's two-rank resume is in the
default run as tests/runtime/test_multinode.py (resumed under three launchers, bit-identical to one node), and the
other six here are ``slow`` (``python -m pytest -m slow tests/checkpoint/test_resume_2ranks.py``), about two minutes
each on two cores.
"""

from __future__ import annotations

import pytest

from tests.helpers.resume import (
    SHIPPED,
    STEPS,
    Baselines,
    assert_same_run,
    logged_steps,
    resume_chain,
    resume_overrides,
)

pytestmark = pytest.mark.dist

RESUME_AT = 3
KILLS = {"ppo": [("write_state@4", 3)]}


@pytest.fixture(scope="module")
def overrides_for(tiny_model_dir, arithmetic_data, ds_test_config):
    ds_config = ds_test_config("zero3_offload")
    return lambda name, ckpt: resume_overrides(
        name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt
    )


DEFAULT_RUN = ("ppo",)


@pytest.mark.parametrize(
    "name", [name if name in DEFAULT_RUN else pytest.param(name, marks=pytest.mark.slow) for name in SHIPPED]
)
def test_killed_and_resumed_run_is_bit_identical(name, overrides_for, free_port, tmp_path, deepspeed_cpu_ops):
    baselines = Baselines(tmp_path / "baseline", overrides_for, free_port, world=2)
    baseline = baselines.result(name)  # two ranks take both cores: one run at a time
    chain = tmp_path / "chain"
    start = baseline / "ckpt" / f"global_step_{RESUME_AT}"
    resume_chain(
        name,
        start,
        KILLS.get(name, []),
        out=chain,
        overrides=overrides_for(name, chain / "ckpt"),
        world=2,
        free_port=free_port,
    )
    assert assert_same_run(baseline, chain, first_step=RESUME_AT + 1, ranks=(0, 1)) == STEPS - RESUME_AT + 1


@pytest.mark.slow  # partial rollout's representative in the default run: tests/checkpoint/test_resume.py
def test_a_colocate_async_run_agrees_on_every_stop_and_resumes_bit_identically(
    overrides_for, free_port, tmp_path, deepspeed_cpu_ops
):
    """Partial rollout on two ranks: both take every stop from the same gathered counts (each rank's off-policy
    metrics are the same at every step, chunks included), groups move to the rank that trains them, and a run killed
    while saving and resumed is bit-identical to the uninterrupted one, each rank's groups in flight included."""

    def overrides(name, ckpt):
        return [
            *overrides_for(name, ckpt),
            "trainer.v1.trainer_mode=colocate_async",
            "trainer.v1.colocate_async.chunk_tokens=4",
        ]

    baseline = Baselines(tmp_path / "baseline", overrides, free_port, world=2).result("grpo")
    ranks = [logged_steps(baseline, rank) for rank in (0, 1)]
    off_policy = [
        [{k: v for k, v in e["metrics"].items() if k.startswith("training/off_policy/")} for e in steps]
        for steps in ranks
    ]
    off_policy = [[m for m in steps if m] for steps in off_policy]  # less the validation before training
    assert off_policy[0] == off_policy[1] and len(off_policy[0]) == STEPS
    assert all(m["training/off_policy/groups_carried"] > 0 for m in off_policy[0][1:])
    chain = tmp_path / "chain"
    start = baseline / "ckpt" / f"global_step_{RESUME_AT}"
    resume_chain(
        "grpo", start, [("write_state@4", 3)], out=chain, overrides=overrides("grpo", chain / "ckpt"), world=2,
        free_port=free_port,
    )  # fmt: skip
    assert assert_same_run(baseline, chain, first_step=RESUME_AT + 1, ranks=(0, 1)) == STEPS - RESUME_AT + 1


@pytest.mark.slow
def test_a_sequence_parallel_run_with_the_fused_head_resumes_bit_identically(
    overrides_for, free_port, tmp_path, deepspeed_cpu_ops
):
    """The quickstart with both ranks in one Ulysses group and the fused log-prob head: killed with SIGKILL and
    resumed, then resumed again, bit-identical to the uninterrupted run."""
    long_responses = [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.use_fused_kernels=true",
    ]

    def overrides(name, ckpt):
        return [*overrides_for(name, ckpt), *long_responses]

    baseline = Baselines(tmp_path / "baseline", overrides, free_port, world=2).result("quickstart")
    chain = tmp_path / "chain"
    start = baseline / "ckpt" / f"global_step_{RESUME_AT}"
    kills = [("write_state@4", 3)]
    resume_chain(
        "quickstart",
        start,
        kills,
        out=chain,
        overrides=overrides("quickstart", chain / "ckpt"),
        world=2,
        free_port=free_port,
    )
    assert assert_same_run(baseline, chain, first_step=RESUME_AT + 1, ranks=(0, 1)) == STEPS - RESUME_AT + 1
