"""``use_fused_kernels`` on the real engines (ZeRO-3 with CPU offload, one rank, float32; the output layer a
partitioned parameter, tied to the embeddings): the fused head scores (log-probs, entropy, sum_pi_squared) and
updates as the full logits do, padded and packed with one copy of each prompt, for the reference, and for a LoRA
actor and its adapters-off reference."""

from __future__ import annotations

import pytest
import torch

from dsrl.engines import ActorEngine, AdapterOffReference, ReferenceEngine
from tests.helpers.engines import (
    ACTOR_TRAINING,
    TEMPERATURE,
    assert_same_metrics,
    assert_same_params,
    full_params,
    in_context,
    training_batch,
)

pytestmark = pytest.mark.e2e

FUSED = "actor_rollout_ref.actor.use_fused_kernels=true"
DEDUP = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_prefix_grouper=true")
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")


@pytest.fixture
def heads(monkeypatch):
    """How many fused-head calls ran (so a test sees the key is read, not only that results agree)."""
    import dsrl.engines.forward

    calls = []
    real = dsrl.engines.forward.head_stats

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dsrl.engines.forward, "head_stats", counted)
    return calls


def scores_and_update(actor: ActorEngine, batch):
    stats = actor.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True, with_sum_pi_squared=True)
    return stats, actor.update(batch, temperature=TEMPERATURE), full_params(actor.module)


def assert_same_scores(a: dict, b: dict, mask: torch.Tensor) -> None:
    assert a.keys() == b.keys() == {"old_log_probs", "entropy", "sum_pi_squared"}
    for key in a:
        torch.testing.assert_close(a[key][mask], b[key][mask], atol=1e-5, rtol=1e-5)


def test_the_fused_head_scores_and_updates_as_the_full_logits(world_of_one, make_cfg, ds_test_config, heads):
    z3 = ds_test_config("zero3_offload", optimizer={"eps": 1.0})
    common = (*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={z3}")
    full = ActorEngine(make_cfg(*common))
    fused = {"padded": ActorEngine(make_cfg(*common, FUSED)), "dedup": ActorEngine(make_cfg(*common, FUSED, *DEDUP))}
    batch = in_context(training_batch(full))
    mask = batch.response_mask.bool()
    expected_scores, expected_metrics, expected_params = scores_and_update(full, batch)
    assert heads == []
    for actor in fused.values():
        scores, metrics, params = scores_and_update(actor, batch)
        assert_same_scores(scores, expected_scores, mask)
        assert_same_metrics(metrics, expected_metrics)
        assert_same_params(params, expected_params)
    assert len(heads) > 0
    ref = ds_test_config("zero3_offload_inference")
    references = [
        ReferenceEngine(make_cfg(f"actor_rollout_ref.ref.deepspeed_config={ref}", *extra)).compute_log_probs(
            batch, temperature=TEMPERATURE
        )
        for extra in ((), (FUSED,))
    ]
    torch.testing.assert_close(references[1][mask], references[0][mask], atol=1e-5, rtol=1e-5)


def test_a_lora_actor_and_its_reference_with_the_fused_head(world_of_one, make_cfg, ds_test_config, heads):
    z3 = ds_test_config("zero3_offload", optimizer={"eps": 1.0})
    actors = []
    for extra in ((), (FUSED,)):
        torch.manual_seed(0)  # the adapters' initial A
        actors.append(
            ActorEngine(make_cfg(*LORA, *ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={z3}", *extra))
        )
    batch = training_batch(actors[0])
    mask = batch.response_mask.bool()
    (full_scores, full_metrics, full_params_), (scores, metrics, params) = (scores_and_update(a, batch) for a in actors)
    assert_same_scores(scores, full_scores, mask)
    assert_same_metrics(metrics, full_metrics)
    assert_same_params(params, full_params_)
    calls = len(heads)
    references = [
        AdapterOffReference(actor.cfg, actor).compute_log_probs(batch, temperature=TEMPERATURE) for actor in actors
    ]
    torch.testing.assert_close(references[1][mask], references[0][mask], atol=1e-5, rtol=1e-5)
    assert len(heads) > calls > 0
