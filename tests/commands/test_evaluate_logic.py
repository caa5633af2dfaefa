"""dsrl-eval's arithmetic and its config (``dsrl.commands.evaluate``): pass@k against hand counts, the paired bootstrap
on constructed cases, per-prompt results against validation's metrics, and which config problems it reports."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from dsrl.commands.evaluate import (
    BOOTSTRAP_SAMPLES,
    eval_config,
    paired_bootstrap,
    parse_args,
    pass_at_k,
    pass_sizes,
    prompt_results,
    reads,
)
from dsrl.config import ConfigError
from dsrl.trainer.metrics import validation_metrics
from dsrl.trainer.validation import ScoredResponse, shard_chunks
from tests.conftest import recipe, write_model_stub, write_parquet_stub


def test_pass_at_k_against_hand_counts():
    # n=4 responses, c correct: the chance that k drawn without replacement hold a correct one, counted by hand
    assert [pass_at_k(4, 1, k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]  # 1 - 3/4; 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert [pass_at_k(4, 2, k) for k in (1, 2, 4)] == [0.5, 1 - 1 / 6, 1.0]  # C(2,2)/C(4,2) = 1/6
    assert [pass_at_k(4, 0, k) for k in (1, 2, 4)] == [0.0, 0.0, 0.0]
    assert [pass_at_k(4, 4, k) for k in (1, 2, 4)] == [1.0, 1.0, 1.0]
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3) = 1/10
    assert pass_at_k(16, 3, 8) == pytest.approx(1 - math.comb(13, 8) / math.comb(16, 8))
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 8)


def test_pass_sizes_are_the_powers_of_two_then_n():
    assert pass_sizes(1) == [1]
    assert pass_sizes(4) == [1, 2, 4]
    assert pass_sizes(6) == [1, 2, 4, 6]
    assert pass_sizes(16) == [1, 2, 4, 8, 16]


def test_paired_bootstrap_of_constant_differences_is_a_point():
    assert paired_bootstrap([0.0] * 20, ["a"] * 20, seed=1) == (0.0, 0.0, 0.0)
    assert paired_bootstrap([0.25] * 7, ["a"] * 7, seed=1) == pytest.approx((0.25, 0.25, 0.25))


def test_paired_bootstrap_is_stratified_by_data_source():
    # 10 prompts of source a, each B - A = 1; 90 of source b, each 0. The headline is the mean over sources (0.5),
    # not the pooled mean (0.1), and with each source resampled within itself every resample gives 0.5.
    differences = [1.0] * 10 + [0.0] * 90
    sources = ["a"] * 10 + ["b"] * 90
    assert paired_bootstrap(differences, sources, seed=3) == pytest.approx((0.5, 0.5, 0.5))


def test_paired_bootstrap_interval_matches_the_normal_approximation_and_its_seed():
    # 200 prompts' differences: the resampled means have sd ~ std / sqrt(200), so the 95% percentile interval is
    # about mean +- 1.96 sd.
    differences = np.random.default_rng(0).normal(0.3, 0.5, size=200)
    difference, low, high = paired_bootstrap(differences, ["a"] * 200, seed=7)
    half_width = 1.96 * differences.std() / math.sqrt(200)
    assert difference == pytest.approx(differences.mean())
    assert low == pytest.approx(difference - half_width, abs=0.01)
    assert high == pytest.approx(difference + half_width, abs=0.01)
    assert paired_bootstrap(differences, ["a"] * 200, seed=7) == (difference, low, high)  # seeded
    assert paired_bootstrap(differences, ["a"] * 200, seed=8) != (difference, low, high)
    assert BOOTSTRAP_SAMPLES == 10_000


def test_prompt_results_agree_with_validation_metrics():
    # 3 prompts x 4 responses, two data sources; scores 1.0 (right) or 0.0, plus an extra
    scores = [[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]
    sources = ["x", "x", "y"]
    rows = [
        ScoredResponse(i, sources[i], float(s), {"digits": float(j)}, (f"p{i}", f"r{i}{j}"))
        for i, group in enumerate(scores)
        for j, s in enumerate(group)
    ]
    records = [type("Record", (), {"ground_truth": str(i)}) for i in range(3)]
    results, metrics = prompt_results(rows, records, n=4, threshold=1.0)
    assert [r["correct"] for r in results] == [1, 3, 0]
    assert results[0]["pass"] == {"pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0}
    assert results[1]["pass"]["pass@2"] == 1.0  # C(1,2) = 0 wrong pairs
    assert metrics["eval/x/pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert metrics["eval/y/pass@4"] == 0.0 and metrics["eval/x/prompts"] == 2
    validation = validation_metrics(
        [r.data_source for r in rows], [r.index for r in rows], {"reward": [r.score for r in rows]}
    )
    assert validation["val-core/x/reward/mean@4"] == pytest.approx((results[0]["mean@4"] + results[1]["mean@4"]) / 2)
    assert [resp["digits"] for resp in results[2]["responses"]] == [0.0, 1.0, 2.0, 3.0]
    assert results[2]["ground_truth"] == "2" and results[2]["prompt"] == "p2"


def test_an_acc_extra_decides_correctness():
    rows = [ScoredResponse(0, "x", score, {"acc": acc}, ("p", "r")) for score, acc in ((0.9, 1.0), (1.0, 0.0))]
    records = [type("Record", (), {"ground_truth": "1"})]
    results, _ = prompt_results(rows, records, n=2, threshold=1.0)
    assert results[0]["correct"] == 1 and results[0]["mean@2"] == 0.5  # mean of acc, the core variable


@pytest.fixture
def inputs(tmp_path):
    write_parquet_stub(tmp_path / "test.parquet")
    write_model_stub(tmp_path / "model")
    return tmp_path


def config_of(argv: list[str]):
    args = parse_args(argv)
    return eval_config(args, args.models[0], world_size=1)


def test_a_training_recipe_evaluates_whatever_its_training_keys_say(inputs, tmp_path):
    # configs/cpu.yaml names outputs/ files that need not exist; the training keys are not read
    ppo_on_cpu = [flag for file in recipe("ppo") for flag in ("--config", file)]
    cfg = config_of(
        [
            str(inputs / "model"),
            "--data",
            str(inputs / "test.parquet"),
            *ppo_on_cpu,
            "--n",
            "4",
            "--temperature",
            "0.7",
            "data.train_files=missing.parquet",
        ]
    )
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.n, val.temperature, val.do_sample) == (4, 0.7, True)
    assert cfg.actor_rollout_ref.model.path == str(inputs / "model") and cfg.data.max_response_length == 16
    assert reads("actor_rollout_ref.rollout.val_kwargs.n") and not reads("data.train_files")
    assert not reads("actor_rollout_ref.rollout.n") and reads("custom_reward_function.path")
    assert reads("reward.sandbox_fusion.url") and reads("reward.sandbox_fusion.max_concurrent")


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--n", "4"], "actor_rollout_ref.rollout.val_kwargs.n=4: greedy decoding"),
        (["--reward-file", "missing.py:score"], "custom_reward_function.path=missing.py: file does not exist"),
        (["data.val_filez=x.parquet"], "data.val_filez"),  # a typo is reported, though no key of that name is read
        (["--max-response-length", "0"], "data.max_response_length=0"),
        (["actor_rollout_ref.rollout.multi_turn.enable=true"], "dsrl-eval generates single-turn responses"),
    ],
)
def test_problems_of_the_keys_it_reads_are_refused(inputs, argv, problem):
    with pytest.raises(ConfigError) as err:
        config_of([str(inputs / "model"), "--data", str(inputs / "test.parquet"), *argv])
    assert any(problem in line for line in err.value.violations), err.value.violations
    assert not any(line.startswith("data.train_files") for line in err.value.violations)


def test_no_data_is_refused_with_the_flag_to_use(inputs):
    with pytest.raises(ConfigError, match="fix: pass --data"):
        config_of([str(inputs / "model")])


def test_one_or_two_models():
    with pytest.raises(SystemExit):
        parse_args(["a", "b", "c", "--data", "x.parquet"])
    args = parse_args(["a", "b", "data.max_prompt_length=64", "--data", "x.parquet"])
    assert args.models == ["a", "b"] and args.overrides == ["data.max_prompt_length=64"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_the_package_is_refused_before_anything_loads(inputs):
    with pytest.raises(ConfigError, match="the vllm package is not installed here; fix: pip install 'dsrl\\[vllm\\]'"):
        config_of([str(inputs / "model"), "--data", str(inputs / "test.parquet"), "--engine", "vllm"])


def test_every_rank_gets_as_many_chunks_and_a_filler_where_its_share_ends():
    prompts = list("abcde")  # 5 prompts over 2 ranks, chunks of 2: rank 0 holds a c e, rank 1 b d
    assert shard_chunks(prompts, 0, 2, 2) == [(["a", "c"], 0, 2), (["e"], 2, 1)]
    assert shard_chunks(prompts, 1, 2, 2) == [(["b", "d"], 0, 2), (["a"], 2, 0)]  # "a": a filler, not scored
    assert shard_chunks(prompts, 0, 1, None) == [(prompts, 0, 5)]
