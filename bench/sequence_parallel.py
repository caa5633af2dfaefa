"""Per-rank peak memory and time of the actor's update with Ulysses sequence parallelism, on 2 CPU ranks.

    python bench/sequence_parallel.py MODEL_DIR [--prompt 64] [--response 4096] [--json PATH]

Runs itself under the deepspeed launcher on 2 ranks, with ``actor_rollout_ref.actor.ulysses_sequence_parallel_size``
1, then 2. Each rank holds one sequence of ``--prompt`` + ``--response`` tokens (random ids, advantages and old
log-probs); float32, ZeRO-3 with CPU offload (``ds_configs/zero3_offload``), packed rows, no gradient checkpointing,
one micro-batch per sequence. Each rank measures ``ActorEngine.update`` (forward, backward and optimizer step; with
SP 2 the group runs both ranks' sequences in turn, each rank on half of each): its wall time and its peak resident
set beyond the resident set before the call (``VmHWM`` reset through ``/proc/self/clear_refs``, as
``bench/logits_head.py`` measures; glibc's mmap threshold is fixed, see ``main``). The table gives each rank's
numbers and the ratio of SP 2 to SP 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace, sp: int) -> list[str]:
    length = args.prompt + args.response
    return [
        f"actor_rollout_ref.model.path={args.model}",
        "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
        "actor_rollout_ref.actor.deepspeed_config=zero3_offload",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.name=hf",
        "algorithm.adv_estimator=grpo",
        "data.train_files=unused.parquet",
        f"data.max_prompt_length={args.prompt}",
        f"data.max_response_length={args.response}",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={length}",
    ]


# The update_actor terms that come and go within an update (the rest is held before it starts).
TRANSIENT = ("activations", "sequence-parallel mask", "log-prob head", "actor gathered parameters",
             "actor reduce bucket", "actor fp32 gradient copy")  # fmt: skip


def planned_gib(args: argparse.Namespace, sp: int) -> float:
    """What the memory plan (``dsrl-train --plan``) holds for one rank beyond the update's start, in GiB."""
    sys.path.insert(0, str(REPO))
    from dsrl.config import load_config
    from dsrl.plan.inputs import Device, inputs_from_config
    from dsrl.plan.plan import plan_memory
    from dsrl.plan.shape import read_shape

    cfg = load_config(None, overrides(args, sp))
    device = Device("cpu", 2**40, "unbounded")
    plan = plan_memory(inputs_from_config(cfg, 2, read_shape(args.model), device), device)
    [phase] = [phase for phase in plan.phases if phase.name == "update_actor"]
    return sum(term.device for term in phase.terms if term.name.startswith(TRANSIENT)) / 2**30


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    from logits_head import PeakMemory

    from dsrl.config import load_config
    from dsrl.data.batch import Batch
    from dsrl.engines import ActorEngine, init_distributed

    torch.set_num_threads(1)
    init_distributed()
    rank = dist.get_rank()
    cfg = load_config(None, overrides(args, args.sp))
    actor = ActorEngine(cfg)
    g = torch.Generator().manual_seed(rank)

    def sequence(response: int) -> Batch:
        return Batch(
            prompt_ids=torch.randint(3, 100, (1, args.prompt), generator=g),
            prompt_mask=torch.ones(1, args.prompt, dtype=torch.long),
            response_ids=torch.randint(3, 100, (1, response), generator=g),
            response_mask=torch.ones(1, response, dtype=torch.long),
            group_ids=torch.tensor([rank]),
            advantages=torch.randn(1, response, generator=g),
            old_log_probs=-4.6 + 0.1 * torch.randn(1, response, generator=g),
        )

    # A short update first: the states the first optimizer step creates (Adam's moments, the gradient partitions)
    # are then there before the measured one, as in every step of a run but the first (and as the plan has them).
    actor.update(sequence(64), temperature=1.0)
    batch = sequence(args.response)
    with PeakMemory(torch.device("cpu")) as memory:
        start = time.perf_counter()
        actor.update(batch, temperature=1.0)
        seconds = time.perf_counter() - start
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"peak_gib": memory.peak / 2**30, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory (scripts/make_tiny_model.py --wide)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=4096)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--sp", type=int, help=argparse.SUPPRESS)  # the worker's
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()
    if args.sp is not None:
        worker(args)
        return
    # A fixed mmap threshold: else glibc raises it as large tensors are freed, keeps the next micro-batch's
    # activations on its heap and counts the first's in the resident set still (SP 2 runs two per rank).
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    for sp in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", __file__, args.model]
            command += ["--prompt", str(args.prompt), "--response", str(args.response), "--sp", str(sp), "--out", out]
            subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True)
            results[sp] = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in (0, 1)]
    print(f"update_actor, one {args.prompt} + {args.response}-token sequence per rank, 2 CPU ranks:")
    for sp, ranks in results.items():
        cells = ", ".join(f"rank {r}: {m['peak_gib']:.2f} GiB in {m['seconds']:.1f} s" for r, m in enumerate(ranks))
        planned = planned_gib(args, sp)
        measured = max(m["peak_gib"] for m in ranks)
        print(f"  SP {sp}: {cells}; planned {planned:.2f} GiB ({planned / measured - 1:+.0%} of the larger)")
        for rank in ranks:
            rank["planned_gib"] = planned
    ratios = [two["peak_gib"] / one["peak_gib"] for one, two in zip(results[1], results[2], strict=True)]
    print("  peak SP 2 / SP 1: " + ", ".join(f"rank {r}: {ratio:.0%}" for r, ratio in enumerate(ratios)))
    if args.json:
        args.json.write_text(json.dumps({"prompt": args.prompt, "response": args.response, "results": results}) + "\n")


if __name__ == "__main__":
    main()
