"""``trainer.balance_batch`` and PF-PPO's redraw: rows moved across two real gloo ranks keep every field intact.

Rank 0 holds long responses and rank 1 short ones; after balancing both hold the same number of
rows, the token totals are closer, and every row (its prompt with its left padding, response,
masks, group id, per-token values and row fields) exists exactly once on exactly one rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.algorithms import pf_ppo_indices
from dsrl.data.batch import Batch
from dsrl.trainer.balance import balance_across_ranks, equal_size_partition, pf_ppo_resample

pytestmark = pytest.mark.dist

ROWS = 4


def rank_batch(rank: int) -> Batch:
    """Rank-specific widths: rank 0's prompts are 3 wide, rank 1's 5 wide (left padded); rank 0's
    responses are long (5-8 tokens), rank 1's short (1-2)."""
    P, T = (3, 5)[rank], 8
    prompt_len = [1 + (i % P) for i in range(ROWS)]
    response_len = [5 + i for i in range(ROWS)] if rank == 0 else [1 + i % 2 for i in range(ROWS)]
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in prompt_len])
    response_mask = torch.tensor([[1] * n + [0] * (T - n) for n in response_len])
    uid = torch.arange(ROWS) + 100 * rank
    return Batch(
        prompt_ids=prompt_mask * (uid[:, None] + 1),
        prompt_mask=prompt_mask,
        response_ids=response_mask * (uid[:, None] + 2),
        response_mask=response_mask,
        group_ids=uid,
        data_sources=[f"src{u}" for u in uid.tolist()],
        ground_truths=[str(u) for u in uid.tolist()],
        extra_infos=[{"uid": u} for u in uid.tolist()],
        raw_prompts=[[{"role": "user", "content": f"question {u}"}] for u in uid.tolist()],
        old_log_probs=response_mask * uid[:, None].float() / 10,
        reward_baselines=uid.float(),
    )


def row_record(batch: Batch, i: int) -> tuple:
    """A row without padding: what must survive the move."""
    prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
    keep = batch.response_mask[i].bool()
    return (
        int(batch.group_ids[i]),
        tuple(prompt),
        tuple(batch.response_ids[i][keep].tolist()),
        tuple(batch.old_log_probs[i][keep].tolist()),
        float(batch.reward_baselines[i]),
        batch.data_sources[i],
        batch.ground_truths[i],
        batch.extra_infos[i]["uid"],
        batch.raw_prompts[i][0]["content"],
        int(batch.prompt_mask[i, -1]),  # left padding: the last prompt column is always valid
    )


def worker(rank: int, port: int, out: dict) -> None:
    os.environ.update({"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    batch = rank_batch(rank)
    balanced, metrics = balance_across_ranks(batch)
    scores = torch.zeros(len(batch), 8)
    scores[:, 0] = batch.group_ids.float() % 3  # a score of 0, 1 or 2
    redrawn = pf_ppo_resample(batch.replace(token_level_scores=scores), "pow", 2.0, seed=11)
    out[rank] = {
        "redrawn": [row_record(redrawn, i) for i in range(len(redrawn))],
        "before": [row_record(batch, i) for i in range(len(batch))],
        "after": [row_record(balanced, i) for i in range(len(balanced))],
        "tokens": int(balanced.attention_mask.sum()),
        "metrics": metrics,
    }
    dist.destroy_process_group()


def test_rows_move_intact_and_tokens_even_out(free_port):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(free_port(), out), nprocs=2)
        out = dict(out)
    before = out[0]["before"] + out[1]["before"]
    after = out[0]["after"] + out[1]["after"]
    assert sorted(after) == sorted(before)  # every row once, every field intact
    assert [len(out[r]["after"]) for r in (0, 1)] == [ROWS, ROWS]
    m = out[0]["metrics"]
    assert m == out[1]["metrics"]
    assert m["global_seqlen/max"] - m["global_seqlen/min"] == m["global_seqlen/minmax_diff"] > 0
    assert sorted([out[0]["tokens"], out[1]["tokens"]]) == [
        m["global_seqlen/balanced_min"],
        m["global_seqlen/balanced_max"],
    ]
    assert m["global_seqlen/balanced_max"] - m["global_seqlen/balanced_min"] < m["global_seqlen/minmax_diff"]


def test_pf_ppo_redraws_the_global_batch_and_each_rank_takes_its_share(free_port):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(free_port(), out), nprocs=2)
        out = dict(out)
    before = out[0]["before"] + out[1]["before"]  # the global batch, rank 0's rows first
    scores = torch.tensor([row[0] % 3 for row in before], dtype=torch.float32)
    rows = pf_ppo_indices(scores, "pow", 2.0, torch.Generator().manual_seed(11)).tolist()
    assert out[0]["redrawn"] + out[1]["redrawn"] == [before[i] for i in rows]  # intact, in the draw's order
    assert all(before[i][0] % 3 for i in rows)  # a score of 0 weighs 1e-8


def test_equal_size_partition_evens_the_sums():
    costs = [3, 8, 5, 7, 6, 4]
    parts = equal_size_partition(costs, 2)
    assert sorted(len(p) for p in parts) == [3, 3]
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert sorted(sum(costs[i] for i in p) for p in parts) == [16, 17]  # 33 cannot split more evenly
    with pytest.raises(ValueError, match="equal parts"):
        equal_size_partition([1, 2, 3], 2)
