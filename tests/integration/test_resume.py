"""Exact resume on one rank: runs killed with SIGKILL (mid-step, and at each phase of writing a
checkpoint) or stopped by SIGTERM, then resumed, end bit-identical to an uninterrupted run.

Each run is a real process (``tests/train_worker.py``): configs/{grpo,otb,ppo}.yaml shrunk to
seconds per step, 8 steps, a checkpoint every 2. PPO has a critic and the adaptive in-reward KL
controller, so the critic's optimizer and the KL coefficient must survive too. Uninterrupted runs
execute beside the interrupted ones (one thread each, two cores).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.resume_helpers import (
    Baselines,
    assert_same_run,
    finish,
    logged_steps,
    resume_chain,
    resume_overrides,
    run_worker,
    start_worker,
)

# (kill point, checkpoint the next run resumes from): a kill in the middle of writing a checkpoint
# falls back to the one before; a kill right after one is published resumes from it.
CHAINS = {
    "grpo": [("save_engines@4", 2), ("update@7", 6)],
    "otb": [("write_state@4", 2), ("update@5", 4)],
    "ppo": [("publish@2", 2), ("update@4", 2), ("write_state@6", 4)],
}


@pytest.fixture(scope="module")
def overrides_for(tiny_model_dir, arithmetic_data, ds_test_config):
    ds_config = ds_test_config("zero3_offload")
    return lambda name, ckpt: resume_overrides(
        name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt, world=1
    )


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, overrides_for, free_port, deepspeed_cpu_ops):
    return Baselines(tmp_path_factory.mktemp("baselines"), overrides_for, free_port, world=1)


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_killed_and_resumed_run_is_bit_identical(name, baselines, overrides_for, free_port, tmp_path):
    baselines.start(name)  # beside the chain
    resume_chain(
        name, CHAINS[name], out=tmp_path, overrides=overrides_for(name, tmp_path / "ckpt"), world=1, free_port=free_port
    )
    assert assert_same_run(baselines.result(name), tmp_path) >= 8


def test_sigterm_saves_exits_143_and_resumes_exactly(baselines, overrides_for, free_port, tmp_path):
    baselines.start("grpo")
    overrides = overrides_for("grpo", tmp_path / "ckpt")
    process = start_worker("grpo", overrides, tmp_path, port=free_port())
    deadline = time.time() + 300
    while not any(e["step"] == 3 for e in logged_steps(tmp_path)):
        assert process.poll() is None and time.time() < deadline, "the run ended before step 3"
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    code, output = finish(process)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    stopped = max(e["step"] for e in logged_steps(tmp_path))
    assert stopped < 8
    assert f"checkpoint saved to {tmp_path / 'ckpt' / f'global_step_{stopped}'}" in output  # even off save_freq
    assert "SIGTERM received: finishing this step" in output
    code, output = run_worker("grpo", overrides, tmp_path, port=free_port())
    assert code == 0, output[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / f'global_step_{stopped}'}" in output
    assert_same_run(baselines.result("grpo"), tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_exits_at_once(signum):
    """The first signal only asks the loop to stop after its step; a second one ends the process
    at once with 128 + the signal number."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from dsrl.console import setup_logging\n"
        "from dsrl.trainer import StopSignals\n"
        "setup_logging(rank=0)\n"
        "with StopSignals(rank=0) as s:\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        f"    assert s.signum == {int(signum)}\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        "    time.sleep(60)\n"
    )
    start = time.time()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + signum, result.stderr
    assert f"{signal.Signals(signum).name} received: finishing this step" in result.stdout
    assert time.time() - start < 60
