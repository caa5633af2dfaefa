"""Two simulated nodes of one CPU rank each on this machine (../shared/reviews/multinode.md): the launchers people
start several nodes with, the preflight that stops a broken cluster before any model loads, and runs without a
launcher side by side.

- Under ``deepspeed --no_ssh --node_rank N`` (Kubernetes-style pods), srun's tasks (the variables srun sets) and
  Open MPI's ``mpirun`` (its ``OMPI_COMM_WORLD_*``), a run resumed from a one-node 2-rank run's checkpoint trains,
  saves and ends bit-identical to that one-node run: every metric, checkpoint and the exported model (srun's and
  mpirun's: slow).
- Each "node" with its own ``trainer.default_local_dir`` (no shared filesystem): the run stops at the preflight.
- ``--preflight`` prints the cluster and exits.
- A rank whose peers never come fails at the rendezvous timeout with what to check.
- Two ``python scripts/train.py`` runs at once on one machine both finish (each on its own free port).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import QUICKSTART
from tests.helpers.resume import (
    STEPS,
    WORKER,
    Baselines,
    assert_same_run,
    resume_chain,
    resume_overrides,
    two_nodes,
)

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
RESUME_AT = 3


@pytest.fixture(scope="module")
def overrides_for(tiny_model_dir, arithmetic_data, ds_test_config):
    ds_config = ds_test_config("zero3_offload")
    return lambda name, ckpt: resume_overrides(
        name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_config, ckpt=ckpt
    )


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, overrides_for, free_port):
    """The uninterrupted quickstart on one node of two ranks (``deepspeed --num_gpus 2``), run once."""
    return Baselines(tmp_path_factory.mktemp("one_node"), overrides_for, free_port, world=2).result("quickstart")


# The resume is the same under every launcher; what differs is how each launcher's variables become the rank and the
# rendezvous, which tests/unit/test_launch.py reads from srun's and Open MPI's variables. So no_ssh's run stays in the
# default run; srun's and mpirun's, minutes each, are slow (srun's variables still start the runs below).
@pytest.mark.parametrize(
    "launcher", ["no_ssh", pytest.param("slurm", marks=pytest.mark.slow), pytest.param("mpi", marks=pytest.mark.slow)]
)
def test_two_nodes_resume_train_and_save_bit_identical_to_one_node(
    launcher, one_node, overrides_for, free_port, deepspeed_cpu_ops, tmp_path
):
    chain = tmp_path / "chain"
    resume_chain(
        "quickstart",
        one_node / "ckpt" / f"global_step_{RESUME_AT}",
        [],
        out=chain,
        overrides=overrides_for("quickstart", chain / "ckpt"),
        world=2,
        free_port=free_port,
        launcher=launcher,
    )
    assert assert_same_run(one_node, chain, first_step=RESUME_AT + 1, ranks=(0, 1)) == STEPS - RESUME_AT + 1


def launch_train(
    launcher: str,
    args: list[str],
    tmp_path: Path,
    port: int,
    node_dirs: tuple[Path, Path],
    script: Path = REPO / "scripts" / "train.py",
):
    """``script`` on two simulated nodes, node N started in ``node_dirs[N]``: (exit codes, outputs)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
    )
    nodes = two_nodes(launcher, [sys.executable, str(script)], port, tmp_path)
    processes = [
        subprocess.Popen(
            [*command, *args],
            env={**env, **extra},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for (command, extra), cwd in zip(nodes, node_dirs, strict=True)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    return [process.returncode for process in processes], outputs


@pytest.fixture
def quickstart_args(tiny_model_dir, arithmetic_data, ds_test_config):
    return [
        *QUICKSTART,
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        "data.val_files=null",
        f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
        "trainer.logger=[console]",
        "trainer.default_local_dir=checkpoints/run",
    ]  # relative: per node's directory


def test_checkpoint_directories_that_differ_per_node_stop_the_run_at_the_preflight(
    quickstart_args, free_port, deepspeed_cpu_ops, tmp_path
):
    nodes = (tmp_path / "node0", tmp_path / "node1")
    for node in nodes:
        node.mkdir()
    codes, (output, _) = launch_train("no_ssh", quickstart_args, tmp_path, free_port(), nodes)
    assert codes == [2, 2], output[-4000:]
    problem = re.search(
        r"^  trainer\.default_local_dir=checkpoints/run is not the directory rank 0 writes checkpoints "
        rf"in \({re.escape(str(nodes[0] / 'checkpoints' / 'run'))} on \S+\): the file rank 0 wrote there "
        r"is missing here;.*fix: a directory every node sees at the same absolute path.*\[rank 1 on \S+\]$",
        output,
        re.M,
    )
    assert problem, output[-4000:]
    assert "step 1/" not in output and "start-up summary" not in output  # stopped before any model loaded
    assert not (nodes[0] / "checkpoints").exists()  # the check leaves nothing behind


def test_a_save_that_rank_0_cannot_see_whole_is_not_published(quickstart_args, free_port, tmp_path):
    """Past the preflight (tests/helpers/train_worker.py builds the Trainer itself), node directories that differ leave
    rank 0 without rank 1's files: the save stops both ranks and publishes nothing."""
    nodes = (tmp_path / "node0", tmp_path / "node1")
    for node in (*nodes, tmp_path / "out"):
        node.mkdir()
    codes, outputs = launch_train(
        "slurm",
        ["--out", str(tmp_path / "out"), *quickstart_args, "trainer.total_training_steps=1", "trainer.save_freq=1"],
        tmp_path,
        free_port(),
        nodes,
        script=WORKER,
    )
    assert codes == [1, 1], outputs[0][-3000:]
    for output in outputs:
        assert re.search(
            r"step 1: rank 0 does not see the files of 1 rank\(s\) \(first: rank 1\) in \S+\.tmp_global_step_1: "
            r"trainer\.default_local_dir is no longer one directory on every node.*nothing was published",
            output,
        ), output[-3000:]
    assert not list((nodes[0] / "checkpoints" / "run").glob("global_step_*"))


def test_preflight_prints_the_cluster_and_exits(quickstart_args, free_port, tmp_path):
    codes, (output, other) = launch_train(
        "slurm", [*quickstart_args, "--preflight"], tmp_path, free_port(), (tmp_path, tmp_path)
    )
    assert codes == [0, 0], output[-4000:] + other[-2000:]
    assert re.search(
        r"^dsrl preflight: 2 rank\(s\) on 2 node\(s\): \S+ \(node 0\) rank 0, \S+ \(node 1\) rank 1 \(slurm\)$",
        output,
        re.M,
    ), output[-3000:]
    assert f"trainer.default_local_dir: {tmp_path / 'checkpoints' / 'run'}, one directory on every node" in output
    assert "dsrl preflight" not in other  # rank 0 prints it
    assert not (tmp_path / "checkpoints").exists()


def test_a_rank_whose_peers_never_come_fails_at_the_timeout_saying_what_to_check(quickstart_args, free_port):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
    )
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), *quickstart_args, "actor_rollout_ref.nccl_timeout=20"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert re.search(
        r"rank 0 on \S+: waited 15 s for the 2 ranks of the run to meet at 127\.0\.0\.1:\d+; no launcher "
        r"started this process, so WORLD_SIZE=2 may be left over",
        done.stdout,
    ), done.stdout[-3000:]
    assert re.search(
        r"^dsrl: rank 0 on \S+: the 2 ranks did not all meet at 127\.0\.0\.1:\d+ within 20 s "
        r"\(environment; .*\); fix: start every node's ranks",
        done.stdout,
        re.M,
    ), done.stdout[-3000:]
    assert "Traceback" not in done.stdout


def test_two_runs_without_a_launcher_on_one_machine_both_finish(quickstart_args, tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "scripts" / "train.py"),
                *quickstart_args,
                "trainer.total_training_steps=1",
                f"trainer.default_local_dir={tmp_path / str(i)}",
                f"trainer.experiment_name=side_by_side_{i}",
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    for run, output in zip(runs, outputs, strict=True):
        assert run.returncode == 0, output[-3000:]
        assert re.search(r"^\[dsrl r0 [\d:]+\] step 1/1 ", output, re.M), output[-3000:]
