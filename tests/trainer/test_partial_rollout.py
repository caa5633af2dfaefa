"""Partial rollout inside colocation (``trainer.v1.trainer_mode: colocate_async``, ``dsrl.trainer.partial_rollout``)
on the tiny model: the pool carries unfinished responses into the next step, each token tagged with the version that
sampled it and with its log-prob under that version; the staleness bound drops or waits; the trainer runs it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.data.datasets import PromptRecord
from dsrl.rollout import HFRollout, SamplingParams
from dsrl.trainer.partial_rollout import OFF_POLICY, InFlight
from tests.helpers.trainer import FILTERING, PARITY_REWARD, run_config

pytestmark = pytest.mark.e2e

PROMPTS = [tuple(range(3 + i, 9 + 2 * i)) for i in range(16)]
RECORDS = [PromptRecord(p, "x", "0", {}) for p in PROMPTS]


class Draws:
    """The sampler's part: whole batches of 4 record rows, in order."""

    def __init__(self):
        self.taken = 0

    def __call__(self) -> list[int]:
        self.taken += 4
        return list(range(self.taken - 4, self.taken))


def step(pool: InFlight, rollout: HFRollout, version: int, draws: Draws, chunk_tokens=3, seed=0):
    refill = pool.refill(version, draws)
    chunks = pool.generate(
        rollout,
        lambda rows: [PROMPTS[r] for r in rows],
        SamplingParams(max_tokens=12, seed=seed + version),
        version=version,
        chunk_tokens=chunk_tokens,
    )
    return refill, chunks


def take(pool: InFlight, version: int):
    def build(groups):
        return pool.batch_of(
            groups, lambda rows: [RECORDS[r] for r in rows], prompt_pad=0, response_pad=0, max_tokens=12
        )

    return pool.take_batch(build, version)


