"""Which launcher started this process, and the ``torch.distributed`` environment that follows from it.

torch and DeepSpeed read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; only
some launchers set them. ``discover`` reads what each one provides, first match wins:

- ``deepspeed`` (pdsh, ``--no_ssh``, one node) and ``torchrun``: the torch variables themselves (``RANK`` set);
  the node index is ``CROSS_RANK`` or ``GROUP_RANK``, the ranks per node ``LOCAL_SIZE`` or ``LOCAL_WORLD_SIZE``.
- Open MPI's ``mpirun`` (and ``deepspeed --launcher openmpi``): ``OMPI_COMM_WORLD_*``.
- ``srun`` (and ``deepspeed --launcher slurm``): the step's ``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NODEID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE`` and ``SLURM_STEP_NODELIST``; the
  rendezvous is the step's first host, on a port derived from the job and step ids. A batch script itself
  (no ``srun``) has no step variables and is one process.
- MPICH, Intel MPI and MVAPICH (``mpirun``, ``deepspeed --launcher mpich|impi|mvapich``): ``PMI_RANK``,
  ``PMI_SIZE`` and the local rank their process managers add.
- none: one process on localhost, on a free port (two such runs on one machine must not meet).

Variables already set (``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_SIZE``) win over the derived ones, so a user
can always name the rendezvous. Imports no torch: the CLI knows the world before it validates the config.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

# Ports a SLURM step derives from its ids: below Linux's ephemeral range (32768-60999), where clients bind.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 12000
MPI_DEFAULT_PORT = 29500  # torch's and DeepSpeed's default rendezvous port
# What a RANK-setting launcher (deepspeed, torchrun) or join() leaves in a process's environment: a child that
# must be a world of its own (a run that dsrl-compare starts, a test's) starts without them.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE",
                      "GROUP_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


class LaunchError(ValueError):
    """The launcher's variables do not describe a world dsrl can join (the message names them and the fix)."""


class RendezvousError(RuntimeError):
    """The ranks of a run did not all meet within the timeout (the message says where and what to check)."""


@dataclass(frozen=True)
class Launch:
    """One process's place in the world, as its launcher describes it."""

    launcher: str  # "deepspeed", "torchrun", "openmpi", "slurm", "mpi (PMI)", "environment" or "none"
    rank: int
    local_rank: int
    world_size: int
    local_size: int | None  # ranks on this node, when the launcher says
    node_rank: int | None  # this node's index, when the launcher says
    master_addr: str
    master_port: str

    def environment(self) -> dict[str, str]:
        """The variables torch and DeepSpeed read (``LOCAL_SIZE`` only when known)."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        if self.local_size is not None:
            env["LOCAL_SIZE"] = str(self.local_size)
        return env


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    if not value.strip().isdigit():
        raise LaunchError(f"{name}={value!r}: must be a non-negative integer; fix: unset it or start under a launcher")
    return int(value)


def _optional_int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if environ.get(name, "").strip():
            return _int(environ, name)
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas outside brackets separate hosts
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first)


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks-per-node list, expanded: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE={spec!r}: not a SLURM tasks-per-node list such as 8(x2)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port every task of a SLURM step derives alike from its job and step ids."""
    return SLURM_PORT_BASE + (job_id * 17 + step_id) % SLURM_PORT_SPAN


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the rendezvous of a run without a launcher)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_style(environ: Mapping[str, str]) -> Launch:
    launcher = (
        "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "deepspeed" if "CROSS_RANK" in environ else "environment"
    )
    world = _int(environ, "WORLD_SIZE") if "WORLD_SIZE" in environ else 1
    return Launch(
        launcher=launcher,
        rank=_int(environ, "RANK"),
        local_rank=_optional_int(environ, "LOCAL_RANK") or 0,
        world_size=world,
        local_size=_optional_int(environ, "LOCAL_SIZE", "LOCAL_WORLD_SIZE"),
        node_rank=_optional_int(environ, "CROSS_RANK", "GROUP_RANK"),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=environ.get("MASTER_PORT") or str(free_port() if world == 1 else MPI_DEFAULT_PORT),
    )


