"""RewardScorer's worker pool (pebble): order, every failure kind scored and counted, time bounds, start-up
checks, no process left behind, the batch signature, extras, and the reward.* config keys."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsrl import config as C
from dsrl.checkpoint import save as ckpt
from dsrl.config import load_config
from dsrl.rewards import FAILURE_COUNTS, RewardScorer, default_num_workers
from tests.conftest import QUICKSTART, stub_file_overrides
from tests.helpers.processes import children, live, run_script

REPO = Path(__file__).resolve().parents[2]
FALLBACK = -1.0  # distinct from every score the test function returns

REWARD = textwrap.dedent(
    """
    import ctypes
    import os
    import resource
    import sys
    import time

    LOG = os.environ.get("DSRL_TEST_REWARD_LOG")
    if LOG:  # one line per import of this file: the pid that loaded it
        with open(LOG, "a") as f:
            f.write(f"{os.getpid()}\\n")

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kind = solution_str
        if kind == "raise":
            raise RuntimeError("boom")
        if kind == "sleep":
            time.sleep(60)
        if kind == "gil":
            sum(range(10**12))  # a C loop that holds the GIL and never checks for signals
        if kind.startswith("wait "):
            time.sleep(float(kind.split()[1]))
            return float(ground_truth)
        if kind == "nan":
            return float("nan")
        if kind == "inf":
            return {"score": float("inf")}
        if kind == "text":
            return "1.0"
        if kind == "none":
            return None
        if kind == "no-score":
            return {"acc": 1.0}
        if kind == "unpicklable":
            return {"score": 1.0, "callback": lambda: 0}
        if kind == "exit":
            os._exit(3)
        if kind == "segv":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            ctypes.string_at(0)
        if kind == "dict":
            return {"score": 0.5, "acc": 1.0, "source": data_source}
        if kind == "env":
            return {"score": 1.0, "torch": "torch" in sys.modules,
                    "main_file": getattr(sys.modules["__main__"], "__file__", None), "pid": os.getpid()}
        return float(solution_str == ground_truth) + (extra_info or {}).get("bonus", 0.0)
    """
)

BATCH_REWARD = textwrap.dedent(
    """
    import os

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
        if "raise" in solution_strs:
            raise RuntimeError("batch boom")
        if "short" in solution_strs:
            return [1.0]
        return [
            {"score": float(s == g), "chunk": len(solution_strs), "pid": os.getpid()} if s != "plain" else 0.25
            for s, g in zip(solution_strs, ground_truths)
        ]
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(REWARD)
    return str(path)


@pytest.fixture(scope="module")
def scorer(reward_file):
    """Two workers, a 1 s limit: shared by the failure tests, which also check the pool goes on working."""
    with RewardScorer(reward_file, num_workers=2, timeout_s=1.0, fallback_score=FALLBACK) as s:
        yield s


def score(scorer, responses, truths=None, extras=None):
    n = len(responses)
    return scorer.score_batch(["s"] * n, responses, truths or ["a"] * n, extras or [None] * n)


def counts_of(**nonzero) -> dict[str, int]:
    return {name: nonzero.get(name.removeprefix("reward/fail_"), 0) for name in FAILURE_COUNTS}


# ---------------------------------------------------------------- order, extras, counts


def test_results_come_back_in_order_with_several_workers(reward_file):
    # Row i sleeps longer the earlier it is, so the workers finish the rows in reverse order.
    n = 12
    responses = [f"wait {0.02 * (n - i)}" for i in range(n)]
    with RewardScorer(reward_file, num_workers=4, timeout_s=10) as scorer:
        scores, extras, counts = scorer.score_batch(["s"] * n, responses, [str(i) for i in range(n)], [None] * n)
    assert scores == [float(i) for i in range(n)]
    assert extras == {} and counts == counts_of()


def test_dict_results_give_extras_with_none_where_a_row_gave_none(scorer):
    scores, extras, counts = scorer.score_batch(
        ["d1", "d2", "d3"], ["a", "dict", "b"], ["a", "x", "c"], [{"bonus": 0.25}, None, None]
    )
    assert scores == [1.25, 0.5, 0.0]
    assert extras == {"acc": [None, 1.0, None], "source": [None, "d2", None]}
    assert counts == counts_of()


