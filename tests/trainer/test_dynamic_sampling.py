"""DAPO's dynamic sampling (dsrl.trainer.dynamic_sampling): the group filter, the keep order, the transfer plan, the
refill loop in a world of one, and the config rules of algorithm.filter_groups."""

from __future__ import annotations

import pytest
import torch

from dsrl.data.batch import Batch
from dsrl.trainer.dynamic_sampling import fill_batch, group_verdicts, kept_groups, metric_values, transfer_plan
from tests.conftest import recipe, stub_file_overrides

# ---------------------------------------------------------------- the group filter


def test_verdicts_by_group_in_order_of_first_row():
    group_ids = [7, 7, 7, 3, 3, 3, 9, 9, 9, 4, 4, 4]
    values = [1, 1, 1, 0, 0, 0, 1, 0, 1, 0.5, 0.5, 0.5]
    assert group_verdicts(group_ids, values) == ["all_correct", "all_wrong", "kept", "all_equal"]


def test_a_group_of_one_is_kept_as_verl():
    assert group_verdicts([0, 1, 1], [1.0, 0.0, 0.0]) == ["kept", "all_wrong"]


def test_tiny_differences_count_as_variation():
    assert group_verdicts([0, 0], [0.1 + 0.2, 0.3]) == ["kept"]  # 0.30000000000000004 != 0.3


def test_metric_values_from_the_score_or_an_extra():
    scores = torch.tensor([1.0, 0.0])
    assert metric_values("seq_reward", scores, {}) == ([1.0, 0.0], None)
    assert metric_values("score", scores, {"acc": [0, 0]}) == ([1.0, 0.0], None)
    assert metric_values("acc", scores, {"acc": [True, 0]}) == ([1.0, 0.0], None)


@pytest.mark.parametrize("extras", [{}, {"acc": [1.0, None]}, {"acc": [1.0, float("nan")]}, {"acc": ["yes", 1]}])
def test_a_missing_extra_is_a_problem_naming_the_key(extras):
    values, problem = metric_values("acc", torch.tensor([1.0, 0.0]), extras)
    assert values == []
    assert problem.startswith("algorithm.filter_groups.metric=acc: the reward gave no finite number under 'acc'")
    assert "Fix:" in problem


# ---------------------------------------------------------------- which groups, where


def test_kept_groups_in_round_rank_position_order():
    verdicts = [
        [["kept", "all_wrong"], ["all_correct", "kept"]],  # round 0: rank 0, rank 1
        [["kept", "kept"], ["kept", "all_equal"]],
    ]
    assert kept_groups(verdicts, 3) == [(0, 0, 0), (0, 1, 1), (1, 0, 0)]
    assert kept_groups(verdicts, 10) == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0)]


def test_transfer_plan_gives_each_rank_its_share():
    kept = [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1)]  # rank 0 holds 3 groups, rank 1 one; n = 2 rows each
    shipped0, width0, rows0 = transfer_plan(kept, world=2, rank=0, n=2)
    shipped1, width1, rows1 = transfer_plan(kept, world=2, rank=1, n=2)
    assert width0 == width1 == 6  # 3 groups of 2 rows: rank 1 pads its 2 rows to 6
    assert shipped0 == [(0, 0), (1, 0), (1, 1)] and shipped1 == [(0, 1)]
    # global rows: rank 0 ships 0..5 (its 3 groups), rank 1 ships 6..11 (its group, then padding)
    assert rows0 == [0, 1, 6, 7]  # kept groups 0 and 1: (0,0,0) and (0,1,1)
    assert rows1 == [2, 3, 4, 5]  # kept groups 2 and 3


# ---------------------------------------------------------------- the refill loop (a world of one)


def _scored(prompt_ids: list[int], first_group: int, values: list[float], n: int = 2):
    """A scored round: prompt p's n rows have values[p*n:(p+1)*n]."""
    b = len(prompt_ids) * n
    rows = torch.arange(len(prompt_ids)).repeat_interleave(n)
    batch = Batch(
        prompt_ids=torch.tensor(prompt_ids)[rows][:, None],
        prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.zeros(b, 1, dtype=torch.long),
        response_mask=torch.ones(b, 1, dtype=torch.long),
        group_ids=rows + first_group,
        token_level_scores=torch.tensor(values, dtype=torch.float32)[:, None],
    )
    return batch, values, None


def _run(rounds_values, n_groups, max_rounds, per_round=None):
    """fill_batch over rounds of ``per_round`` prompts (data.gen_batch_size; None: n_groups), round k's prompts
    numbered 10k, 10k + 1, ...; ``calls``: each round's (index, prompt ids)."""
    per_round = per_round or n_groups
    calls = []

    def scored_round(prompts, k):
        ids = prompts.prompt_ids[:, 0].tolist()
        calls.append((k, ids))
        return _scored(ids, first_group=k * 100, values=rounds_values[k])

    def next_prompts(k):
        return _prompts([10 * k + i for i in range(per_round)])

    batch, metrics = fill_batch(
        _prompts(list(range(per_round))),
        scored_round=scored_round,
        next_prompts=next_prompts,
        n_groups=n_groups,
        max_rounds=max_rounds,
        log=lambda line: None,
    )
    return batch, metrics, calls


