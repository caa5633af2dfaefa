"""RewardScorer: custom functions by path, time limits, and counted failures (the pool itself:
tests/rewards/test_reward_pool.py)."""

import logging
import textwrap
import time

import pytest

from dsrl.rewards import FAILURE_COUNTS, RewardScorer, load_custom_reward_function, reward_components

CUSTOM = textwrap.dedent(
    """
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "sleep":
            time.sleep(30)
        if solution_str == "raise":
            raise RuntimeError("boom")
        if solution_str == "crash":
            os._exit(3)
        if solution_str == "nan":
            return float("nan")
        if solution_str == "no-score":
            return {"acc": 1.0}
        if solution_str == "unpicklable":
            return {"score": 1.0, "callback": lambda: 0}
        if solution_str == "dict":
            return {"score": 0.5, "acc": 1.0, "source": data_source}
        return float(solution_str == ground_truth) + (extra_info or {}).get("bonus", 0.0)

    def other(data_source, solution_str, ground_truth, extra_info=None):
        return 2.0
    """
)


def counts_of(**nonzero) -> dict[str, int]:
    return {name: nonzero.get(name.removeprefix("reward/fail_"), 0) for name in FAILURE_COUNTS}


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def test_builtin_rules_score_a_batch():
    with RewardScorer(timeout_s=5, num_workers=2) as scorer:
        scores, extras, counts = scorer.score_batch(
            ["arithmetic", "openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "arithmetic"],
            ["12", "#### 5", "\\boxed{\\frac12}", "13"],
            ["12", "5", "0.5", "12"],
            [None, {"split": "test"}, None, None],
        )
    assert scores == [1.0, 1.0, 1.0, 0.0]
    assert extras == {}
    assert counts == counts_of()


def test_unknown_data_source_is_a_counted_error(caplog):
    with RewardScorer(timeout_s=5, num_workers=1) as scorer, caplog.at_level(logging.WARNING):
        scores, _, counts = scorer.score_batch(["arithmetic", "nope"], ["1", "1"], ["1", "1"], [None, None])
    assert scores == [1.0, 0.0]
    assert counts == counts_of(exception=1)
    assert "no built-in reward" in caplog.text


def test_custom_function_replaces_the_dispatcher_with_keyword_arguments(custom_file):
    with RewardScorer(custom_file, "compute_score", timeout_s=5, num_workers=2) as scorer:
        scores, extras, counts = scorer.score_batch(
            ["anything", "anything", "arithmetic"], ["a", "dict", "b"], ["a", "x", "c"], [{"bonus": 0.25}, None, None]
        )
    assert scores == [1.25, 0.5, 0.0]
    assert extras == {"acc": [None, 1.0, None], "source": [None, "anything", None]}
    assert counts == counts_of()
    with RewardScorer(custom_file, "other", timeout_s=5, num_workers=1) as scorer:
        assert scorer.score_batch(["x"], ["y"], ["z"], [None])[0] == [2.0]


def test_exceptions_bad_results_and_crashes_score_zero_and_are_counted(custom_file):
    with RewardScorer(custom_file, "compute_score", timeout_s=5, num_workers=1) as scorer:
        responses = ["a", "raise", "nan", "no-score", "unpicklable", "crash", "a"]
        scores, _, counts = scorer.score_batch(["s"] * 7, responses, ["a"] * 7, [None] * 7)
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # the row after the crash is scored by a new worker
        assert counts == counts_of(exception=1, invalid=3, crash=1)
        assert scorer.score_batch(["s"], ["a"], ["a"], [None])[0] == [1.0]


def test_timeouts_score_zero_are_counted_and_the_batch_continues(custom_file):
    with RewardScorer(custom_file, "compute_score", timeout_s=0.5, num_workers=1) as scorer:
        start = time.perf_counter()
        scores, _, counts = scorer.score_batch(["s"] * 4, ["a", "sleep", "a", "sleep"], ["a"] * 4, [None] * 4)
        elapsed = time.perf_counter() - start
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert counts == counts_of(timeout=2)
    assert elapsed < 10  # the sleeping calls were cut off, not waited for (30 s each)


def test_missing_file_or_function_fails_at_construction(custom_file, tmp_path):
    with pytest.raises(ValueError, match=r"custom_reward_function.path=.*no such file"):
        RewardScorer(str(tmp_path / "missing.py"), num_workers=1)
    with pytest.raises(ValueError, match=r"custom_reward_function.name='nope'.*\['compute_score', 'other'\]"):
        RewardScorer(custom_file, "nope", num_workers=1)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"(?s)importing it raised.*ModuleNotFoundError"):
        RewardScorer(str(broken), num_workers=1)


def test_load_custom_reward_function_in_process(custom_file):
    fn = load_custom_reward_function(custom_file, "compute_score")
    assert fn(data_source="d", solution_str="a", ground_truth="a") == 1.0


def test_batch_lengths_must_agree():
    with RewardScorer(num_workers=1) as scorer, pytest.raises(ValueError, match="one entry per response"):
        scorer.score_batch(["arithmetic"], ["1", "2"], ["1", "2"], [None, None])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardScorer(timeout_s=0)


# ---------------------------------------------------------------- gdpo's reward components


def test_reward_components_are_rows_of_the_keys_in_order():
    extras = {"acc": [1, 0.5, 0.0], "format": [0.0, 1.0, True], "pred": ["a", "b", "c"]}
    rows, problems = reward_components(["format", "acc"], extras, ["gsm8k"] * 3)
    assert problems == [] and rows == [[0.0, 1.0], [1.0, 0.5], [1.0, 0.0]]


def test_a_missing_component_names_the_key_the_data_source_and_the_fix():
    extras = {"acc": [1.0, None, float("nan"), 0.0], "format": ["x", 1.0, 1.0, 1.0]}
    rows, problems = reward_components(["acc", "format", "len"], extras, ["gsm8k", "math", "math", "gsm8k"])
    assert rows == []
    assert problems[0].startswith(
        "algorithm.gdpo_reward_keys: the reward of data source 'math' gave no finite number under 'acc' for 2 of 4 "
        "rows of this step (first: row 1, None)"
    )
    assert (
        "data source 'gsm8k' gave no finite number under 'format' for 1 of 4 rows of this step (first: row 0, 'x')"
        in problems[1]
    )
    assert "data source 'gsm8k' gave no finite number under 'len' for 2 of 4" in problems[2]  # a key no row gave
    assert "'math' gave no finite number under 'len' for 2 of 4" in problems[3]
    assert all("remove" in p and "return a dict" in p for p in problems) and len(problems) == 4
