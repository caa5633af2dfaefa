"""One rank of the engine checks in ``test_engines_2ranks.py`` (also runs alone as a world of one).

    deepspeed --num_gpus 2 --master_port PORT tests/helpers/engines_2ranks_worker.py --out DIR --model DIR \\
        --ds-config JSON [--lora-rank R] [--fused-head-chunk POSITIONS]

Each rank: builds a ZeRO-3 + offload actor and a transformers rollout copy; pushes the weights and
samples its own prompts (rank-local generation) and checks the actor scores them as the rollout
did; trains on its shard of a fixed global batch with token-budget micro-batches (alone, rank 0
would need 4 and rank 1 only 2: without agreeing on a count, ZeRO-3's collective forwards would
hang); pushes again and re-checks the agreement. Writes
``rank<R>.json`` (metrics, agreements, timings) and, on rank 0, ``params_world<W>.pt`` (the gathered
parameters after the update) to compare a 2-rank run with a 1-rank run on the whole batch. With
``--lora-rank`` the actor trains LoRA adapters and pushes its merged weights to the rollout copy. With
``--fused-head-chunk`` it computes log-probs with the fused head (``use_fused_kernels``) that many positions at a
time, so that the ranks' micro-batches need different numbers of chunks (each gathers the ZeRO-3 output layer).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from transformers import AutoConfig

from dsrl.config import load_config
from dsrl.data.batch import Batch
from dsrl.engines import ActorEngine, forward, init_distributed
from dsrl.engines.weight_sync import iter_full_parameters
from dsrl.rollout import HFRollout, SamplingParams

GLOBAL_PROMPTS, N, P, T = 4, 2, 6, 10  # the fixed global batch: 8 sequences
TEMPERATURE = 0.9


def fixed_global_batch() -> Batch:
    """8 sequences, the first 4 long and the last 4 short, so rank 0's shard needs more
    token-budget micro-batches than rank 1's."""
    return global_batch([10, 9, 10, 8, 2, 3, 1, 4], T)


