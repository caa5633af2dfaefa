"""Which settings size the micro-batches of each no-grad pass: the actor's old log-probs
(``rollout.log_prob_*``), the reference's (``ref.log_prob_*``) and the critic's values (``critic.forward_*``)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from dsrl.config import load_config
from dsrl.engines import actor as actor_module
from dsrl.engines import critic as critic_module
from dsrl.engines import reference as reference_module
from dsrl.engines.actor import ActorEngine
from dsrl.engines.critic import CriticEngine
from dsrl.engines.forward import PassTally
from dsrl.engines.reference import ReferenceEngine

BUDGETS = [
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=3000",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4000",
    "critic.ppo_max_token_len_per_gpu=2000",
    "critic.forward_max_token_len_per_gpu=5000",
    "critic.forward_micro_batch_size_per_gpu=7",
]


def engine_of(cfg):
    return SimpleNamespace(
        cfg=cfg,
        engine=SimpleNamespace(eval=lambda: None),
        prefix="actor_rollout_ref.actor",
        packing=None,
        fused_head=None,
        sp=None,
        replay=None,
        tallies=defaultdict(PassTally),
        name="ref",
    )


def test_each_no_grad_pass_reads_its_own_budget(monkeypatch):
    cfg = load_config(None, ["data.train_files=unused.parquet", *BUDGETS])
    passes = []

    def stats(engine, batch, *, max_token_len, budget_key, **kw):
        passes.append((max_token_len, budget_key))
        return {"old_log_probs": None}

    for module in (actor_module, reference_module):
        monkeypatch.setattr(module, "compute_response_stats", stats)
    ActorEngine.compute_log_probs(engine_of(cfg), None, temperature=1.0)
    ReferenceEngine.compute_log_probs(engine_of(cfg), None, temperature=1.0)
    assert passes == [
        (3000, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        (4000, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    ]

    splits = []
    monkeypatch.setattr(critic_module, "micro_batch_indices", lambda batch, **kw: splits.append(kw) or [])
    critic = engine_of(cfg)
    CriticEngine._split(critic, None)  # the update's
    CriticEngine._split(critic, None, "forward_")
    assert splits == [
        {"micro_batch_size": 4, "max_token_len": 2000, "key": "critic.ppo_max_token_len_per_gpu", "packing": None},
        {"micro_batch_size": 7, "max_token_len": 5000, "key": "critic.forward_max_token_len_per_gpu", "packing": None},
    ]
    ActorEngine.compute_log_probs(
        engine_of(load_config(None, ["data.train_files=unused.parquet"])), None, temperature=1.0
    )
    assert passes[-1][0] is None  # no token budget: micro-batches by count
