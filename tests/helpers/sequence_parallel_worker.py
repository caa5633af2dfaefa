"""One rank of the sequence-parallel checks in ``test_sequence_parallel.py``: the same actors, references and data
run with ``--sp 1`` and ``--sp 2`` on 2 ranks, which must agree.

    deepspeed --num_gpus 2 --master_port PORT tests/helpers/sequence_parallel_worker.py --out DIR --model DIR \\
        --ds-config JSON --ref-ds-config JSON --sp SIZE

Each rank takes its half of a fixed global batch (with SP=2 the group runs both halves, each rank on its shard
of the packed rows) and, for each case (every ``loss_agg_mode``, with prompt deduplication, the fused head, LoRA),
builds a ZeRO-3 + offload actor from the same seed, scores its rows (log-probs, entropy), updates on them and
scores them again. A reference scores them too, and a critic with the same size gives its values, updates and gives
them again. Writes ``rank<R>.pt``: per case the scores and the metrics, and, on rank 0, the gathered parameters
after the update.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from engines_2ranks_worker import GLOBAL_PROMPTS, N, global_batch  # this folder: the script's own

from dsrl.config import load_config
from dsrl.data.batch import Batch
from dsrl.engines import ActorEngine, CriticEngine, ReferenceEngine, init_distributed, sequence_parallel
from dsrl.engines.weight_sync import iter_full_parameters

T = 12
TEMPERATURE = 0.9
CASES = {
    "token-mean": [],
    "seq-mean-token-sum": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"],
    "seq-mean-token-mean": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    "seq-mean-token-sum-norm": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "dedup+fused": [
        "actor_rollout_ref.actor.use_prefix_grouper=true",
        "actor_rollout_ref.actor.use_fused_kernels=true",
    ],
    "lora": ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"],
    # one optimizer step: the update records the old log-probs and entropy of its own rows (the trainer's fold)
    "on-policy": [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GLOBAL_PROMPTS}",
        "actor_rollout_ref.actor.entropy_coeff=0",
    ],
}


def fixed_global_batch() -> Batch:
    """engines_2ranks_worker's 8 sequences, longer, with advantages and reference log-probs drawn once."""
    batch = global_batch([12, 9, 10, 8, 2, 3, 1, 11], T)
    g = torch.Generator().manual_seed(1)
    mask = batch.response_mask.float()
    return batch.replace(
        advantages=torch.randn(mask.shape, generator=g) * mask,
        ref_log_probs=-3 + 0.5 * torch.randn(mask.shape, generator=g) * mask,
    )


def critic_case(args: argparse.Namespace, common: list[str], batch: Batch, rank: int) -> dict:
    """A critic with the same sequence-parallel size: its values, its update's metrics, its values after, and (rank 0)
    its parameters."""
    critic = CriticEngine(
        load_config(
            None,
            [
                *common,
                "algorithm.adv_estimator=gae",
                f"critic.model.path={args.model}",
                "critic.model.use_remove_padding=true",
                f"critic.ulysses_sequence_parallel_size={args.sp}",
                f"critic.deepspeed_config={args.ds_config}",
                "critic.ppo_max_token_len_per_gpu=20",
                "critic.grad_clip=100.0",
                "critic.cliprange_value=0.001",  # the second mini-batch's values clipped for some tokens, not all
                "critic.optim.lr=0.01",
                "critic.optim.weight_decay=0.0",
            ],
        )
    )
    values = critic.compute_values(batch)
    returns = values + batch.advantages.tanh() * batch.response_mask
    metrics = critic.update(batch.replace(values=values, returns=returns))
    report = {"before": values, "after": critic.compute_values(batch), "metrics": metrics}
    # ALST's attentions built for the critic's backbone: its forwards ran sequence-parallel
    built = [] if sequence_parallel._ACTIVE is None else sequence_parallel._ACTIVE._attention
    report["ulysses_attentions"] = sum(key[1] == id(critic.module.backbone.config) for key in built)
    params = dict(iter_full_parameters(critic.module))
    if rank == 0:
        report["params"] = params
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--out", "--model", "--ds-config", "--ref-ds-config"):
        parser.add_argument(name, required=True)
    parser.add_argument("--sp", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    common = [
        f"actor_rollout_ref.model.path={args.model}",
        "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={args.sp}",
        f"actor_rollout_ref.actor.deepspeed_config={args.ds_config}",
        f"actor_rollout_ref.ref.deepspeed_config={args.ref_ds_config}",
        "data.train_files=unused.parquet",
        f"data.train_batch_size={GLOBAL_PROMPTS}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GLOBAL_PROMPTS // 2}",  # 2 optimizer steps
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",  # several micro-batches, each rank its own count
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.grad_clip=100.0",
        "actor_rollout_ref.actor.optim.lr=0.01",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
    ]
    full = fixed_global_batch()
    batch = full.select(torch.arange(len(full)).chunk(world)[rank])
    report: dict = {}
    for case, extra in CASES.items():
        cfg = load_config(None, [*common, *extra])
        torch.manual_seed(0)  # LoRA's initial adapters
        actor = ActorEngine(cfg)
        before = actor.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
        old = batch.replace(old_log_probs=before["old_log_probs"] + 0.2 * batch.advantages.tanh())
        recorded: dict | None = {} if case == "on-policy" else None
        metrics = actor.update(old, temperature=TEMPERATURE, recorded=recorded)
        after = actor.compute_log_probs(batch, temperature=TEMPERATURE)["old_log_probs"]
        report[case] = {"before": before, "after": after, "metrics": metrics, "recorded": recorded}
        params = dict(iter_full_parameters(actor.module))
        if rank == 0:
            report[case]["params"] = params
    report["ref"] = ReferenceEngine(load_config(None, common)).compute_log_probs(batch, temperature=TEMPERATURE)
    report["critic"] = critic_case(args, common, batch, rank)
    report["ulysses_attentions"] = 0 if sequence_parallel._ACTIVE is None else len(sequence_parallel._ACTIVE._attention)
    torch.save(report, Path(args.out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
