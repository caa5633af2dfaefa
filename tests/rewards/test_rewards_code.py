"""Code rewards on a SandboxFusion server (``dsrl.rewards.code``), as verl's default scorer gives them, against a
stand-in server on 127.0.0.1 that really runs the code (tests/helpers/sandbox_fusion.py): the code verl finds in a
response, the test cases of a ground truth, the pass rate of the first 10; then through the reward scorer's worker
processes: scores, each failure counted with its reason, a custom function reaching the same client,
``max_concurrent`` over the workers, and a slot freed by a worker killed in a call."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dsrl.rewards import RewardScorer, check_reward_rules, code
from dsrl.rewards import compute_score as builtin_score
from dsrl.workers.sandbox_fusion import SandboxFusionClient, SandboxFusionError
from tests.helpers.sandbox_fusion import SandboxStub

SUM = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -10\n"], "outputs": ["3\n", "7\n", "0"]})
ADDS = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture(scope="module")
def stub():
    with SandboxStub() as server:
        yield server


@pytest.fixture(autouse=True)
def fresh(stub):
    stub.requests.clear()
    stub.delay_s, stub.hang, stub.max_in_flight = 0.0, False, 0


@pytest.fixture
def client(stub):
    return SandboxFusionClient(stub.url, max_concurrent=8, memory_limit_mb=512, name="test-code")


# ---------------------------------------------------------------- the code and the cases


@pytest.mark.parametrize(
    "response, code_found",
    [
        ("First:\n```python\nA = 1\n```\nthen\n```python\nB = 2\n```\ndone", "\nB = 2\n"),  # the last python block
        ("```python\nunclosed", "\nunclosed"),
        ("```\nprint(1)\n```", "\nprint(1)\n"),  # no language line to drop
        ("```py\nprint(1)\n```\n```cpp\nx\n```", "print(1)\n"),  # the first block, its language line dropped
        ("```c++\nint x;\n```", "c++\nint x;\n"),  # not a word: kept, as verl keeps it
        ("```print(1)```", "print(1)"),
        ("print(1)", None),
    ],
)
def test_the_code_of_a_response_is_where_verl_looks(response, code_found):
    assert code.extract_code(response) == code_found


def test_test_cases_of_a_ground_truth():
    [(program, stdin, expected)] = code.read_test_cases({"inputs": ["5\n"], "outputs": ["25"]})
    assert (program("x = 1"), stdin, expected) == ("x = 1\n\n", "5\n", "25")
    [(program, stdin, expected)] = code.read_test_cases(json.dumps({"assert_case": ["assert f(2) == 4"]}))
    assert (program("def f(x): return x * x"), stdin, expected) == (
        "def f(x): return x * x\n\nassert f(2) == 4",
        "",
        None,
    )
    [(_, stdin, _)] = code.read_test_cases({"inputs": [None], "outputs": ["1"]})
    assert stdin is None


@pytest.mark.parametrize(
    "ground_truth, message",
    [
        ("7", "must be {'inputs': [...], 'outputs': [...]}, got int"),
        ("{inputs: [1]}", "the ground truth is not JSON test cases"),
        ({"inputs": ["1"]}, "has no 'inputs' and 'outputs' (keys: ['inputs'])"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "must be lists of one length, got 2, 1, 2"),
        ({"inputs": "1", "outputs": "1"}, "must be lists of one length, got str, str, 0"),
        ({"inputs": [], "outputs": []}, "the ground truth has no test cases"),
    ],
)
def test_a_ground_truth_without_readable_cases_is_refused(ground_truth, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        code.read_test_cases(ground_truth)


# ---------------------------------------------------------------- the score, on a server


def test_the_score_is_the_pass_rate(client, stub):
    assert code.compute_score(ADDS, SUM, client) == 1.0  # "0" matches "0\n": trailing newlines do not count
    assert code.compute_score("```python\nprint(3)\n```", SUM, client) == pytest.approx(1 / 3)
    assert code.compute_score("```python\nraise SystemExit(input())\n```", SUM, client) == 0.0  # a non-zero exit
    assert len(stub.requests) == 9
    assert code.compute_score("I would add them.", SUM, client) == 0.0 and len(stub.requests) == 9  # nothing sent
    assert {(r["language"], r["run_timeout"], r["compile_timeout"]) for r in stub.requests} == {("python", 10, 10)}


def test_only_the_first_ten_cases_run_and_count(client, stub):
    cases = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [str(i) for i in range(10)] + ["wrong", "wrong"]}
    assert code.compute_score("```python\nprint(input())\n```", cases, client) == 1.0
    assert sorted(r["stdin"] for r in stub.requests) == sorted(f"{i}\n" for i in range(10))


def test_function_cases_call_the_function_or_the_solution_method(client):
    cases = {
        "fn_name": "pair",
        "inputs": ["1\n2", '[1]\n{"a": true}', "3\n3"],
        "outputs": ["[1, 2]", '[[1], {"a": true}]', "[3, 3]"],
    }
    assert code.compute_score("```python\ndef pair(a, b):\n    return [a, b]\n```", cases, client) == 1.0
    method = "```python\nclass Solution:\n    def pair(self, a, b):\n        return (a, b)\n```"
    assert code.compute_score(method, cases, client) == 1.0
    # what is printed: JSON for a bool or None, str for a number or a string; prelude names (Counter) need no import
    printed = {"fn_name": "f", "inputs": ["1", "2", "3", "4"], "outputs": ["true", "null", "4", "b"]}
    answers = "```python\ndef f(x):\n    return [True, None, sum(Counter([x, x]).values()) * 2, 'b'][x - 1]\n```"
    assert code.compute_score(answers, printed, client) == 1.0
    assert code.compute_score("```python\ndef other(a, b):\n    return [a, b]\n```", cases, client) == 0.0


def test_assert_cases_pass_when_the_run_succeeds(client):
    cases = {"assert_case": ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 1"]}
    assert code.compute_score("```python\ndef square(x):\n    return x * x\n```", cases, client) == pytest.approx(2 / 3)


def test_a_case_without_a_verdict_fails_the_row(client, stub):
    stub.queue(500, "Internal Server Error")
    with pytest.raises(SandboxFusionError, match="HTTP 500"):
        code.compute_score(ADDS, SUM, client)


def test_the_dispatcher_needs_the_url_for_code_sources():
    with pytest.raises(ValueError, match="reward.sandbox_fusion.url is not set, so code cannot be run.*fix: set"):
        builtin_score("codecontests", ADDS, SUM)


def test_code_sources_are_refused_at_load_without_a_server():
    prompts = SimpleNamespace(source_counts=lambda: {"taco": 5, "openai/gsm8k": 3})
    with pytest.raises(ValueError) as err:
        check_reward_rules(
            {"data.train_files": prompts}, custom_path=None, math_verify_sources=(), sandbox_fusion_url=None
        )
    assert "data sources without a reward rule: 'taco' (5 rows of data.train_files)" in str(err.value)
    assert "are scored by running the code on a SandboxFusion server: set reward.sandbox_fusion.url" in str(err.value)
    check_reward_rules(
        {"data.train_files": prompts}, custom_path=None, math_verify_sources=(), sandbox_fusion_url="http://x/run_code"
    )


# ---------------------------------------------------------------- through the scorer's workers

CUSTOM = """
from dsrl.rewards import compute_score as builtin_score
from dsrl.rewards.code import compute_score as code_score, sandbox_client


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "my_code":
        return code_score(solution_str, ground_truth, sandbox_client())
    return builtin_score(data_source, solution_str, ground_truth, extra_info)
