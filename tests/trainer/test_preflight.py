"""The preflight's checks over the cluster (``dsrl.trainer.preflight.cluster_problems``) on the facts ranks exchange;
the collective part (the nonce in trainer.default_local_dir, the exchange itself) runs in
tests/runtime/test_multinode.py."""

from __future__ import annotations

from dsrl.trainer.preflight import VERSIONED, Cluster, cluster_problems

VERSIONS = {name: "1.0" for name in VERSIONED}


def rank(host, node, local_rank, device_id=None):
    return {
        "host": host,
        "node": node,
        "local_rank": local_rank,
        "device": "cuda" if device_id else "cpu",
        "device_id": device_id,
        "versions": dict(VERSIONS),
        "rollout": "vllm",
    }


def two_by_four(**changes_of_rank_5):
    """Two nodes of four GPUs; rank 5's facts changed (a package's version, or another fact)."""
    facts = [rank("gpu-a" if r < 4 else "gpu-b", r // 4, r % 4, f"GPU-{r}") for r in range(8)]
    for key, value in changes_of_rank_5.items():
        if key in VERSIONED:
            facts[5]["versions"][key] = value
        else:
            facts[5][key] = value
    return Cluster(facts, "slurm")


def test_a_sound_cluster_has_no_problem_and_is_described_by_host():
    cluster = two_by_four()
    assert cluster_problems(cluster, tensor_parallel=4) == []
    assert cluster.describe() == "8 rank(s) on 2 node(s): gpu-a ranks 0-3, gpu-b ranks 4-7"
    # Two launcher nodes on one host (the simulated nodes of the tests) are told apart by their index.
    shared = Cluster([rank("vm", 0, 0), rank("vm", 1, 0)], "deepspeed")
    assert shared.describe() == "2 rank(s) on 2 node(s): vm (node 0) rank 0, vm (node 1) rank 1"


def test_uneven_nodes_and_tensor_parallel_groups_across_nodes_are_refused():
    uneven = Cluster([rank("a", "a", 0), rank("a", "a", 1), rank("a", "a", 2), rank("b", "b", 0)], "openmpi")
    [line] = cluster_problems(uneven, tensor_parallel=1)
    assert line.startswith("the nodes run different numbers of ranks (a 3, b 1);") and "same slots=" in line
    [line] = cluster_problems(two_by_four(), tensor_parallel=8)
    assert line.startswith(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=8: the vLLM group of ranks 0-7 spans "
        "nodes (gpu-a, gpu-b); fix: a tensor-parallel size that divides the ranks per node"
    )
    assert cluster_problems(two_by_four(), tensor_parallel=2) == []
    [line] = cluster_problems(two_by_four(), tensor_parallel=1, sequence_parallel=16)
    assert line.startswith("actor_rollout_ref.actor.ulysses_sequence_parallel_size=16: the sequence group of ranks 0-7")
    assert cluster_problems(two_by_four(), tensor_parallel=1, sequence_parallel=4) == []
    [line] = cluster_problems(two_by_four(), tensor_parallel=1, sequence_parallel=16, sequence_parallel_role="critic")
    assert line.startswith("critic.ulysses_sequence_parallel_size=16: the sequence group of ranks 0-7")


def test_two_ranks_on_one_device_or_local_rank_are_refused():
    [line] = cluster_problems(two_by_four(device_id="GPU-4"), tensor_parallel=1)
    assert line.startswith("2 ranks on gpu-b share one device (GPU-4)")
    [line] = cluster_problems(two_by_four(local_rank=0, device_id="GPU-5"), tensor_parallel=1)
    assert line.startswith("2 ranks on gpu-b have local rank 0: two ranks would take one device")


def test_versions_and_rollout_engines_that_differ_are_named_with_their_ranks_and_hosts():
    lines = cluster_problems(two_by_four(torch="2.12.0", rollout="hf"), tensor_parallel=1)
    assert lines == [
        "torch differs across ranks: 1.0 on ranks 0-4, 6-7 (gpu-a, gpu-b); 2.12.0 on rank 5 (gpu-b); fix: the same "
        "environment on every node (one image, or one venv on a shared mount)",
        "the rollout engine (actor_rollout_ref.rollout.name) differs across ranks: vllm on ranks 0-4, 6-7 (gpu-a, "
        "gpu-b); hf on rank 5 (gpu-b); fix: the same environment on every node (one image, or one venv on a shared "
        "mount)",
    ]
    # A rank whose config did not validate has no rollout engine: its own problems say why.
    assert cluster_problems(two_by_four(rollout=None), tensor_parallel=1) == []
