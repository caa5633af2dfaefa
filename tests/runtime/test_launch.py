"""Rank discovery under every launcher (``dsrl.runtime.launch``), from the variables each one sets, as read from their
sources and from the ranks' environments on two simulated nodes (../shared/reviews/multinode.md)."""

from __future__ import annotations

import socket

import pytest

from dsrl.runtime.launch import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    LaunchError,
    discover,
    first_host,
    slurm_port,
    tasks_per_node,
)

# Rank 1 of 2 nodes x 1 rank, as each launcher sets it.
DEEPSPEED = {
    "RANK": "1",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_SIZE": "1",
    "CROSS_RANK": "1",
    "CROSS_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
TORCHRUN = {
    "RANK": "1",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RUN_ID": "none",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NUM_TASKS": "16",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
HYDRA = {
    "PMI_RANK": "5",
    "PMI_SIZE": "8",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "4",
    # what deepspeed --launcher mpich/impi exports: no RANK
    "WORLD_SIZE": "8",
    "LOCAL_SIZE": "4",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29600",
}


def test_the_deepspeed_launcher_and_torchrun_are_read_as_they_are():
    for environ, launcher in ((DEEPSPEED, "deepspeed"), (TORCHRUN, "torchrun")):
        launch = discover(environ)
        assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == (launcher, 1, 0, 2)
        assert (launch.local_size, launch.node_rank, launch.master_addr, launch.master_port) == (
            1,
            1,
            "10.0.0.1",
            "29500",
        )
    assert discover({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}).launcher == "environment"


def test_srun_tasks_get_rank_node_and_a_rendezvous_on_the_steps_first_host():
    launch = discover(SRUN)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == ("slurm", 9, 1, 16)
    assert (launch.local_size, launch.node_rank, launch.master_addr) == (8, 1, "gpu07")
    assert launch.master_port == str(slurm_port(123456, 0))
    assert launch.environment() == {
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "16",
        "LOCAL_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(slurm_port(123456, 0)),
    }
    # What the user exports wins; uneven nodes take their own count.
    mine = discover({**SRUN, "MASTER_ADDR": "ib-gpu07", "MASTER_PORT": "4000", "SLURM_STEP_TASKS_PER_NODE": "9,7"})
    assert (mine.master_addr, mine.master_port, mine.local_size) == ("ib-gpu07", "4000", 7)


def test_slurm_host_lists_tasks_per_node_and_ports():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("cpu1,gpu[07-09]") == "cpu1"
    assert first_host("rack[2-3]-n[001-004]") == "rack2-n001"
    assert first_host("node5") == "node5"
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(LaunchError, match=r"SLURM_STEP_TASKS_PER_NODE='8x2': not a SLURM tasks-per-node list"):
        tasks_per_node("8x2")
    ports = {slurm_port(job, step) for job in range(1000, 1100) for step in range(3)}
    assert all(SLURM_PORT_BASE <= port < SLURM_PORT_BASE + SLURM_PORT_SPAN for port in ports)
    assert slurm_port(1000, 0) != slurm_port(1000, 1) != slurm_port(1001, 0)  # two steps of a job do not meet


def test_a_batch_script_without_srun_is_one_process_on_a_free_port():
    batch = {key: value for key, value in SRUN.items() if not key.startswith("SLURM_STEP")}
    launch = discover(batch)
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr) == ("none", 0, 1, "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(launch.master_port)))  # nothing listens there


def test_mpi_launchers():
    one_host = discover(OPEN_MPI)
    assert (one_host.launcher, one_host.rank, one_host.local_rank, one_host.world_size) == ("openmpi", 3, 1, 4)
    assert (one_host.local_size, one_host.master_addr, one_host.master_port) == (4, "127.0.0.1", "29500")
    two_hosts = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(
        LaunchError, match=r"4 ranks over several hosts.*fix: export MASTER_ADDR.*mpirun -x MASTER_ADDR"
    ):
        discover(two_hosts)
    assert discover({**two_hosts, "MASTER_ADDR": "node1"}).master_addr == "node1"
    hydra = discover(HYDRA)
    assert (hydra.launcher, hydra.rank, hydra.local_rank, hydra.world_size, hydra.local_size) == (
        "mpi (PMI)",
        5,
        1,
        8,
        4,
    )
    assert (hydra.master_addr, hydra.master_port) == ("node1", "29600")
    with pytest.raises(LaunchError, match=r"PMI_RANK/PMI_SIZE name this process's rank but not its rank on its node"):
        discover({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "node1"})


def test_mpirun_inside_an_allocation_is_mpis_world_not_the_steps():
    """Open MPI and MPICH start their daemons with srun: the ranks inherit the daemons' step (one task per node)."""
    inside = {**SRUN, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    assert discover({**inside, **OPEN_MPI}).launcher == "openmpi"
    assert discover({**inside, **HYDRA}).launcher == "mpi (PMI)"
    # srun --mpi=pmi2 sets PMI_* for its own tasks: the step is the world, with its node list.
    assert discover({**SRUN, "PMI_RANK": "9", "PMI_SIZE": "16"}).launcher == "slurm"


def test_variables_that_do_not_add_up_are_refused_with_the_fix():
    with pytest.raises(LaunchError, match=r"WORLD_SIZE=2 but no RANK.*fix: unset WORLD_SIZE for one process"):
        discover({"WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match=r"WORLD_SIZE='two': must be a non-negative integer"):
        discover({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(LaunchError, match=r"rank 16 of a world of 16 \(slurm\): the rank must be below the world size"):
        discover({**SRUN, "SLURM_PROCID": "16"})
