"""A reward function's faults as the trainer sees them (issue 13): ``sys.exit`` and ``KeyboardInterrupt``
reported as what they did, failures quoted with the user's line, a batch that hangs on every call cut
short, a slow batch reported while it runs, the workers' output in a file of its own, no worker left
behind however its trainer ends, and the ``reward.max_failed_steps`` key. Real pebble pools and
processes throughout; the trainer's side is tests/trainer/test_reward_stops_run.py."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import textwrap
import time

import pytest

from dsrl import config as C
from dsrl.checkpoint import save as ckpt
from dsrl.config import load_config
from dsrl.rewards import FAILURE_COUNTS, RewardScorer
from dsrl.rewards import scorer as scorer_module
from dsrl.tracking.console import ProgressConsole
from tests.conftest import QUICKSTART, stub_file_overrides
from tests.helpers.processes import run_script, wait_gone

FALLBACK = -1.0

FAULTS = textwrap.dedent(
    """
    import json
    import os
    import sys
    import time
    import warnings

    def helper():
        return 1 / 0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kind = solution_str
        marks = os.environ.get("DSRL_TEST_MARKS")
        if marks:  # one file per worker that entered a call: the call has started
            open(os.path.join(marks, str(os.getpid())), "w").close()
        if kind == "exit3":
            sys.exit(3)
        if kind == "exit":
            sys.exit()
        if kind == "exit-text":
            sys.exit("giving up")
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "divide":
            return 1 / 0  # line: divide
        if kind == "helper":
            return helper()
        if kind == "json":
            return json.loads("{")  # line: json
        if kind == "none":
            return None
        if kind == "late-none":
            time.sleep(0.5)
            return None
        if kind == "list":
            return [1, 2]
        if kind == "hang":
            time.sleep(3600)
        if kind == "spin":
            while True:
                pass
        if kind == "spin-c":
            sum(range(10**13))  # a C loop that holds the GIL and never checks for signals
        if kind.startswith("wait "):
            time.sleep(float(kind.split()[1]))
        if kind == "chatty":
            print("print from the reward", os.getpid())
            print("stderr from the reward", file=sys.stderr)
            os.write(1, b"raw fd 1 from the reward\\n")
            warnings.warn("a warning from the reward")
        return 1.0
    """
)

BATCH_EXIT = textwrap.dedent(
    """
    import sys

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
        sys.exit(3)
    """
)


@pytest.fixture(scope="module")
def faults_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("faults") / "faults.py"
    path.write_text(FAULTS)
    return str(path)


@pytest.fixture(scope="module")
def scorer(faults_file):
    with RewardScorer(faults_file, num_workers=2, timeout_s=2.0, fallback_score=FALLBACK) as s:
        yield s


def score(scorer, responses):
    n = len(responses)
    return scorer.score_batch(["s"] * n, responses, ["a"] * n, [None] * n)


def counts_of(**nonzero) -> dict[str, int]:
    return {name: nonzero.get(name.removeprefix("reward/fail_"), 0) for name in FAILURE_COUNTS}


def line_of(marker: str) -> int:
    return next(i for i, line in enumerate(FAULTS.splitlines(), 1) if marker in line)


# ---------------------------------------------------------------- what the function did


@pytest.mark.parametrize(
    "kind, message",
    [
        ("exit3", "called sys.exit(3)"),
        ("exit", "called sys.exit()"),
        ("exit-text", "called sys.exit('giving up')"),
        ("interrupt", "raised KeyboardInterrupt"),
    ],
)
def test_exit_and_interrupt_are_reported_as_what_they_did(scorer, kind, message, caplog):
    # Before: pebble re-raised the SystemExit / KeyboardInterrupt in the trainer, which then exited.
    workers = set(scorer.worker_pids())
    scores, _, counts = score(scorer, ["a", kind, "a"])
    assert scores == [1.0, FALLBACK, 1.0] and counts == counts_of(exception=1)
    assert scorer.first_failure == message
    assert f"(exception) and scored -1; first: {message}" in caplog.text
    assert set(scorer.worker_pids()) == workers  # the worker was not killed: no crash, no replacement


def test_a_batch_function_that_exits_fails_its_rows_as_an_exception(tmp_path):
    path = tmp_path / "batch_exit.py"
    path.write_text(BATCH_EXIT)
    with RewardScorer(str(path), batch=True, num_workers=1, batch_chunk_size=2) as scorer:
        scores, _, counts = scorer.score_batch(["s"] * 3, ["a", "b", "c"], ["a"] * 3, [None] * 3)
        assert scores == [0.0] * 3 and counts == counts_of(exception=3)
        assert scorer.first_failure == "called sys.exit(3)"


def test_an_exception_is_quoted_with_the_line_of_the_reward_file(scorer):
    cases = {
        "divide": f"ZeroDivisionError: division by zero (at faults.py:{line_of('# line: divide')} in compute_score)",
        "helper": f"ZeroDivisionError: division by zero (at faults.py:{line_of('return 1 / 0')} in helper)",
        # Raised inside the json module: the user's line that called it, not json's.
        "json": "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
        f"(at faults.py:{line_of('# line: json')} in compute_score)",
    }
    for kind, message in cases.items():
        score(scorer, [kind])
        assert scorer.first_failure == message


def test_invalid_results_quote_the_value(scorer):
    score(scorer, ["none"])
    assert scorer.first_failure == "reward function returned None; it must return a number or a dict with 'score'"
    score(scorer, ["list"])
    assert scorer.first_failure.startswith("reward function returned list [1, 2];")


def test_first_failure_is_the_first_call_of_the_last_batch_to_fail(scorer):
    # Both calls start at once on the two workers; the second row's fails first.
    scores, _, counts = score(scorer, ["late-none", "exit3"])
    assert counts == counts_of(invalid=1, exception=1)
    assert scorer.first_failure == "called sys.exit(3)"
    score(scorer, ["a", "a"])
    assert scorer.first_failure is None


# ---------------------------------------------------------------- hanging and slow batches


def test_a_batch_that_hangs_on_every_call_is_cut_short(faults_file, caplog):
    # Before: ceil(256 / 2) limits one round after another, 167 s here (about 21 minutes with the 10 s default).
    n, workers, limit = 256, 2, 1.0
    with RewardScorer(faults_file, num_workers=workers, timeout_s=limit, fallback_score=FALLBACK) as scorer:
        start = time.perf_counter()
        scores, _, counts = score(scorer, ["hang"] * n)
        elapsed = time.perf_counter() - start
        assert scores == [FALLBACK] * n and counts == counts_of(timeout=n)
        assert scorer.first_failure == "the call ran past reward.timeout_s=1 s and was killed"  # one that ran
        # Eight calls ran their full limit, two at a time: four rounds, each with the start of two new workers.
        assert 4 * limit <= elapsed < 4 * (limit + 2 * scorer.startup_s) + 2 * scorer.startup_s + 5, elapsed
        assert re.search(
            r"first 8 calls of this batch all ran past reward.timeout_s=1 s .* other 24\d were cancelled", caplog.text
        )
        # The cancelled calls are gone with the old pool: the next batch is scored at once.
        start = time.perf_counter()
        assert score(scorer, ["a"] * 8) == ([1.0] * 8, {}, counts_of())
        assert time.perf_counter() - start < 3


def test_a_batch_with_scores_is_not_cut_short_even_when_its_first_rows_hang(faults_file):
    # One prompt's responses all hang (e.g. a ground truth a checker chokes on): the first rows. The calls go
    # to the workers shuffled, so scores come back early and the batch is scored to its end.
    with RewardScorer(faults_file, num_workers=2, timeout_s=1.0, fallback_score=FALLBACK) as scorer:
        scores, _, counts = score(scorer, ["hang"] * 10 + ["a"] * 10)
    assert scores == [FALLBACK] * 10 + [1.0] * 10
    assert counts == counts_of(timeout=10)


def test_a_slow_batch_says_how_far_it_got(faults_file, monkeypatch, caplog):
    monkeypatch.setattr(scorer_module, "_SLOW_BATCH_REPORT_S", 0.5)
    with RewardScorer(faults_file, num_workers=2, timeout_s=5.0) as scorer, caplog.at_level("INFO", "dsrl"):
        scores, _, counts = score(scorer, ["wait 0.4"] * 8)  # 1.6 s on two workers
    assert scores == [1.0] * 8 and counts == counts_of()
    reports = re.findall(
        r"8 calls of this batch still running after \d+ s: (\d) done \(0 timed out\), (\d) pending; "
        r"reward.timeout_s=5 s per call, 2 workers",
        caplog.text,
    )
    assert reports and all(int(done) + int(pending) == 8 and int(pending) > 0 for done, pending in reports)


# ---------------------------------------------------------------- the workers' output


def test_the_workers_output_goes_to_their_log_file(faults_file, tmp_path, capfd, caplog):
    log = tmp_path / "run" / "reward_workers_rank0.log"  # the folder does not exist yet
    with caplog.at_level("INFO", "dsrl"):
        with RewardScorer(faults_file, num_workers=1, timeout_s=1.0, log_file=log) as scorer:
            score(scorer, ["chatty"] * 5)
            score(scorer, ["hang"])  # its worker is killed; the replacement writes to the file too
            scores, _, counts = score(scorer, ["chatty"] * 5)
            assert scores == [1.0] * 5 and counts == counts_of()
    out, err = capfd.readouterr()
    assert "from the reward" not in out + err  # not on the trainer's console
    text = log.read_text()
    for line in ("print from the reward", "stderr from the reward", "raw fd 1 from the reward"):
        assert text.count(line) == 10, line
    assert len(set(re.findall(r"print from the reward (\d+)", text))) == 2  # the first worker and its replacement
    assert "UserWarning: a warning from the reward" in text
    assert caplog.text.count(f"their output goes to {log}") == 1


# ---------------------------------------------------------------- no worker outlives its trainer


@pytest.mark.parametrize("kind", ["hang", "spin", "spin-c"])
@pytest.mark.parametrize(
    "signum",
    [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSEGV],
    ids=["SIGKILL", "SIGTERM", "SIGINT", "crash-SIGSEGV"],
)
def test_no_worker_outlives_its_trainer_however_it_ends(faults_file, tmp_path, kind, signum):
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = run_script(
        f"""
        import os
        os.environ["DSRL_TEST_MARKS"] = {str(marks)!r}
        from dsrl.rewards import RewardScorer
        scorer = RewardScorer({faults_file!r}, num_workers=2, timeout_s=600)
        print(*scorer.worker_pids(), flush=True)
        scorer.score_batch(["s"] * 4, [{kind!r}] * 4, ["a"] * 4, [None] * 4)
        """,
        tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(int(p.name) for p in marks.iterdir()) == sorted(pids)  # both workers are inside a call
    proc.send_signal(signum)
    assert proc.wait(timeout=30) != 0
    assert wait_gone(pids) == []


# ---------------------------------------------------------------- reward.max_failed_steps


@pytest.fixture
def files(tmp_path):
    return stub_file_overrides(tmp_path)


def test_max_failed_steps_defaults_to_3_and_0_turns_it_off(files):
    cfg, _ = C.load_and_validate(QUICKSTART, files, 1)
    assert cfg.reward.max_failed_steps == 3
    assert "first failure" in C.SCHEMA["reward.max_failed_steps"].help
    cfg, _ = C.load_and_validate(QUICKSTART, files + ["reward.max_failed_steps=0"], 1)
    assert cfg.reward.max_failed_steps == 0


def test_a_negative_max_failed_steps_is_refused_with_the_fix(files):
    with pytest.raises(C.ConfigError) as err:
        C.load_and_validate(QUICKSTART, files + ["reward.max_failed_steps=-1"], 1)
    [violation] = err.value.violations
    assert violation.startswith("reward.max_failed_steps=-1") and "must be >= 0" in violation
    assert "set it to 3" in violation


def test_changing_max_failed_steps_does_not_block_a_resume():
    saved = ckpt.state_config(load_config(None, []), world_size=1)
    now = ckpt.state_config(load_config(None, ["reward.max_failed_steps=10"]), world_size=1)
    assert ckpt.config_differences(saved, now) == []


# ---------------------------------------------------------------- the console


def test_every_failure_kind_shows_on_the_step_line_and_the_validation_line():
    stream = io.StringIO()
    progress = ProgressConsole(4, stream=stream)
    step = {
        "critic/score/mean": 0.0,
        "reward/fail_exception": 1.0,
        "reward/fail_timeout": 2.0,
        "reward/fail_invalid": 3.0,
        "reward/fail_crash": 4.0,
    }
    val = {
        "val-core/arith/reward/mean@1": 0.0,
        "val-aux/reward/fail_exception": 0.0,
        "val-aux/reward/fail_timeout": 0.0,
        "val-aux/reward/fail_invalid": 8.0,
        "val-aux/reward/fail_crash": 0.0,
    }
    progress.log_metrics(val, step=0)
    progress.log_metrics({**step, "reward/fail_exception": 0.0}, step=1)
    progress.log_metrics({**step, **val}, step=2)
    first, step1, step2, val2 = stream.getvalue().splitlines()
    assert first.endswith("validation at step 0: val-core/arith/reward/mean@1=0 reward_invalid=8")
    assert "reward_exceptions" not in step1  # zero: not shown
    assert "score=0 reward_timeouts=2 reward_invalid=3 reward_crashes=4 eta" in step1
    assert "score=0 reward_exceptions=1 reward_timeouts=2 reward_invalid=3 reward_crashes=4 eta" in step2
    assert val2.endswith("validation at step 2: val-core/arith/reward/mean@1=0 reward_invalid=8")