def response_log_probs(model, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_carried_response_keeps_each_tokens_version_and_the_log_prob_that_version_gave_it(
    world_of_one, tiny_model_dir
):
    """2 of 4 groups a step (the untrained model's responses all reach the cap, in the same chunk). Version 0 trains
    2 and leaves 2 complete; version 1 trains those at once (one chunk: staleness 1) and leaves its new groups after
    one chunk; the weights change and version 2 goes on with them: each token's recorded log-prob is its sampling
    version's, and the oldest complete groups train first, spanning 2 versions."""
    rollout = HFRollout(str(tiny_model_dir), dtype="float32")
    weights_1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pool, draws = InFlight(batch_size=2, pool_size=4, n=2, threshold=None, strategy="drop"), Draws()
    refill, _ = step(pool, rollout, 0, draws)
    assert refill[f"{OFF_POLICY}/groups_admitted"] == 4 and all(g.complete for g in pool.groups)
    batch, metrics = take(pool, 0)
    assert len(batch) == 4 and metrics[f"{OFF_POLICY}/trajectory_spans/max"] == 1 and len(pool.groups) == 2
    refill, chunks = step(pool, rollout, 1, draws)
    assert refill[f"{OFF_POLICY}/groups_carried"] == 2 and refill[f"{OFF_POLICY}/groups_admitted"] == 2
    assert chunks == 1
    batch, metrics = take(pool, 1)
    assert metrics[f"{OFF_POLICY}/trajectory_staleness/max"] == 1 and set(batch.group_ids.tolist()) == {2, 3}
    assert all(len(r.tokens) == 3 and not r.finished for g in pool.groups for r in g.responses)
    with torch.no_grad():
        for p in rollout.model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    weights_2 = rollout.model
    step(pool, rollout, 2, draws)
    spanning = 0
    for group in pool.groups:
        prompt = PROMPTS[group.record]
        for r in group.responses:
            versions = torch.tensor(r.versions)
            assert len(r.tokens) == len(r.log_probs) == len(versions) and (versions.diff() >= 0).all()
            expected = torch.where(
                versions == 1,
                response_log_probs(weights_1, prompt, r.tokens),
                response_log_probs(weights_2, prompt, r.tokens),
            )
            torch.testing.assert_close(torch.tensor(r.log_probs), expected, atol=1e-5, rtol=1e-5)
            spanning += bool((versions == 1).any() and (versions == 2).any())
    assert spanning == 4  # both carried groups
    batch, metrics = take(pool, 2)
    assert set(batch.group_ids.tolist()) == {4, 5}  # the carried ones, complete first
    assert metrics[f"{OFF_POLICY}/trajectory_spans/max"] == 2 == metrics[f"{OFF_POLICY}/trajectory_spans/min"]
    mask = batch.response_mask.bool()
    assert (batch.rollout_log_probs[~mask] == 0).all() and (batch.rollout_log_probs[mask] < 0).all()


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_the_staleness_bound_drops_or_waits_for_the_groups_at_it(strategy, world_of_one, tiny_model_dir):
    """threshold 2, 2 of 6 groups a step. At version 2, the 2 groups admitted at 0 and not trained yet would span 3
    versions: drop evicts and replaces them; wait does not stop until the groups admitted at 1 are complete (at the
    threshold), although complete groups were enough after one chunk."""
    rollout = HFRollout(str(tiny_model_dir), dtype="float32")
    pool, draws = InFlight(batch_size=2, pool_size=6, n=2, threshold=2, strategy=strategy), Draws()
    for version in (0, 1):
        step(pool, rollout, version, draws)
        take(pool, version)
    assert [g.admitted for g in pool.groups if g.complete] == [0, 0]
    assert [g.admitted for g in pool.groups if not g.complete] == [1, 1]
    refill, chunks = step(pool, rollout, 2, draws)
    _, metrics = take(pool, 2)
    if strategy == "drop":
        assert refill[f"{OFF_POLICY}/evicted_samples"] == 2 and chunks == 3
        assert metrics[f"{OFF_POLICY}/trajectory_spans/max"] == 2  # the groups admitted at 1
    else:
        assert refill[f"{OFF_POLICY}/evicted_samples"] == 0 and chunks == 3
        assert all(g.complete for g in pool.groups if g.admitted == 1)
        # dropless, as verl's: the complete groups admitted at 0 that version 1 had no room for train now, past it
        assert metrics[f"{OFF_POLICY}/trajectory_staleness_worst/max"] == 2


def test_the_pool_state_round_trips_exactly(world_of_one, tiny_model_dir):
    rollout = HFRollout(str(tiny_model_dir), dtype="float32")
    pool, draws = InFlight(batch_size=2, pool_size=4, n=2, threshold=None, strategy="drop"), Draws()
    for version in (0, 1):
        step(pool, rollout, version, draws)
        take(pool, version)
    copy = InFlight(batch_size=2, pool_size=4, n=2, threshold=None, strategy="drop")
    copy.load_state_dict(pool.state_dict(), records=len(PROMPTS))
    assert copy.groups == pool.groups and copy.reserve == pool.reserve and copy.next_group_id == pool.next_group_id
    assert any(r.tokens and not r.finished for g in copy.groups for r in g.responses)
    broken = {**pool.state_dict(), "log_probs": pool.state_dict()["log_probs"][:-1]}
    with pytest.raises(ValueError, match="do not fit this run"):
        copy.load_state_dict(broken, records=len(PROMPTS))
    with pytest.raises(ValueError, match=f"prompt rows up to {max(pool.reserve)} of 4"):
        copy.load_state_dict(pool.state_dict(), records=4)


def test_judged_groups_leave_the_pool_unless_informative_and_keep_their_verdict(world_of_one, tiny_model_dir):
    rollout = HFRollout(str(tiny_model_dir), dtype="float32")
    pool, draws = InFlight(batch_size=2, pool_size=4, n=2, threshold=None, strategy="drop"), Draws()
    step(pool, rollout, 0, draws)
    seen = []

    def verdicts_of(groups):
        seen.extend(g.group_id for g in groups)
        return ["kept" if g.group_id % 2 else "all_wrong" for g in groups]

    informative, going, verdicts = pool.judge(verdicts_of)
    assert seen == [0, 1, 2, 3] and verdicts == ["all_wrong", "kept", "all_wrong", "kept"]
    assert (informative, going) == (2, False) and [g.group_id for g in pool.groups] == [1, 3]
    assert pool.judge(verdicts_of)[2] == [] and seen == [0, 1, 2, 3]  # judged once
    copy = InFlight(batch_size=2, pool_size=4, n=2, threshold=None, strategy="drop")
    copy.load_state_dict(pool.state_dict(), records=len(PROMPTS))
    assert [g.kept for g in copy.groups] == [True, True]
    batch, _ = take(pool, 0)
    assert sorted(set(batch.group_ids.tolist())) == [1, 3]


ASYNC = [
    "trainer.v1.trainer_mode=colocate_async",
    "trainer.v1.colocate_async.chunk_tokens=4",
    "trainer.total_training_steps=3",
]
# A whole colocate_async run, its metrics and its resume: tests/checkpoint/test_resume.py


def test_dynamic_sampling_judges_each_complete_group_and_refills_the_pool(
    world_of_one, tiny_model_dir, arithmetic_data, ds_test_config, tmp_path
):
    """DAPO with partial rollout: each group is judged once complete (the parity reward drops every even answer's
    group, all_correct), the dropped leave the pool, which is filled again when nothing is left to generate."""
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    trainer, logged, _, _ = run_config(
        "grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path / "run", *ASYNC, *FILTERING,
        f"custom_reward_function.path={reward}",
    )  # fmt: skip
    steps = [metrics for step, metrics in logged if f"{OFF_POLICY}/chunks" in metrics]
    assert len(steps) == 3
    assert sum(m["dynamic_sampling/dropped_all_correct"] for m in steps) >= 1
    assert any(m["train/num_gen_batches"] > 1 for m in steps)  # a step filled the pool again
    for m in steps:
        judged = m["dynamic_sampling/groups_informative"] + sum(
            m[f"dynamic_sampling/dropped_{r}"] for r in ("all_correct", "all_wrong", "all_equal")
        )
        assert judged == m["dynamic_sampling/groups_generated"] and m["actor/grad_norm"] > 0
    trained = trainer.cfg.data.train_batch_size
    assert all(m[f"{OFF_POLICY}/groups_carried"] + m[f"{OFF_POLICY}/groups_admitted"] >= trained for m in steps)
