"""Step, validation and throughput metrics: hand-computed cases, verl 0.9.1 reference values, edge cases.

Single process: the reductions over ranks are identities without torch.distributed.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsrl.algorithms import RolloutCorrection
from dsrl.data.batch import Batch
from dsrl.trainer import metrics as metrics_module
from dsrl.trainer.metrics import (
    batch_metrics,
    memory_metrics,
    rollout_correction_metrics,
    rollout_logprob_metrics,
    throughput_metrics,
    validation_metrics,
    variance_proxy_metrics,
)

PAD = 50.0  # garbage on padding positions: it must never reach a metric
LENGTHS = {"max_prompt_length": 3, "max_response_length": 4}


def make_batch(prompt_lengths, response_lengths, width=4, **token_rows):
    """Batch with left-padded prompts, right-padded responses; ``token_rows`` give each named
    per-token field's values on the response tokens, row by row (padding filled with ``PAD``)."""
    prompt_lengths, response_lengths = torch.tensor(prompt_lengths), torch.tensor(response_lengths)
    rows, prompt_width = len(prompt_lengths), LENGTHS["max_prompt_length"]
    response_mask = (torch.arange(width) < response_lengths[:, None]).long()
    fields = {}
    for name, values in token_rows.items():
        tensor = torch.full((rows, width), PAD)
        for i, row in enumerate(values):
            tensor[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        fields[name] = tensor
    return Batch(
        prompt_ids=torch.zeros(rows, prompt_width, dtype=torch.long),
        prompt_mask=(torch.arange(prompt_width).flip(0) < prompt_lengths[:, None]).long(),
        response_ids=torch.zeros(rows, width, dtype=torch.long),
        response_mask=response_mask,
        group_ids=torch.arange(rows),
        **fields,
    )


# ---------------------------------------------------------------------------------------------
# batch_metrics


def scored_batch(with_values=True):
    # rows: prompt lengths 3, 2, 1; responses of 4, 2 and 0 tokens (the last row is aborted)
    scores = torch.zeros(3, 4)
    scores[0, 3], scores[1, 1], scores[2, 0] = 1.0, 0.5, 9.0  # the aborted row's 9 is left out
    rewards = scores.clone()
    rewards[0, 0] = -0.25
    batch = make_batch(
        [3, 2, 1],
        [4, 2, 0],
        advantages=[[1, 2, 3, 4], [-1, -3]],
        returns=[[2, 0, 2, 0], [1, 1]],
        values=[[1, 0, 1, 0], [1, 1]],
    )
    return batch.replace(
        token_level_scores=scores, token_level_rewards=rewards, values=batch.values if with_values else None
    )


def test_batch_metrics_by_hand():
    got = batch_metrics(scored_batch(), **LENGTHS)
    # returns [2,0,2,0,1,1]: unbiased var 4/5; returns - values [1,0,1,0,0,0]: unbiased var (4/3)/5
    explained = 1 - (4 / 15) / (4 / 5 + 1e-5)
    expected = {
        "critic/score/mean": 0.75, "critic/score/max": 1.0, "critic/score/min": 0.5,
        "critic/rewards/mean": 0.625, "critic/rewards/max": 0.75, "critic/rewards/min": 0.5,
        "critic/advantages/mean": 1.0, "critic/advantages/max": 4.0, "critic/advantages/min": -3.0,
        "critic/returns/mean": 1.0, "critic/returns/max": 2.0, "critic/returns/min": 0.0,
        "critic/values/mean": 2 / 3, "critic/values/max": 1.0, "critic/values/min": 0.0,
        "critic/vf_explained_var": explained,
        "response_length/mean": 2.0, "response_length/max": 4.0, "response_length/min": 0.0,
        "response_length/clip_ratio": 1 / 3,
        "response_length_non_aborted/mean": 3.0, "response_length_non_aborted/max": 4.0,
        "response_length_non_aborted/min": 2.0, "response_length_non_aborted/clip_ratio": 0.5,
        "response/aborted_ratio": 1 / 3,
        "prompt_length/mean": 2.0, "prompt_length/max": 3.0, "prompt_length/min": 1.0,
        "prompt_length/clip_ratio": 1 / 3,
    }  # fmt: skip
    assert got == pytest.approx(expected, abs=1e-7)


def test_batch_metrics_without_a_critic_has_no_value_metrics():
    got = batch_metrics(scored_batch(with_values=False), **LENGTHS)
    assert not any(name.startswith(("critic/values", "critic/vf_")) for name in got)
    assert got["critic/score/mean"] == pytest.approx(0.75)


def test_batch_metrics_all_aborted_gives_nans_where_verl_does():
    batch = make_batch([3, 3], [0, 0], advantages=[[], []], returns=[[], []], values=[[], []])
    batch = batch.replace(token_level_scores=torch.zeros(2, 4), token_level_rewards=torch.zeros(2, 4))
    got = batch_metrics(batch, **LENGTHS)
    for name in ("critic/score/mean", "critic/rewards/max", "critic/advantages/min", "critic/returns/mean",
                 "critic/values/max", "critic/vf_explained_var", "response_length_non_aborted/mean",
                 "response_length_non_aborted/clip_ratio"):  # fmt: skip
        assert math.isnan(got[name]), name
    assert got["response/aborted_ratio"] == 1.0 and got["prompt_length/clip_ratio"] == 1.0
    assert got["response_length/mean"] == 0.0 and got["response_length/clip_ratio"] == 0.0


# ---------------------------------------------------------------------------------------------
# rollout_logprob_metrics


def logprob_batch(actor_probs, rollout_probs, lengths):
    log = lambda rows: [[math.log(p) for p in row] for row in rows]  # noqa: E731
    return make_batch([1] * len(lengths), lengths, old_log_probs=log(actor_probs), rollout_log_probs=log(rollout_probs))


def test_rollout_probs_diff_by_hand():
    batch = logprob_batch([[0.5, 0.25], [1.0]], [[0.25, 0.25], [0.5]], [2, 1])
    got = rollout_logprob_metrics(batch)
    # |diff| = [0.25, 0, 0.5]: mean 0.25, unbiased std 0.25; centred probs (x12): [-1,-4,5], [-1,-1,2]
    expected = {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": 0.5,
        "training/rollout_probs_diff_mean": 0.25,
        "training/rollout_probs_diff_std": 0.25,
        "training/rollout_actor_probs_pearson_corr": 15 / math.sqrt(42 * 6),
    }
    assert got == pytest.approx(expected, abs=1e-6)
    # partial rollout: only the tokens of the current version (3) count; the stale first token's gap is by design
    carried = batch.replace(rollout_versions=torch.tensor([[2, 3, 0, 0], [3, 0, 0, 0]]))
    fresh = rollout_logprob_metrics(carried, version=3)
    assert fresh["training/rollout_probs_diff_max"] == 0.5 and fresh["training/rollout_probs_diff_mean"] == 0.25
    assert fresh["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(0.125))  # of [0, 0.5]
    assert rollout_logprob_metrics(carried, version=4)["training/rollout_probs_diff_valid"] == 0.0
    with pytest.raises(ValueError, match="needs the current version"):
        rollout_logprob_metrics(carried)


def test_rollout_probs_diff_degenerate_cases():
    empty = rollout_logprob_metrics(logprob_batch([[], []], [[], []], [0, 0]))
    assert empty["training/rollout_probs_diff_valid"] == 0.0
    assert all(math.isnan(v) for k, v in empty.items() if not k.endswith("_valid"))
    one = rollout_logprob_metrics(logprob_batch([[0.5]], [[0.25]], [1]))
    assert one["training/rollout_probs_diff_mean"] == pytest.approx(0.25)
    assert math.isnan(one["training/rollout_probs_diff_std"])  # unbiased std of one value
    assert math.isnan(one["training/rollout_actor_probs_pearson_corr"])
    same = rollout_logprob_metrics(logprob_batch([[0.5, 0.25, 0.125]], [[0.5, 0.25, 0.125]], [3]))
    assert same["training/rollout_probs_diff_max"] == 0.0
    assert same["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# rollout_correction_metrics


def test_rollout_correction_metrics_by_hand():
    batch = make_batch([1, 1], [2, 1])
    mask = batch.response_mask.float()
    correction = RolloutCorrection(
        weights=torch.tensor([[1.0, 0.0, 9, 9], [2.0, 9, 9, 9]]) * mask,
        keep_mask=torch.tensor([[1.0, 0.0, 0, 0], [1.0, 0, 0, 0]]),
        ratio=torch.tensor([[1.0, 4.0, 9, 9], [0.5, 9, 9, 9]]) * mask,
    )
    assert rollout_correction_metrics(batch, correction) == pytest.approx({
        "rollout_corr/is_ratio_mean": 5.5 / 3,
        "rollout_corr/is_ratio_max": 4.0,
        "rollout_corr/is_ratio_min": 0.5,
        "rollout_corr/is_weight_mean": 1.0,
        "rollout_corr/masked_fraction": 1 / 3,
    })  # fmt: skip


# ---------------------------------------------------------------------------------------------
# throughput_metrics, memory_metrics


def test_throughput_and_per_token_times():
    timing = {"timing_s/step": 2.0, "timing_s/gen": 1.4, "timing_s/ref": 0.5, "timing_s/old_log_prob": 0.3,
              "timing_s/reward": 0.1, "timing_s/update_actor": 0.25, "timing_s/wake": 0.01, "other": 7.0}  # fmt: skip
    got = throughput_metrics(timing, num_prompt_tokens=300, num_response_tokens=700, world_size=4)
    assert got == pytest.approx({
        "perf/total_num_tokens": 1000,
        "perf/time_per_step": 2.0,
        "perf/throughput": 1000 / (2.0 * 4),
        "timing_per_token_ms/gen": 1400 / 700,  # per response token
        "timing_per_token_ms/ref": 500 / 1000,  # per prompt + response token
        "timing_per_token_ms/update_actor": 250 / 1000,
    })  # fmt: skip
    none = throughput_metrics({"timing_s/step": 1.0, "timing_s/gen": 1.0}, num_prompt_tokens=5,
                              num_response_tokens=0, world_size=1)  # fmt: skip
    assert none["timing_per_token_ms/gen"] == 0.0 and none["perf/throughput"] == 5.0


def test_memory_metrics(monkeypatch):
    monkeypatch.setattr(metrics_module.psutil, "virtual_memory", lambda: SimpleNamespace(used=3 * 1024**3))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_metrics() == {"perf/cpu_memory_used_gb": 3.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2 * 1024**3)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 * 1024**3)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    assert memory_metrics() == {
        "perf/cpu_memory_used_gb": 3.0,
        "perf/max_memory_allocated_gb": 2.0,
        "perf/max_memory_reserved_gb": 5.0,
    }
    assert resets == [1]  # the next step's peak is its own


# ---------------------------------------------------------------------------------------------
# validation_metrics


def test_one_response_per_prompt_gives_only_mean_at_1():
    got = validation_metrics(["a", "a"], [0, 1], {"reward": [1.0, 0.0]}, ["x", "y"])
    assert got == {"val-core/a/reward/mean@1": 0.5}


@pytest.mark.parametrize("n", [2, 4])
def test_equal_rewards_make_best_worst_and_majority_the_mean(n):
    got = validation_metrics(["a"] * n, ["p"] * n, {"reward": [0.5] * n}, ["x", "y"] * (n // 2))
    sizes = [2] if n == 2 else [2, 4]
    expected = {f"val-core/a/reward/mean@{n}": 0.5, f"val-aux/a/reward/std@{n}": 0.0}
    for k in sizes:
        section = "val-core" if k == n else "val-aux"
        for name in ("best", "worst", "maj"):
            sec = "val-aux" if name == "worst" else section
            expected |= {f"{sec}/a/reward/{name}@{k}/mean": 0.5, f"{sec}/a/reward/{name}@{k}/std": 0.0}
    assert got == pytest.approx(expected, abs=1e-12) and set(got) == set(expected)


def test_bootstrap_draws_and_majority_ties_follow_verl():
    # verl reseeds numpy's legacy generator with 42 before drawing 1000 samples of k indices
    draws = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)
    # values [1, 0], votes A, B: a sample {0, 1} is a tie, won by the vote seen first
    state = np.random.get_state()
    got = validation_metrics(["a", "a"], ["p", "p"], {"reward": [1.0, 0.0]}, ["A", "B"])
    assert all(
        np.array_equal(x, y) for x, y in zip(state[1:], np.random.get_state()[1:], strict=True)
    )  # global RNG untouched
    for name, hits in {"best": (draws == 0).any(1), "worst": (draws == 0).all(1), "maj": draws[:, 0] == 0}.items():
        p = hits.mean()
        assert got[f"val-core/a/reward/{name}@2/mean" if name != "worst" else "val-aux/a/reward/worst@2/mean"] == p
        assert got[f"val-{'aux' if name == 'worst' else 'core'}/a/reward/{name}@2/std"] == pytest.approx(
            math.sqrt(p * (1 - p))
        )
    assert got["val-core/a/reward/mean@2"] == 0.5 and got["val-aux/a/reward/std@2"] == 0.5
    other = validation_metrics(["a", "a"], ["p", "p"], {"reward": [1.0, 0.0]}, seed=7)
    assert other["val-core/a/reward/best@2/mean"] != got["val-core/a/reward/best@2/mean"]
    assert not any("maj@" in name for name in other)  # no votes, no majority


def test_sources_average_over_their_prompts_and_the_largest_n_is_core():
    got = validation_metrics(
        ["a", "a", "a", "a", "b", "b", "b", "b", "b", "b"],
        ["p0", "p1", "p0", "p1", "q0", "q0", "q1", "q0", "q1", "q0"],
        {"reward": [1, 0, 1, 0, 1, 1, 0, 1, 0, 1]},
    )
    assert got["val-core/a/reward/mean@2"] == 0.5 and got["val-core/a/reward/best@2/mean"] == 0.5
    assert got["val-aux/a/reward/worst@2/mean"] == 0.5 and got["val-aux/a/reward/std@2"] == 0.0
    # source b: q0 has 4 responses (all 1), q1 has 2 (all 0); only size-4 metrics are core
    assert got["val-core/b/reward/mean@4"] == 1.0 and got["val-aux/b/reward/mean@2"] == 0.0
    assert got["val-aux/b/reward/best@2/mean"] == 0.5  # averaged over both prompts
    assert got["val-core/b/reward/best@4/mean"] == 1.0 and got["val-core/b/reward/best@4/std"] == 0.0
    assert "val-core/b/reward/best@2/mean" not in got and "val-core/b/reward/mean@2" not in got
    three = validation_metrics(["c"] * 3, ["r0", "r1", "r2"], {"reward": [0.0, 0.0, 1.0]})
    assert three == {"val-core/c/reward/mean@1": pytest.approx(1 / 3)}  # a mean over prompts, not a median


def test_acc_is_the_core_variable_when_present():
    got = validation_metrics(["a"] * 2, ["p"] * 2, {"reward": [2.0, 0.0], "acc": [1.0, 0.0], "length": [3, 5]})
    core = {name for name in got if name.startswith("val-core/")}
    assert core == {"val-core/a/acc/mean@2", "val-core/a/acc/best@2/mean", "val-core/a/acc/best@2/std"}
    assert got["val-aux/a/reward/mean@2"] == 1.0 and got["val-aux/a/length/mean@2"] == 4.0
    assert got["val-aux/a/length/std@2"] == 1.0


def test_matches_verl_process_validation_metrics():
    # Reference: verl 0.9.1's process_validation_metrics named by RayPPOTrainer._val_metrics_update,
    # called with these inputs (infos_dict = {"reward": rewards, "pred": preds}, seed 42).
    sources = ["math"] * 6 + ["code"] * 3
    uids = ["p0", "p1", "p0", "p0", "p1", "p0", "p2", "p2", "p2"]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.25, 0.5, 0.3, 0.9, 0.6]
    preds = ["7", "1", "3", "7", "2", "3", "a", "b", "a"]
    verl = {
        "val-core/math/reward/mean@4": 0.625,
        "val-aux/math/reward/std@4": 0.414578098794425,
        "val-aux/math/reward/best@2/mean": 0.522,
        "val-aux/math/reward/best@2/std": 0.19602285251430224,
        "val-aux/math/reward/worst@2/mean": 0.23175,
        "val-aux/math/reward/worst@2/std": 0.25333024518177816,
        "val-aux/math/reward/maj@2/mean": 0.379875,
        "val-aux/math/reward/maj@2/std": 0.26769582979224943,
        "val-core/math/reward/best@4/mean": 0.9685,
        "val-core/math/reward/best@4/std": 0.12750588221725304,
        "val-aux/math/reward/worst@4/mean": 0.1925,
        "val-aux/math/reward/worst@4/std": 0.2952858784297007,
        "val-core/math/reward/maj@4/mean": 0.628,
        "val-core/math/reward/maj@4/std": 0.4184686368176234,
        "val-aux/math/reward/mean@2": 0.125,
        "val-aux/math/reward/std@2": 0.125,
        "val-core/code/reward/mean@3": 0.6,
        "val-aux/code/reward/std@3": 0.24494897427831783,
        "val-aux/code/reward/best@2/mean": 0.729,
        "val-aux/code/reward/best@2/std": 0.2067824944234884,
        "val-aux/code/reward/worst@2/mean": 0.4619999999999999,
        "val-aux/code/reward/worst@2/std": 0.20706520712084878,
        "val-aux/code/reward/maj@2/mean": 0.5877,
        "val-aux/code/reward/maj@2/std": 0.2454357553413928,
        "val-core/code/reward/best@3/mean": 0.7995000000000001,
        "val-core/code/reward/best@3/std": 0.162879556728277,
        "val-aux/code/reward/worst@3/mean": 0.3989999999999999,
        "val-aux/code/reward/worst@3/std": 0.16786601800245338,
        "val-core/code/reward/maj@3/mean": 0.5615999999999999,
        "val-core/code/reward/maj@3/std": 0.2384228176999844,
    }
    got = validation_metrics(sources, uids, {"reward": rewards}, preds)
    assert set(got) == set(verl)
    assert got == pytest.approx(verl, rel=0, abs=1e-12)


def test_validation_inputs_must_line_up():
    with pytest.raises(ValueError):
        validation_metrics(["a", "a"], ["p"], {"reward": [1.0, 0.0]})


def test_variance_proxy_by_hand():
    """Row 1: pi = (0.5, 0.25), sum pi^2 = (0.5, 0.25), A = 1 -> W = 0.5 + 0.75 = 1.25.
    Row 2: pi = 1, sum pi^2 = 1, A = 2 -> W = 0. Power = mean(1 * 1.25, 4 * 0) = 0.625."""
    batch = make_batch(
        [1, 1],
        [2, 1],
        old_log_probs=[[math.log(0.5), math.log(0.25)], [0.0]],
        sum_pi_squared=[[0.5, 0.25], [1.0]],
        advantages=[[1.0, 1.0], [2.0]],
    )
    got = variance_proxy_metrics(batch, grad_norm=0.5)
    want = {
        "variance_proxy/proxy1_signal_strength": 0.25,
        "variance_proxy/proxy2_total_power": 0.625,
        "variance_proxy/proxy3_pure_noise": 0.375,  # (0.625 - 0.25) / (2 - 1)
        "variance_proxy/expected_a_squared": 2.5,
        "variance_proxy/expected_w": 0.625,
    }
    assert got == pytest.approx(want, rel=1e-6)
    # Importance weights of 1 are the on-policy case; weights of 2 scale the power by 4 (rho^2).
    ones = batch.replace(rollout_is_weights=torch.ones_like(batch.advantages))
    assert variance_proxy_metrics(ones, grad_norm=0.5) == pytest.approx(want, rel=1e-6)
    twos = variance_proxy_metrics(
        batch.replace(rollout_is_weights=2 * torch.ones_like(batch.advantages)), grad_norm=None
    )
    assert twos["variance_proxy/proxy2_total_power"] == pytest.approx(4 * 0.625, rel=1e-6)
    assert twos["variance_proxy/proxy3_pure_noise"] == 0.0  # no gradient norm, no noise estimate
    assert variance_proxy_metrics(batch.replace(sum_pi_squared=None), grad_norm=0.5) == {}


def test_forward_metrics_give_the_padding_and_dedup_shares_over_all_passes():
    from dsrl.engines.forward import PassTally
    from dsrl.trainer.metrics import forward_metrics

    tallies = {
        "old_log_prob": PassTally(micro_batches=2, positions=100, tokens=80, sequence_tokens=120),
        "actor_update": PassTally(micro_batches=3, positions=100, tokens=100, sequence_tokens=100),
    }
    assert forward_metrics(tallies) == {
        "perf/micro_batches/actor_update": 3.0,
        "perf/micro_batches/old_log_prob": 2.0,
        "perf/padding_ratio": pytest.approx(20 / 200),  # 20 padding positions of 200
        "perf/dedup_ratio": pytest.approx(40 / 220),  # 40 prompt tokens not run of the rows' own 220
    }
    assert forward_metrics({}) == {"perf/padding_ratio": 0.0, "perf/dedup_ratio": 0.0}