def _prompts(ids):
    empty = torch.empty(len(ids), 0, dtype=torch.long)
    return Batch(
        prompt_ids=torch.tensor(ids)[:, None],
        prompt_mask=torch.ones(len(ids), 1, dtype=torch.long),
        response_ids=empty,
        response_mask=empty,
        group_ids=torch.arange(len(ids)),
    )


def test_one_round_is_enough_when_every_group_varies(world_of_one):
    batch, metrics, calls = _run([[1, 0, 0, 1, 1, 0]], n_groups=3, max_rounds=10)
    assert [k for k, _ in calls] == [0] and len(batch) == 6
    assert metrics["train/num_gen_batches"] == 1 and metrics["dynamic_sampling/groups_kept"] == 3


def test_refill_keeps_the_first_informative_groups_and_drops_the_surplus(world_of_one):
    rounds = [
        [1, 1, 0, 1, 0, 0],  # prompts 0, 1, 2: all_correct, kept, all_wrong
        [0, 0, 1, 0, 0.5, 0.5],  # prompts 10, 11, 12: all_wrong, kept, all_equal
        [1, 0, 0, 1, 1, 0],  # prompts 20, 21, 22: all kept, one needed
    ]
    batch, metrics, calls = _run(rounds, n_groups=3, max_rounds=0)
    assert [k for k, _ in calls] == [0, 1, 2]
    assert batch.prompt_ids[:, 0].tolist() == [1, 1, 11, 11, 20, 20]
    assert batch.group_ids.tolist() == [1, 1, 101, 101, 200, 200]
    assert batch.token_level_scores[:, 0].tolist() == [0, 1, 1, 0, 1, 0]
    assert metrics == {
        "train/num_gen_batches": 3,
        "dynamic_sampling/prompts_consumed": 9,
        "dynamic_sampling/groups_generated": 9,
        "dynamic_sampling/groups_informative": 5,
        "dynamic_sampling/groups_kept": 3,
        "dynamic_sampling/groups_surplus": 2,
        "dynamic_sampling/dropped_all_correct": 1,
        "dynamic_sampling/dropped_all_wrong": 2,
        "dynamic_sampling/dropped_all_equal": 1,
    }


def test_rounds_of_gen_batch_size_keep_the_first_train_batch_size_groups(world_of_one):
    """data.gen_batch_size = 2 x train_batch_size: rounds of 4 prompts for a batch of 2 groups. Every round's 4
    prompts are generated and counted, the kept groups are the first 2 informative ones in (round, position)
    order, and the other 2 informative groups of round 1 are surplus."""
    rounds = [
        [1, 1, 0, 1, 0, 0, 0.5, 0.5],  # prompts 0..3: all_correct, kept, all_wrong, all_equal
        [0, 0, 1, 0, 0, 1, 1, 0],  # prompts 10..13: all_wrong, kept, kept, kept
    ]
    batch, metrics, calls = _run(rounds, n_groups=2, max_rounds=0, per_round=4)
    assert calls == [(0, [0, 1, 2, 3]), (1, [10, 11, 12, 13])]  # every round draws 4 prompts
    assert batch.prompt_ids[:, 0].tolist() == [1, 1, 11, 11]
    assert batch.group_ids.tolist() == [1, 1, 101, 101]
    assert batch.token_level_scores[:, 0].tolist() == [0, 1, 1, 0]
    assert metrics == {
        "train/num_gen_batches": 2,
        "dynamic_sampling/prompts_consumed": 8,  # both rounds whole, though round 1's last 2 groups are not kept
        "dynamic_sampling/groups_generated": 8,
        "dynamic_sampling/groups_informative": 4,
        "dynamic_sampling/groups_kept": 2,
        "dynamic_sampling/groups_surplus": 2,
        "dynamic_sampling/dropped_all_correct": 1,
        "dynamic_sampling/dropped_all_wrong": 2,
        "dynamic_sampling/dropped_all_equal": 1,
    }


def test_one_round_of_gen_batch_size_can_fill_the_batch(world_of_one):
    batch, metrics, calls = _run([[1, 1, 1, 0, 0, 0, 0, 1]], n_groups=2, max_rounds=1, per_round=4)
    assert [k for k, _ in calls] == [0]
    assert batch.prompt_ids[:, 0].tolist() == [1, 1, 3, 3]  # prompts 1 and 3 vary; 0 and 2 do not
    assert metrics["dynamic_sampling/prompts_consumed"] == 4 and metrics["dynamic_sampling/groups_surplus"] == 0


def test_too_few_groups_after_max_rounds_raises_as_verl(world_of_one):
    with pytest.raises(ValueError, match=r"max_num_gen_batches=2: 2 rounds of 2 prompts gave 1 groups"):
        _run([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]], n_groups=2, max_rounds=2)
    with pytest.raises(ValueError, match=r"2 rounds of 4 prompts gave 1 groups .* fewer than data.train_batch_size=2"):
        _run([[1, 1, 1, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]], n_groups=2, max_rounds=2, per_round=4)


