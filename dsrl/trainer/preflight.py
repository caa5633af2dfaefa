"""The preflight: before any model loads, every rank says where it runs and what it has, and the run stops at once,
with one line per problem, when the ranks do not make one sound cluster.

Every rank reports (``host_facts``) its host, its node (the launcher's node index, else the host), its local
rank, its device, and the versions of the packages whose mismatch across ranks corrupts a run silently. Then:

- per rank, gathered with the ranks and hosts that have them (``dsrl.runtime.distributed.gather_problems``): the
  configuration's own problems (a model or data path missing on some node); a device the local rank does not
  have; ``trainer.default_local_dir`` not the same directory as rank 0's (rank 0 writes a nonce there, every
  rank reads it back: checkpoints need one directory every node sees);
- over the cluster (``cluster_problems``): nodes with different numbers of ranks; two ranks on one device; a
  vLLM tensor-parallel group over two nodes (its ranks share GPU memory through one node's engine), or a
  sequence-parallel group (its all-to-all in every attention layer needs the node's links); different
  versions of dsrl, torch, DeepSpeed, transformers or vLLM, or a different rollout engine, on some ranks.

``dsrl-train ... --preflight`` runs only this under the launcher and prints the cluster (``Cluster.table``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import secrets
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from dsrl.config import Config
from dsrl.config.rules.need import critic_used
from dsrl.runtime.distributed import gather_problems, rank_span
from dsrl.runtime.launch import Launch

# Packages whose versions must agree on every rank: the same config would run different code.
VERSIONED = ("dsrl", "torch", "deepspeed", "transformers", "vllm")
NONCE_FILE = ".dsrl-preflight"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device() -> tuple[str, str | None, str | None]:
    """This rank's device (``cpu``, ``cuda:3``), the physical device's id where there is one, and a problem when
    its local rank has no device."""
    accelerator = get_accelerator()
    name = accelerator.device_name()
    if name == "cpu":
        return "cpu", None, None
    local_rank, count = int(os.environ["LOCAL_RANK"]), accelerator.device_count()
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        return (
            name,
            None,
            (
                f"LOCAL_RANK={local_rank} but this rank sees {count} {name} device(s) "
                f"(CUDA_VISIBLE_DEVICES={visible}): a rank takes the device of its local rank; fix: let every rank of "
                "a node see all the node's GPUs (srun --gpus-per-node=N, not --gpus-per-task=1 or --gpu-bind), or "
                "start as many ranks per node as it has GPUs"
            ),
        )
    props = torch.cuda.get_device_properties(local_rank)
    return (
        f"{name}:{local_rank} ({props.name})",
        str(getattr(props, "uuid", f"{socket.gethostname()}:{local_rank}")),
        None,
    )


def host_facts(launch: Launch, rollout: str | None) -> dict[str, Any]:
    """What this rank tells the others about itself."""
    device, device_id, problem = _device()
    return {
        "host": socket.gethostname(),
        "node": launch.node_rank if launch.node_rank is not None else socket.gethostname(),
        "local_rank": launch.local_rank,
        "device": device,
        "device_id": device_id,
        "versions": {package: _version(package) for package in VERSIONED},
        "rollout": rollout,
        "problem": problem,
    }


@dataclass(frozen=True)
class Cluster:
    """Every rank's facts, by rank, and the launcher that started them."""

    facts: list[dict[str, Any]]
    launcher: str

    def nodes(self) -> dict[Any, list[int]]:
        """The ranks of each node, nodes in order of their first rank."""
        nodes: dict[Any, list[int]] = {}
        for rank, facts in enumerate(self.facts):
            nodes.setdefault(facts["node"], []).append(rank)
        return nodes

    def node_name(self, node: Any) -> str:
        """The host of ``node``, with the launcher's node index where several nodes share a host name."""
        host = self.facts[self.nodes()[node][0]]["host"]
        shared = sum(self.facts[ranks[0]]["host"] == host for ranks in self.nodes().values()) > 1
        return f"{host} (node {node})" if shared else host

    def describe(self) -> str:
        """One line: ``16 rank(s) on 2 nodes: gpu-a ranks 0-7, gpu-b ranks 8-15``."""
        nodes = self.nodes()
        where = ", ".join(f"{self.node_name(node)} {rank_span(ranks)}" for node, ranks in nodes.items())
        return f"{len(self.facts)} rank(s) on {len(nodes)} node(s): {where}"

    def table(self, checkpoint_dir: str) -> str:
        """The cluster as ``--preflight`` prints it."""
        lines = [f"dsrl preflight: {self.describe()} ({'no launcher' if self.launcher == 'none' else self.launcher})"]
        for node, ranks in self.nodes().items():
            devices = ", ".join(sorted({self.facts[rank]["device"] for rank in ranks}))
            lines.append(
                f"  {self.node_name(node)}: {rank_span(ranks)}, local ranks "
                f"{', '.join(str(self.facts[rank]['local_rank']) for rank in ranks)}, {devices}"
            )
        versions = self.facts[0]["versions"]
        lines.append("  versions (every rank): " + ", ".join(f"{name} {versions[name]}" for name in VERSIONED))
        lines.append(f"  trainer.default_local_dir: {checkpoint_dir}, one directory on every node")
        return "\n".join(lines)


