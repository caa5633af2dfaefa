"""Exact resume on two CPU ranks under the real ``deepspeed`` launcher: a rank killed with SIGKILL
(the launcher then stops the other) mid-step or while a checkpoint is written, then the run resumed,
ends bit-identical to an uninterrupted run: each rank's metrics, partitions, optimizer state and RNG.
"""

from __future__ import annotations

import pytest

from tests.resume_helpers import Baselines, assert_same_run, resume_chain, resume_overrides

pytestmark = pytest.mark.dist

CHAINS = {
    "grpo": [("save_engines@4", 2), ("update@7", 6)],
    "otb": [("publish@2", 2), ("update@5", 4)],
    "ppo": [("write_state@4", 2)],
}


@pytest.fixture(scope="module")
def overrides_for(tiny_model_dir, arithmetic_data, ds_test_config):
    ds_config = ds_test_config("zero3_offload")
    return lambda name, ckpt: resume_overrides(
        name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt, world=2
    )


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_killed_and_resumed_run_is_bit_identical(name, overrides_for, free_port, tmp_path, deepspeed_cpu_ops):
    baselines = Baselines(tmp_path / "baseline", overrides_for, free_port, world=2)
    baseline = baselines.result(name)  # two ranks take both cores: one run at a time
    chain = tmp_path / "chain"
    resume_chain(name, CHAINS[name], out=chain, overrides=overrides_for(name, chain / "ckpt"), world=2, free_port=free_port)
    assert assert_same_run(baseline, chain, ranks=(0, 1)) >= 16