def test_a_round_whose_reward_lacks_the_metric_stops(world_of_one):
    def scored_round(prompts, k):
        batch, values, _ = _scored([0], 0, [1, 0])
        return batch, [], "algorithm.filter_groups.metric=acc: the reward gave no finite number"

    with pytest.raises(ValueError, match="filter_groups.metric=acc"):
        fill_batch(
            _prompts([0]),
            scored_round=scored_round,
            next_prompts=_prompts,
            n_groups=1,
            max_rounds=0,
            log=lambda line: None,
        )


# ---------------------------------------------------------------- config rules


def _problems(overrides, tmp_path, name="grpo", world_size=1):
    from dsrl.config import ConfigError, load_and_validate

    try:
        load_and_validate(recipe(name), stub_file_overrides(tmp_path) + overrides, world_size)
    except ConfigError as err:
        return err.violations
    return []


def test_defaults_are_verl_recipes(tmp_path):
    from dsrl.config import load_and_validate

    cfg, _ = load_and_validate(recipe("grpo"), stub_file_overrides(tmp_path), 1)
    fg = cfg.algorithm.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (False, None, 0)


def test_dapo_settings_load(tmp_path):
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]
    assert _problems(on + ["algorithm.filter_groups.max_num_gen_batches=10"], tmp_path) == []
    # DAPO's scripts set metric and max_num_gen_batches with enable=False: accepted, unread
    assert (
        _problems(["algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10"], tmp_path)
        == []
    )


def test_filter_groups_rules(tmp_path):
    [v] = _problems(["algorithm.filter_groups.enable=true"], tmp_path)
    assert v.startswith("algorithm.filter_groups.metric=null: algorithm.filter_groups.enable=true needs")
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]
    assert any(
        p.startswith("actor_rollout_ref.rollout.n=1: algorithm.filter_groups.enable=true drops groups")
        for p in _problems(on + ["actor_rollout_ref.rollout.n=1"], tmp_path)
    )
    assert any(
        p.startswith("algorithm.adv_estimator=remax: remax's greedy baseline")
        for p in _problems(on + ["algorithm.adv_estimator=remax"], tmp_path)
    )
    final = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward"]
    assert any(
        p.startswith("algorithm.filter_groups.metric=seq_final_reward: seq_final_reward is the score after")
        for p in _problems(final + ["algorithm.use_kl_in_reward=true"], tmp_path)
    )


FILTERING_ON = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "data.train_batch_size=8"]


def test_gen_batch_size_sizes_the_rounds(tmp_path):
    from dsrl.config import load_and_validate, prompts_per_round

    stubs = stub_file_overrides(tmp_path)
    cfg, _ = load_and_validate(recipe("grpo"), stubs + FILTERING_ON, 1)
    assert cfg.data.gen_batch_size is None and prompts_per_round(cfg.data) == 8  # null = train_batch_size, as verl
    cfg, _ = load_and_validate(recipe("grpo"), stubs + FILTERING_ON + ["data.gen_batch_size=24"], 2)
    assert prompts_per_round(cfg.data) == 24
    # without filtering: null or train_batch_size itself
    assert _problems(["data.train_batch_size=8", "data.gen_batch_size=8"], tmp_path) == []


def test_gen_batch_size_other_than_train_batch_size_needs_filter_groups(tmp_path):
    [v] = _problems(["data.train_batch_size=8", "data.gen_batch_size=16"], tmp_path)
    assert v.startswith(
        "data.gen_batch_size=16: differs from data.train_batch_size=8 but sizes only the rounds of dynamic sampling"
    )
    assert "fix: set it to null (or 8), or algorithm.filter_groups.enable=true" in v


def test_gen_batch_size_below_train_batch_size_is_refused(tmp_path):
    [v] = _problems(FILTERING_ON + ["data.gen_batch_size=4"], tmp_path)
    assert v.startswith("data.gen_batch_size=4: must be >= data.train_batch_size=8: a round draws at least")
    assert "e.g. 24 (verl's DAPO script's 3x)" in v


def test_gen_batch_size_splits_over_the_ranks_as_train_batch_size(tmp_path):
    problems = _problems(FILTERING_ON + ["data.gen_batch_size=18"], tmp_path, world_size=4)
    [v] = [v for v in problems if v.startswith("data.gen_batch_size")]
    assert v.startswith("data.gen_batch_size=18: must be divisible by the world size 4 (each rank takes")
    assert "use a multiple of 4, e.g. 20" in v
    mini = ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"]
    [v] = [v for v in _problems(mini, tmp_path, world_size=4) if v.startswith("data.train_batch_size")]  # as before
    assert v.startswith(
        "data.train_batch_size=6: must be divisible by the world size 4 (each rank takes train_batch_size/world_size "
        "prompts and generates their n responses itself, so train_batch_size*n splits evenly too)"
    )