def cluster_problems(
    cluster: Cluster,
    tensor_parallel: int,
    sequence_parallel: int = 1,
    sequence_parallel_role: str = "actor_rollout_ref.actor",
) -> list[str]:
    """What is wrong with the cluster as a whole (module doc); the same lines on every rank. ``sequence_parallel``:
    the group size of ``sequence_parallel_role`` (the actor's or, with the actor's 1, the critic's)."""
    problems = []
    nodes = cluster.nodes()
    counts = {cluster.node_name(node): len(ranks) for node, ranks in nodes.items()}
    if len(set(counts.values())) > 1:
        problems.append(
            "the nodes run different numbers of ranks ("
            + ", ".join(f"{name} {n}" for name, n in counts.items())
            + "); dsrl places ranks, devices and tensor-parallel groups by node alike; fix: the same number of "
            "ranks (GPUs) on every node: the same slots= for each host of the hostfile, --nproc-per-node, or "
            "srun --ntasks-per-node"
        )
    for node, ranks in nodes.items():
        local = Counter(cluster.facts[rank]["local_rank"] for rank in ranks)
        devices = Counter(cluster.facts[rank]["device_id"] for rank in ranks if cluster.facts[rank]["device_id"])
        for value, n in sorted(local.items()):
            if n > 1:
                problems.append(
                    f"{n} ranks on {cluster.node_name(node)} have local rank {value}: two ranks would "
                    "take one device; fix: check the launcher's LOCAL_RANK (or SLURM_LOCALID)"
                )
        for device, n in devices.items():
            if n > 1:
                problems.append(
                    f"{n} ranks on {cluster.node_name(node)} share one device ({device}); fix: one rank "
                    "per GPU, e.g. one CUDA_VISIBLE_DEVICES for every rank of a node"
                )
    groups = [
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", tensor_parallel, "vLLM", "tensor-parallel"),
        (
            f"{sequence_parallel_role}.ulysses_sequence_parallel_size",
            sequence_parallel,
            "sequence",
            "sequence-parallel",
        ),
    ]
    node_of = {rank: facts["node"] for rank, facts in enumerate(cluster.facts)}
    for key, size, name, kind in groups:  # groups of consecutive ranks, whose collectives need the node's links
        for start in range(0, len(cluster.facts), size) if size > 1 else ():
            group = range(start, min(start + size, len(cluster.facts)))
            if len({node_of[rank] for rank in group}) > 1:
                problems.append(
                    f"{key}={size}: the {name} group of ranks {group[0]}-{group[-1]} spans nodes "
                    f"({', '.join(dict.fromkeys(cluster.node_name(node_of[r]) for r in group))}); fix: a "
                    f"{kind} size that divides the ranks per node"
                )
                break
    for what, value_of in [
        *((name, lambda f, n=name: f["versions"][n]) for name in VERSIONED),
        ("the rollout engine (actor_rollout_ref.rollout.name)", lambda f: f["rollout"]),
    ]:
        by_value: dict[str, list[int]] = {}
        for rank, facts in enumerate(cluster.facts):
            if value_of(facts) is not None:  # None: a rank whose config did not validate (reported as such)
                by_value.setdefault(str(value_of(facts)), []).append(rank)
        if len(by_value) > 1:
            problems.append(
                f"{what} differs across ranks: "
                + "; ".join(
                    f"{value} on {rank_span(ranks)} ({', '.join(sorted({cluster.facts[r]['host'] for r in ranks}))})"
                    for value, ranks in by_value.items()
                )
                + "; fix: the same environment on every node (one image, or one venv on a shared mount)"
            )
    return problems


