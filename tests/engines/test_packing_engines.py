"""``use_remove_padding`` on the real engines (ZeRO-3 with CPU offload, one rank, float32): packed micro-batches give
the padded ones' log-probs, entropy and values, and the same update, whatever the micro-batches; so do packed rows
holding each prompt once (``use_prefix_grouper``)."""

from __future__ import annotations

import pytest
import torch

from dsrl.engines import ActorEngine, CriticEngine, ReferenceEngine
from tests.helpers.engines import (
    ACTOR_TRAINING,
    CRITIC_TRAINING,
    TEMPERATURE,
    assert_same_metrics,
    assert_same_params,
    context_batch,
    full_params,
    in_context,
    training_batch,
)

pytestmark = pytest.mark.e2e

PACKED = "actor_rollout_ref.model.use_remove_padding=true"
DEDUP = (PACKED, "actor_rollout_ref.actor.use_prefix_grouper=true")


@pytest.fixture(scope="module")
def z3(ds_test_config):
    return ds_test_config("zero3_offload", optimizer={"eps": 1.0})


@pytest.fixture
def packs(monkeypatch):
    """The micro-batches packed so far (so a test sees that the key is read, not only that results agree)."""
    import dsrl.engines.critic
    import dsrl.engines.forward
    import dsrl.engines.packing

    packed = []

    def counted(micro, *args, **kwargs):
        packed.append(len(micro))
        return dsrl.engines.packing.pack.__wrapped__(micro, *args, **kwargs)

    counted.__wrapped__ = dsrl.engines.packing.pack
    monkeypatch.setattr(dsrl.engines.packing, "pack", counted)
    monkeypatch.setattr(dsrl.engines.critic, "pack", counted)
    monkeypatch.setattr(dsrl.engines.forward, "pack", counted)
    return packed


def test_a_packed_actor_and_reference_score_and_update_as_padded_ones(
    world_of_one, make_cfg, z3, ds_test_config, packs
):
    common = (*ACTOR_TRAINING, f"actor_rollout_ref.actor.deepspeed_config={z3}")
    padded = ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"))
    # By token budget, which now counts each part's own tokens: other micro-batches than the padded actor's
    actors = {
        "packed": ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.use_dynamic_bsz=true", PACKED)),
        "dedup": ActorEngine(make_cfg(*common, "actor_rollout_ref.actor.use_dynamic_bsz=true", *DEDUP)),
    }
    batch = in_context(training_batch(padded))
    assert packs == []  # the padded actor's pass, and the packed actors' construction, pack nothing
    mask = batch.response_mask.bool()
    expected = padded.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
    for actor in actors.values():
        scored = actor.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
        for key in ("old_log_probs", "entropy"):
            torch.testing.assert_close(scored[key][mask], expected[key][mask], atol=1e-5, rtol=1e-5)
    assert sum(packs) == 2 * len(batch)  # every row of each packed actor's pass, once
    tally = actors["dedup"].tallies["old_log_prob"]
    assert tally.tokens < actors["packed"].tallies["old_log_prob"].tokens == tally.sequence_tokens
    ref = ds_test_config("zero3_offload_inference")
    references = {
        name: ReferenceEngine(make_cfg(f"actor_rollout_ref.ref.deepspeed_config={ref}", *extra)).compute_log_probs(
            batch, temperature=TEMPERATURE
        )
        for name, extra in (("padded", ()), ("packed", (PACKED,)), ("dedup", DEDUP))
    }
    for name in ("packed", "dedup"):
        torch.testing.assert_close(references[name][mask], references["padded"][mask], atol=1e-5, rtol=1e-5)
    expected_metrics = padded.update(batch, temperature=TEMPERATURE)
    for actor in actors.values():
        metrics = actor.update(batch, temperature=TEMPERATURE)
        assert_same_params(full_params(actor.module), full_params(padded.module))
        assert_same_metrics(metrics, expected_metrics)


def test_a_packed_critic_values_and_updates_as_a_padded_one(world_of_one, make_cfg, z3, packs):
    common = (*CRITIC_TRAINING, f"critic.deepspeed_config={z3}")
    padded = CriticEngine(make_cfg(*common, "critic.ppo_micro_batch_size_per_gpu=1"))
    packed = CriticEngine(make_cfg(*common, "critic.use_dynamic_bsz=true", "critic.model.use_remove_padding=true"))
    batch = context_batch()
    values = padded.compute_values(batch)
    assert packs == []
    torch.testing.assert_close(packed.compute_values(batch), values, atol=1e-5, rtol=1e-5)
    assert sum(packs) == len(batch)
    g = torch.Generator().manual_seed(2)
    batch = batch.replace(values=values, returns=values + torch.randn(values.shape, generator=g) * batch.response_mask)
    metrics = {name: critic.update(batch) for name, critic in (("padded", padded), ("packed", packed))}
    assert_same_params(full_params(packed.module), full_params(padded.module))
    assert_same_metrics(metrics["packed"], metrics["padded"])