def _mpi(
    environ: Mapping[str, str],
    launcher: str,
    rank: int,
    world: int,
    local_rank: int | None,
    local_size: int | None,
    names: str,
) -> Launch:
    if local_rank is None:
        raise LaunchError(
            f"{names} name this process's rank but not its rank on its node, which picks its device; fix: start "
            "it with mpirun of MPICH, Intel MPI, MVAPICH or Open MPI, or set LOCAL_RANK and LOCAL_SIZE"
        )
    one_host = local_size == world
    address = environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else None)
    if address is None:
        raise LaunchError(
            f"{names}: {world} ranks over several hosts, and MPI does not say which host holds rank 0, where the "
            "ranks meet; fix: export MASTER_ADDR (the first host) and MASTER_PORT to every rank, e.g. mpirun -x "
            "MASTER_ADDR=node1 -x MASTER_PORT=29500 (Open MPI) or -genv MASTER_ADDR node1 (MPICH, Intel MPI)"
        )
    return Launch(
        launcher=launcher,
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_size=local_size,
        node_rank=None,
        master_addr=address,
        master_port=environ.get("MASTER_PORT") or str(MPI_DEFAULT_PORT),
    )


def _slurm(environ: Mapping[str, str]) -> Launch:
    world = _int(environ, "SLURM_STEP_NUM_TASKS")
    node = _optional_int(environ, "SLURM_NODEID")
    local_size = _optional_int(environ, "LOCAL_SIZE")
    if local_size is None and environ.get("SLURM_STEP_TASKS_PER_NODE") and node is not None:
        counts = tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
        local_size = counts[node] if node < len(counts) else None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    if "MASTER_PORT" in environ:
        port = environ["MASTER_PORT"]
    elif world == 1:
        port = str(free_port())
    else:
        port = str(
            slurm_port(_optional_int(environ, "SLURM_JOB_ID") or 0, _optional_int(environ, "SLURM_STEP_ID") or 0)
        )
    return Launch(
        launcher="slurm",
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_optional_int(environ, "SLURM_LOCALID") or 0,
        world_size=world,
        local_size=local_size,
        node_rank=node,
        master_addr=environ.get("MASTER_ADDR") or first_host(nodelist),
        master_port=port,
    )


def discover(environ: Mapping[str, str]) -> Launch:
    """This process's launch, from ``environ`` (module doc). LaunchError when the variables do not add up."""
    if "RANK" in environ:
        launch = _torch_style(environ)
    elif "OMPI_COMM_WORLD_SIZE" in environ:
        launch = _mpi(
            environ,
            "openmpi",
            _int(environ, "OMPI_COMM_WORLD_RANK"),
            _int(environ, "OMPI_COMM_WORLD_SIZE"),
            _optional_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _optional_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE"),
            "OMPI_COMM_WORLD_RANK/SIZE",
        )
    elif (
        "SLURM_STEP_NUM_TASKS" in environ
        and environ.get("PMI_SIZE", environ["SLURM_STEP_NUM_TASKS"]) == environ["SLURM_STEP_NUM_TASKS"]
    ):
        launch = _slurm(environ)  # srun's own tasks (with or without --mpi); an MPI launched inside is PMI's
    elif "PMI_SIZE" in environ:
        launch = _mpi(
            environ,
            "mpi (PMI)",
            _int(environ, "PMI_RANK"),
            _int(environ, "PMI_SIZE"),
            _optional_int(environ, "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK"),
            _optional_int(environ, "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "LOCAL_SIZE"),
            "PMI_RANK/PMI_SIZE",
        )
    elif (_optional_int(environ, "WORLD_SIZE") or 1) > 1:
        raise LaunchError(
            f"WORLD_SIZE={environ['WORLD_SIZE']} but no RANK, and no launcher's variables (deepspeed, torchrun, "
            "srun, mpirun): a WORLD_SIZE left over in the environment; fix: unset WORLD_SIZE for one process, or "
            "start the ranks with a launcher (deepspeed --num_gpus N ...)"
        )
    else:
        return Launch(
            launcher="none",
            rank=0,
            local_rank=0,
            world_size=1,
            local_size=1,
            node_rank=0,
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=environ.get("MASTER_PORT") or str(free_port()),
        )
    if not 0 <= launch.rank < launch.world_size:
        raise LaunchError(
            f"rank {launch.rank} of a world of {launch.world_size} ({launch.launcher}): the rank must be "
            "below the world size; fix: check the launcher's variables"
        )
    return launch


_joined: Launch | None = None


def join() -> Launch:
    """This process's launch (``discover``), its variables written into ``os.environ`` for torch and DeepSpeed.
    A later call returns the same launch while those variables stand (read back, they would lose the launcher's
    name, which the launcher watchdog needs), and discovers again once something changed them."""
    global _joined
    if _joined is None or any(os.environ.get(name) != value for name, value in _joined.environment().items()):
        _joined = discover(os.environ)
        os.environ.update(_joined.environment())
    return _joined