"""


def scorer(stub, tmp_path, max_concurrent=3, **kwargs):
    settings = dict(url=stub.url, max_concurrent=max_concurrent, memory_limit_mb=256)
    return RewardScorer(num_workers=2, log_file=tmp_path / "workers.log", sandbox_fusion=settings, **kwargs)


def test_the_scorer_scores_code_rows_and_counts_what_fails(stub, tmp_path):
    with scorer(stub, tmp_path, timeout_s=30) as rewards:
        scores, _, failures = rewards.score_batch(
            ["codecontests", "apps", "taco", "codeforces", "openai/gsm8k"],
            [ADDS, "```python\nprint(3)\n```", ADDS, "no code", "#### 72"],
            [SUM, SUM, "not json", SUM, "72"],
            [None] * 5,
        )
        assert scores == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 1.0]
        assert failures["reward/fail_exception"] == 1 and "not JSON test cases" in rewards.first_failure
        assert {r["memory_limit_MB"] for r in stub.requests} == {256}

        one_case = json.dumps({"inputs": ["2 2\n"], "outputs": ["4"]})
        stub.queue(503, "busy")  # tried again: the row still scores
        scores, _, failures = rewards.score_batch(["apps"], [ADDS], [one_case], [None])
        assert scores == [1.0] and sum(failures.values()) == 0
        for _ in range(3):
            stub.queue(502, "bad gateway")  # each attempt: the row fails, counted with the reason
        scores, _, failures = rewards.score_batch(["apps"], [ADDS], [one_case], [None])
        assert scores == [0.0] and failures["reward/fail_exception"] == 1
        assert "SandboxFusionError" in rewards.first_failure and "HTTP 502 Bad Gateway" in rewards.first_failure
        assert "(after 3 attempts)" in rewards.first_failure


def test_a_custom_function_reaches_the_runs_client(stub, tmp_path):
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    with scorer(stub, tmp_path, custom_path=str(tmp_path / "my_reward.py"), timeout_s=30) as rewards:
        scores, _, failures = rewards.score_batch(["my_code", "taco"], [ADDS, ADDS], [SUM, SUM], [None, None])
    assert scores == [1.0, 1.0] and sum(failures.values()) == 0


def test_max_concurrent_bounds_the_requests_of_all_workers(stub, tmp_path):
    stub.delay_s = 0.3
    with scorer(stub, tmp_path, max_concurrent=3, timeout_s=30) as rewards:
        tens = json.dumps({"inputs": [f"{i} 0\n" for i in range(10)], "outputs": [str(i) for i in range(10)]})
        scores, _, _ = rewards.score_batch(["apps"] * 2, [ADDS] * 2, [tens] * 2, [None] * 2)
    assert scores == [1.0] * 2 and len(stub.requests) == 20
    assert stub.max_in_flight == 3  # 2 workers x 10 cases at once, 3 slots


def test_a_worker_killed_in_a_call_frees_its_slot(stub, tmp_path):
    with scorer(stub, tmp_path, max_concurrent=1, timeout_s=2) as rewards:
        stub.hang = True
        scores, _, failures = rewards.score_batch(["apps"], [ADDS], [SUM], [None])
        assert scores == [0.0] and failures["reward/fail_timeout"] == 1
        stub.hang = False
        scores, _, failures = rewards.score_batch(["apps"], [ADDS], [SUM], [None])  # would wait on a lost slot
    assert scores == [1.0] and sum(failures.values()) == 0
