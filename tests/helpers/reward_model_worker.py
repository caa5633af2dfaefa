"""One rank of the reward-model checks in ``tests/engines/test_reward_model_engine.py`` (also runs as a world of one).

    deepspeed --num_gpus 2 --master_port PORT tests/helpers/reward_model_worker.py --out DIR --model DIR \\
        --ds-config JSON [--dynamic]

Each rank scores its own token sequences, a different number of them (rank 0 seven, rank 1 two), so the ranks need
different numbers of micro-batches: without agreeing on a count, ZeRO-3's collective forwards would hang. Writes
``rank<R>.json``: the sequences and the engine's scores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist

from dsrl.config import load_config
from dsrl.engines import RewardModelEngine, init_distributed


def sequences(rank: int) -> list[list[int]]:
    """Token sequences of 1 to 40 tokens of the tiny vocabulary, another set per rank."""
    draw = random.Random(rank)
    return [[draw.randrange(3, 99) for _ in range(draw.randrange(1, 41))] for _ in range(7 if rank == 0 else 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--dynamic", action="store_true", help="micro-batches by a token budget of 60")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank
    init_distributed()
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={args.model}",
            "actor_rollout_ref.model.dtype=float32",
            "data.train_files=unused.parquet",
            "reward_model.enable=true",
            f"reward_model.model.path={args.model}",
            f"reward_model.deepspeed_config={args.ds_config}",
            "reward_model.micro_batch_size_per_gpu=2",
            f"reward_model.use_dynamic_bsz={args.dynamic}",
            "reward_model.forward_max_token_len_per_gpu=60",
        ],
    )
    rank = dist.get_rank()
    rows = sequences(rank)
    scores = RewardModelEngine(cfg).score(rows).tolist()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"sequences": rows, "scores": scores}))
    dist.barrier()


if __name__ == "__main__":
    main()