def _shared_directory_problem(cfg: Config) -> str | None:
    """Rank 0 writes a nonce in ``trainer.default_local_dir`` (made if missing), every rank reads it back; the
    line for a rank that cannot. Collective."""
    if dist.get_world_size() == 1:
        return None
    directory = Path(cfg.trainer.default_local_dir).expanduser()
    nonce: list = [
        secrets.token_hex(16) if dist.get_rank() == 0 else None,
        f"{directory.resolve()} on {socket.gethostname()}",
    ]
    # The directories the check makes, deepest first: removed again when nothing else went in.
    made = [d for d in (directory, *directory.parents) if not d.exists()] if dist.get_rank() == 0 else []
    if dist.get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / NONCE_FILE).write_text(nonce[0])
        except OSError as err:
            nonce[0] = f"unwritable: {err}"
    dist.broadcast_object_list(nonce, src=0)
    if nonce[0].startswith("unwritable: "):  # every rank says so; gather_problems shows it once
        return (
            f"trainer.default_local_dir={cfg.trainer.default_local_dir}: rank 0 cannot write there "
            f"({nonce[0].removeprefix('unwritable: ')}); fix: a writable directory every node sees"
        )
    try:
        seen = (directory / NONCE_FILE).read_text() == nonce[0]
    except OSError:
        seen = False
    dist.barrier()  # every rank has read before rank 0 removes it
    if dist.get_rank() == 0:
        (directory / NONCE_FILE).unlink()
        for empty in made:
            with contextlib.suppress(OSError):  # not empty: another run (or this one's rank) wrote there
                empty.rmdir()
    if seen:
        return None
    return (
        f"trainer.default_local_dir={cfg.trainer.default_local_dir} is not the directory rank 0 writes checkpoints "
        f"in ({nonce[1]}): the file rank 0 wrote there is missing here; every rank writes its shards of each "
        "checkpoint there and rank 0 publishes them; fix: a directory every node sees at the same absolute path (a "
        "shared mount such as NFS or Lustre); dsrl has no node-local checkpoints"
    )


def preflight(cfg: Config | None, problems: list[str], launch: Launch) -> tuple[Cluster, list[str]]:
    """The cluster and every problem of the run (module doc), the same on every rank; ``problems``: this rank's
    own from validating the configuration (``cfg`` is None when it did not validate). Collective."""
    rollout = cfg.actor_rollout_ref.rollout if cfg is not None else None
    facts = host_facts(launch, rollout.name if rollout is not None else None)
    problem = facts.pop("problem")
    own = list(problems) + ([problem] if problem else [])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {**facts, "configured": cfg is not None})
    if all(facts["configured"] for facts in gathered):  # every rank takes part, or none
        own += [line for line in [_shared_directory_problem(cfg)] if line]
    cluster = Cluster(gathered, launch.launcher)
    tensor_parallel = rollout.tensor_model_parallel_size if rollout is not None and rollout.name == "vllm" else 1
    sp_role, sequence_parallel = "actor_rollout_ref.actor", 1
    if cfg is not None:
        sequence_parallel = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
        if sequence_parallel == 1 and critic_used(cfg):  # one size per process (validation): else the critic's
            sp_role, sequence_parallel = "critic", cfg.critic.ulysses_sequence_parallel_size
    return cluster, gather_problems(own) + cluster_problems(cluster, tensor_parallel, sequence_parallel, sp_role)