@pytest.mark.parametrize(
    "bad, kind",
    [
        ("raise", "exception"),
        ("sleep", "timeout"),
        ("nan", "invalid"),
        ("inf", "invalid"),
        ("text", "invalid"),
        ("none", "invalid"),
        ("no-score", "invalid"),
        ("unpicklable", "invalid"),
        ("exit", "crash"),
        ("segv", "crash"),
    ],
)
def test_each_failure_kind_scores_the_fallback_is_counted_and_the_pool_goes_on(scorer, bad, kind, caplog):
    scores, extras, counts = score(scorer, ["a", bad, "a", "a"])
    assert scores == [1.0, FALLBACK, 1.0, 1.0]
    assert counts == counts_of(**{kind: 1})
    assert f"({kind})" in caplog.text
    assert "callback" not in extras  # an unusable row gives no extras
    # The next batch is scored normally (a killed worker was replaced).
    assert score(scorer, ["a", "b", "a"]) == ([1.0, 0.0, 1.0], {}, counts_of())


def test_many_failures_in_one_batch_are_counted_by_kind(scorer):
    responses = ["raise", "exit", "nan", "a", "segv", "raise", "none", "a"]
    scores, _, counts = score(scorer, responses)
    assert scores == [FALLBACK, FALLBACK, FALLBACK, 1.0, FALLBACK, FALLBACK, FALLBACK, 1.0]
    assert counts == counts_of(exception=2, crash=2, invalid=2)
    assert list(counts) == list(FAILURE_COUNTS)  # the same keys in the same order on every rank


def test_crash_message_names_the_signal(scorer, caplog):
    score(scorer, ["segv"])
    assert "SIGSEGV" in caplog.text


def test_a_hanging_batch_is_bounded_by_the_timeout_per_round_of_workers(reward_file):
    k, w, timeout = 10, 5, 2.0
    with RewardScorer(reward_file, num_workers=w, timeout_s=timeout, fallback_score=FALLBACK) as scorer:
        start = time.perf_counter()
        scores, _, counts = score(scorer, ["sleep"] * k)
        elapsed = time.perf_counter() - start
        assert scores == [FALLBACK] * k and counts == counts_of(timeout=k)
        rounds = math.ceil(k / w)
        # At least the limit per round, and far less than K limits one after the other (20 s). Between
        # rounds the killed workers are replaced (a fresh start-up each, as measured at construction).
        timing = f"elapsed {elapsed:.2f} s, start-up {scorer.startup_s:.2f} s"
        assert rounds * timeout <= elapsed < rounds * timeout + rounds * scorer.startup_s + 3.0, timing
        assert elapsed < k * timeout / 2, timing
        assert score(scorer, ["a"]) == ([1.0], {}, counts_of())


def test_a_call_stuck_in_c_code_is_killed_at_its_limit(scorer):
    # pebble's SIGTERM handler is Python code that cannot run inside such a call (it then waits 3 s per
    # worker before SIGKILL); the scorer stops a worker with SIGKILL instead.
    start = time.perf_counter()
    scores, _, counts = score(scorer, ["gil", "a", "gil"])
    elapsed = time.perf_counter() - start
    assert scores == [FALLBACK, 1.0, FALLBACK] and counts == counts_of(timeout=2)
    assert elapsed < scorer.timeout_s + 2.5, f"elapsed {elapsed:.2f} s"


def test_rows_wait_for_a_worker_then_get_their_full_limit(reward_file):
    # 4 rows of 0.6 s on 2 workers with a 1 s limit: the 3rd and 4th rows wait 0.6 s in the queue,
    # which does not count against their limit (pebble starts the clock when a worker takes the row).
    with RewardScorer(reward_file, num_workers=2, timeout_s=1.0) as scorer:
        scores, _, counts = score(scorer, ["wait 0.6"] * 4, ["1"] * 4)
    assert scores == [1.0] * 4 and counts == counts_of()


# ---------------------------------------------------------------- start-up


@pytest.mark.parametrize(
    "content, name, match",
    [
        (None, "compute_score", r"custom_reward_function.path=.*no such file"),
        (REWARD, "nope", r"custom_reward_function.name='nope'.*\['compute_score'\]"),
        ("import not_a_module_anywhere\n", "compute_score", r"(?s)importing it raised.*ModuleNotFoundError"),
        ("def compute_score(:\n", "compute_score", r"(?s)importing it raised.*SyntaxError"),
        ("import sys\nsys.exit(2)\n", "compute_score", r"(?s)importing it raised.*SystemExit"),
        (BATCH_REWARD, "compute_score", r"looks like a batch function.*custom_reward_function.batch=true"),
    ],
)
def test_a_bad_reward_file_fails_at_construction(tmp_path, content, name, match):
    path = tmp_path / "reward.py"
    if content is not None:
        path.write_text(content)
    before = children()
    with pytest.raises(ValueError, match=match):
        RewardScorer(str(path), name, num_workers=2)
    time.sleep(0.2)
    assert live(children() - before) == []  # the pool of the failed construction is gone