def global_batch(response_len: list[int], width: int) -> Batch:
    """GLOBAL_PROMPTS prompts of 6, 5, 3 and 2 tokens (left-padded to P) x N responses of ``response_len`` tokens,
    right-padded to ``width``; random ids from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    rows = torch.arange(GLOBAL_PROMPTS).repeat_interleave(N)
    prompt_len = torch.tensor([6, 5, 3, 2])[rows]
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    response_mask = (torch.arange(width) < torch.tensor(response_len)[:, None]).long()
    return Batch(
        prompt_ids=torch.randint(3, 100, (GLOBAL_PROMPTS, P), generator=g)[rows] * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, 100, (len(rows), width), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=rows,
    )


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


class RouteCounts:
    """Tokens each expert of each mixture-of-experts layer was chosen for (transformers 5 routers: modules with
    ``top_k`` and ``num_experts`` returning the chosen experts last), from forward hooks; empty for a dense model."""

    def __init__(self, model: torch.nn.Module):
        self.counts: dict[str, list[int]] = {}
        self.hooks = [
            module.register_forward_hook(self._count(name, module.num_experts))
            for name, module in model.named_modules()
            if hasattr(module, "top_k") and hasattr(module, "num_experts")
        ]

    def _count(self, name: str, experts: int):
        def hook(module, inputs, output):
            counts = torch.bincount(output[-1].reshape(-1), minlength=experts).tolist()
            self.counts[name] = [a + b for a, b in zip(self.counts.get(name, [0] * experts), counts, strict=True)]

        return hook

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--fused-head-chunk", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={args.model}",
            "actor_rollout_ref.model.dtype=float32",
            f"actor_rollout_ref.actor.deepspeed_config={args.ds_config}",
            "data.train_files=unused.parquet",
            f"data.train_batch_size={GLOBAL_PROMPTS}",
            f"actor_rollout_ref.rollout.n={N}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={GLOBAL_PROMPTS}",
            "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=17",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.grad_clip=100.0",
            "actor_rollout_ref.actor.optim.lr=0.01",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            f"actor_rollout_ref.model.lora_rank={args.lora_rank}",
            "actor_rollout_ref.model.lora.merge=true",
            f"actor_rollout_ref.actor.use_fused_kernels={bool(args.fused_head_chunk)}",
        ],
    )
    if args.fused_head_chunk:
        forward.CHUNK_ELEMENTS = args.fused_head_chunk * AutoConfig.from_pretrained(args.model).vocab_size
    # Each rank draws its own initial adapters (the trainer seeds per rank): DeepSpeed must start all from rank 0's.
    torch.manual_seed(rank)
    actor = ActorEngine(cfg)
    rollout = HFRollout(args.model, dtype="float32")
    timings: dict[str, float] = {}
    _, timings["sync_s"] = timed(lambda: rollout.update_weights(actor.rollout_weights()))

    # Rank-local generation on this rank's own prompts, scored by the actor.
    g = torch.Generator().manual_seed(100 + rank)
    prompt_ids = torch.randint(3, 100, (3, P), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, : rank + 2] = 0
    prompt_ids = prompt_ids * prompt_mask
    sampling = SamplingParams(n=N, temperature=TEMPERATURE, max_tokens=T, seed=rank)
    rows = torch.arange(3).repeat_interleave(N)

    def generate() -> Batch:
        out = rollout.generate(prompt_ids, prompt_mask, sampling)
        return Batch(
            prompt_ids=prompt_ids[rows],
            prompt_mask=prompt_mask[rows],
            response_ids=out.response_ids,
            response_mask=out.response_mask,
            group_ids=rows,
            rollout_log_probs=out.log_probs,
        )

    sampled = generate()
    routes = RouteCounts(actor.module)  # a mixture-of-experts model's choices in the scoring forward
    scored, timings["compute_log_probs_s"] = timed(
        lambda: actor.compute_log_probs(sampled, temperature=TEMPERATURE, with_entropy=True)
    )
    routes.remove()
    diff_before = max_diff(scored["old_log_probs"], sampled.rollout_log_probs, sampled.response_mask)

    # Train on this rank's shard of the fixed global batch.
    full = fixed_global_batch()
    g = torch.Generator().manual_seed(1)
    mask = full.response_mask.float()
    # Old log-probs from the world-size-independent forward of the whole batch, then perturbed.
    old = actor.compute_log_probs(full, temperature=TEMPERATURE)["old_log_probs"]
    full = full.replace(
        old_log_probs=old + 0.3 * torch.randn(old.shape, generator=g) * mask,
        ref_log_probs=old + 0.5 * torch.randn(old.shape, generator=g) * mask,
        advantages=torch.randn(old.shape, generator=g) * mask,
    )
    shard = full.select(torch.arange(len(full)).chunk(world)[rank])
    metrics, timings["update_s"] = timed(lambda: actor.update(shard, temperature=TEMPERATURE))
    params = dict(iter_full_parameters(actor.module))
    if rank == 0:
        torch.save(params, Path(args.out) / f"params_world{world}.pt")

    _, timings["sync_after_update_s"] = timed(lambda: rollout.update_weights(actor.rollout_weights()))
    resampled = generate()
    rescored = actor.compute_log_probs(resampled, temperature=TEMPERATURE)["old_log_probs"]
    report = {
        "rank": rank,
        "world": world,
        "metrics": metrics,
        "logprob_diff_before_update": diff_before,
        "logprob_diff_after_update": max_diff(rescored, resampled.rollout_log_probs, resampled.response_mask),
        "actor_change_on_first_samples": max_diff(
            actor.compute_log_probs(sampled, temperature=TEMPERATURE)["old_log_probs"],
            scored["old_log_probs"],
            sampled.response_mask,
        ),
        "param_sum": sum(p.double().abs().sum().item() for p in params.values()),
        "expert_counts": routes.counts,
        "timings": timings,
    }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