def test_batch_true_needs_a_function_of_lists(reward_file):
    with pytest.raises(ValueError, match=r"batch=true calls compute_score\(data_sources=.*solution_strs"):
        RewardScorer(reward_file, batch=True, num_workers=1)
    with pytest.raises(ValueError, match="needs custom_reward_function.path"):
        RewardScorer(batch=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"num_workers": 0}, "num_workers"),
        ({"fallback_score": float("nan")}, "fallback_score"),
        ({"batch_chunk_size": 0}, "batch_chunk_size"),
    ],
)
def test_bad_arguments_fail_before_any_worker_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardScorer(**kwargs)


def test_default_num_workers_is_the_usable_cpus_at_most_16(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert default_num_workers() == 16
    monkeypatch.setenv("LOCAL_SIZE", "8")  # the deepspeed launcher's ranks on this node share the CPUs
    assert default_num_workers() == 8
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")  # not bound: the 64 CPUs are the node's
    assert default_num_workers() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert default_num_workers() == 8  # srun bound the task to its 8 CPUs: not divided again
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    assert default_num_workers() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "128")
    assert default_num_workers() == 1
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    assert default_num_workers() == 2
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert default_num_workers() == 3


def test_workers_load_the_file_once_each_without_the_training_script_or_torch(tmp_path, reward_file):
    # The parent is a script (as scripts/train.py is) that imports torch-like weight at the top: with plain
    # spawn every worker would run it again as __mp_main__.
    log, marker = tmp_path / "loads.txt", tmp_path / "main_runs.txt"
    proc = run_script(
        f"""
        import os
        with open({str(marker)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        if __name__ == "__main__":
            os.environ["DSRL_TEST_REWARD_LOG"] = {str(log)!r}
            from dsrl.rewards import RewardScorer
            with RewardScorer({reward_file!r}, num_workers=3, timeout_s=10) as scorer:
                for _ in range(2):
                    scores, extras, counts = scorer.score_batch(["s"] * 9, ["env"] * 9, ["a"] * 9, [None] * 9)
                    assert scores == [1.0] * 9, (scores, counts)
                    assert not any(extras["torch"]) and not any(extras["main_file"]), extras
                print(sorted(set(extras["pid"])), sorted(scorer.worker_pids()))
        """,
        tmp_path,
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert len(marker.read_text().split()) == 1  # the script ran once: in the parent only
    loads = log.read_text().split()
    assert len(loads) == 3 and len(set(loads)) == 3  # once per worker, three workers
    assert f"{sorted(map(int, loads))}" in out  # those workers did the scoring


# ---------------------------------------------------------------- no process left behind


def test_no_worker_is_left_after_close(reward_file):
    before = children()
    scorer = RewardScorer(reward_file, num_workers=3, timeout_s=0.5)
    score(scorer, ["a", "sleep", "exit"])  # two workers replaced along the way
    deadline = time.monotonic() + 30
    while len(scorer.worker_pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = scorer.worker_pids()
    assert len(pids) == 3 and set(pids) <= children() - before
    scorer.close()
    scorer.close()  # idempotent
    assert live(pids) == [] and live(children() - before) == []
    with pytest.raises(RuntimeError, match="after close"):
        score(scorer, ["a"])


@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_workers_end_with_the_process_that_forgot_to_close(tmp_path, reward_file, ending):
    proc = run_script(
        f"""
        from dsrl.rewards import RewardScorer
        scorer = RewardScorer({reward_file!r}, num_workers=2)
        print(*scorer.worker_pids(), flush=True)
        if {ending == "raises"}:
            raise SystemExit("training crashed")
        """,
        tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    out, _ = proc.communicate(timeout=120)
    pids = [int(p) for p in out.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live(pids) == []


def test_workers_busy_in_a_hanging_call_die_with_a_sigkilled_parent(tmp_path, reward_file):
    # pebble alone: an idle worker exits on the end of file of its task pipe, but a worker inside a call
    # outlives a SIGKILLed parent (reparented to init); PR_SET_PDEATHSIG ends it.
    proc = run_script(
        f"""
        from dsrl.rewards import RewardScorer
        scorer = RewardScorer({reward_file!r}, num_workers=2, timeout_s=600)
        print(*scorer.worker_pids(), flush=True)
        scorer.score_batch(["s"] * 3, ["sleep", "a", "sleep"], ["a"] * 3, [None] * 3)
        """,
        tmp_path,
        stdout=subprocess.PIPE,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and live(pids) == pids
    time.sleep(1.5)  # both workers are inside time.sleep(60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live(pids) == []


def test_die_with_parent_arms_the_kernel_signal_on_linux():
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only; elsewhere a watchdog thread does it")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from dsrl.workers.process import die_with_parent; print(die_with_parent(os.getppid()))",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "pdeathsig", proc.stderr


def test_a_broken_pool_is_replaced_at_the_next_batch(reward_file, caplog):
    with RewardScorer(reward_file, num_workers=2, timeout_s=5) as scorer:
        scorer._pool.stop()  # as if pebble had given up on its workers
        scorer._pool.join()
        assert score(scorer, ["a", "b"]) == ([1.0, 0.0], {}, counts_of())
        assert "starting a new one" in caplog.text


# ---------------------------------------------------------------- the batch signature


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("batch") / "batch_reward.py"
    path.write_text(BATCH_REWARD)
    return str(path)


def test_batch_function_gets_lists_in_chunks_and_its_results_in_order(batch_file):
    n = 10
    responses = [str(i) if i % 3 else "x" for i in range(n)]
    with RewardScorer(batch_file, batch=True, num_workers=2, batch_chunk_size=4) as scorer:
        scores, extras, counts = scorer.score_batch(["s"] * n, responses, [str(i) for i in range(n)], [None] * n)
    assert scores == [0.0 if i % 3 == 0 else 1.0 for i in range(n)]
    assert extras["chunk"] == [4] * 8 + [2] * 2  # chunks of 4, 4, 2 rows
    assert counts == counts_of()


def test_batch_function_default_chunks_split_the_batch_over_the_workers(batch_file):
    with RewardScorer(batch_file, batch=True, num_workers=3) as scorer:
        scores, extras, _ = scorer.score_batch(["s"] * 7, ["plain"] + ["a"] * 6, ["a"] * 7, [None] * 7)
    assert scores == [0.25] + [1.0] * 6
    assert extras["chunk"] == [None, 3, 3, 3, 3, 3, 1]  # ceil(7 / 3) = 3 rows per call; a float gives no extras


def test_a_failing_batch_call_fails_only_its_chunk(batch_file):
    with RewardScorer(batch_file, batch=True, num_workers=2, batch_chunk_size=2, fallback_score=FALLBACK) as scorer:
        scores, _, counts = scorer.score_batch(["s"] * 6, ["a", "a", "a", "raise", "short", "a"], ["a"] * 6, [None] * 6)
        assert scores == [1.0, 1.0, FALLBACK, FALLBACK, FALLBACK, FALLBACK]
        assert counts == counts_of(exception=2, invalid=2)  # a raise, then one result for two rows
        assert scorer.score_batch(["s"], ["a"], ["a"], [None])[0] == [1.0]


# ---------------------------------------------------------------- config


@pytest.fixture
def files(tmp_path):
    return stub_file_overrides(tmp_path)


def problems(overrides) -> list[str]:
    try:
        C.load_and_validate(QUICKSTART, overrides, 1)
    except C.ConfigError as err:
        return err.violations
    return []


def test_reward_keys_have_defaults_and_help(files):
    cfg, _ = C.load_and_validate(QUICKSTART, files, 1)
    assert cfg.reward.num_workers is None and cfg.reward.timeout_s == 10.0 and cfg.reward.fallback_score == 0.0
    assert cfg.reward.batch_chunk_size is None and list(cfg.reward.math_verify_sources) == []
    assert cfg.custom_reward_function.batch is False
    assert cfg.reward.memory_limit_mb == 4096 and cfg.reward.log_max_mb == 64
    for key in (
        "reward.num_workers",
        "reward.timeout_s",
        "reward.fallback_score",
        "reward.batch_chunk_size",
        "reward.math_verify_sources",
        "custom_reward_function.batch",
        "reward.memory_limit_mb",
        "reward.log_max_mb",
    ):
        assert len(C.SCHEMA[key].help.split()) >= 5, key
    assert "RLIMIT_DATA" in C.SCHEMA["reward.memory_limit_mb"].help
    assert "inherited by each process it starts" in C.SCHEMA["reward.memory_limit_mb"].help
    assert "rotated" in C.SCHEMA["reward.log_max_mb"].help


@pytest.mark.parametrize(
    "override, key, rule",
    [
        ("reward.num_workers=0", "reward.num_workers", "must be >= 1, or null"),
        ("reward.timeout_s=0", "reward.timeout_s", "must be > 0"),
        ("reward.timeout_s=-1", "reward.timeout_s", "must be > 0"),
        ("reward.fallback_score=nan", "reward.fallback_score", "finite"),
        ("custom_reward_function.batch=true", "custom_reward_function.batch", "needs custom_reward_function.path"),
        ("reward.batch_chunk_size=8", "reward.batch_chunk_size", "read only with custom_reward_function.batch=true"),
        ("reward.memory_limit_mb=255", "reward.memory_limit_mb", "must be 0 (no limit) or >= 256 MB"),
        ("reward.memory_limit_mb=-1", "reward.memory_limit_mb", "fix: set it to 4096, or 0 for no limit"),
        ("reward.log_max_mb=-1", "reward.log_max_mb", "must be >= 0 MB (0 = no limit); fix: set it to 64"),
    ],
)
def test_reward_key_rules(files, override, key, rule):
    found = problems(files + [override])
    assert len(found) == 1 and found[0].startswith(f"{key}=") and rule in found[0], found


def test_the_bounds_are_off_at_0_and_may_change_on_resume(files):
    assert problems(files + ["reward.memory_limit_mb=0", "reward.log_max_mb=0"]) == []
    assert problems(files + ["reward.memory_limit_mb=256"]) == []
    saved = ckpt.state_config(load_config(None, []), world_size=1)
    now = ckpt.state_config(load_config(None, ["reward.memory_limit_mb=8192", "reward.log_max_mb=0"]), world_size=1)
    assert ckpt.config_differences(saved, now) == []


def test_math_verify_sources_rules(files, tmp_path, monkeypatch):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    sources = "reward.math_verify_sources=[lighteval/MATH]"
    [v] = problems(files + [sources, f"custom_reward_function.path={reward}"])
    assert v.startswith("reward.math_verify_sources=") and "no effect while custom_reward_function.path" in v
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "math_verify" else True)
    [v] = problems(files + [sources])
    assert "needs the math-verify package" in v and "dsrl[math]" in v


def test_from_config_passes_every_key(files, tmp_path, batch_file):
    cfg, _ = C.load_and_validate(
        QUICKSTART,
        files
        + [
            f"custom_reward_function.path={batch_file}",
            "custom_reward_function.batch=true",
            "reward.num_workers=2",
            "reward.timeout_s=3.5",
            "reward.fallback_score=-2",
            "reward.batch_chunk_size=5",
            "reward.memory_limit_mb=1024",
            "reward.log_max_mb=3",
        ],
        1,
    )
    with RewardScorer.from_config(cfg) as scorer:
        assert (scorer.num_workers, scorer.timeout_s, scorer.fallback_score) == (2, 3.5, -2.0)
        assert (scorer.memory_limit_mb, scorer.log_max_mb) == (1024, 3)
        assert scorer.batch and scorer.batch_chunk_size == 5 and len(scorer.worker_pids()) == 2
        assert scorer.score_batch(["s"] * 2, ["a", "b"], ["a", "a"], [None] * 2)[0] == [1.0, 0.0]


def test_rows_lost_to_a_broken_pool_run_once_more(scorer, monkeypatch):
    """pebble breaks the whole pool when a worker dies before pebble recorded which call it took ("All workers
    expired"): the other calls in flight fail through no fault of theirs. They run once more on a new pool; a
    call lost twice counts as a crash."""
    run, calls = scorer._run, []

    def first_run_loses_rows(rows):
        outcomes, first = run(rows)
        calls.append([row[1] for row in rows])
        if len(calls) == 1:
            outcomes = [
                ("broken", "the reward worker pool broke down: All workers expired") if row[1] != "b" else outcome
                for row, outcome in zip(rows, outcomes, strict=True)
            ]
        return outcomes, first

    monkeypatch.setattr(scorer, "_run", first_run_loses_rows)
    assert score(scorer, ["a", "b", "a"]) == ([1.0, 0.0, 1.0], {}, counts_of())
    assert calls == [["a", "b", "a"], ["a", "a"]]  # the lost rows, once more

    calls.clear()
    monkeypatch.setattr(scorer, "_run", lambda rows: (calls.append(rows) or [("broken", "lost")] * len(rows), "lost"))
    assert score(scorer, ["a", "b"]) == ([FALLBACK, FALLBACK], {}, counts_of(crash=2))
    assert len(calls) == 2
