"""What a reward function starts or uses stays bounded (issue 20): the processes it starts go with its worker
(on a timeout, at close, when the worker dies), its memory is limited by ``reward.memory_limit_mb``, and the
workers' log is rotated at ``reward.log_max_mb``. Real pebble pools, processes, rlimits and files throughout."""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dsrl.rewards import FAILURE_COUNTS, RewardScorer
from dsrl.workers.pool import _WorkerContext
from tests.helpers.processes import live, run_script, wait_gone

FALLBACK = -1.0
MB = 2**20

REWARD = textwrap.dedent(
    """
    import ctypes
    import os
    import resource
    import subprocess
    import sys
    import time

    MB = 2**20

    def start_children(pids_file):
        \"\"\"A process tree as code-execution rewards make one: a Python subprocess, a fork, and a shell
        whose background job and pipeline are grandchildren. Returns once all five pids are in pids_file.\"\"\"
        python = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        shell = subprocess.Popen(
            ["sh", "-c", f"sleep 600 & echo $! >> {pids_file}; sleep 600 | sleep 600 & echo $! >> {pids_file}; wait"]
        )
        with open(pids_file, "a") as f:
            f.write(f"{python.pid}\\n{pid}\\n{shell.pid}\\n")
        deadline = time.monotonic() + 30
        while len(open(pids_file).read().split()) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kind, *args = solution_str.split()
        if kind == "tree-then-hang":
            start_children(extra_info["pids"])
            time.sleep(600)
        if kind == "tree-then-return":
            start_children(extra_info["pids"])
            return 1.0
        if kind == "tree-then-exit":
            start_children(extra_info["pids"])
            os._exit(3)
        if kind == "alloc":  # Python memory: a MemoryError past the limit
            return float(len(bytearray(int(args[0]) * MB)) == int(args[0]) * MB)
        if kind == "c-alloc":  # a C library that does not check what malloc returned
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            block = libc.malloc(int(args[0]) * MB)
            ctypes.memset(block, 1, 4096)  # NULL past the limit: SIGSEGV
            libc.free(ctypes.c_void_p(block))
            return 1.0
        if kind == "limits":  # the limit of this worker and of a process it starts
            child = subprocess.run(
                [sys.executable, "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_DATA)[0])"],
                capture_output=True, text=True, check=True,
            )
            return {"score": 1.0, "worker": resource.getrlimit(resource.RLIMIT_DATA)[0], "child": int(child.stdout)}
        if kind == "chatty":  # args[0] MB in 100 KB prints, 1 MB a second
            for _ in range(int(args[0]) * 10):
                print("x" * (100 * 1024 - 1))
                time.sleep(0.1)
            print(f"done {args[1]}")
            return 1.0
        return 1.0
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("containment") / "containment_reward.py"
    path.write_text(REWARD)
    return str(path)


def counts_of(**nonzero) -> dict[str, int]:
    return {name: nonzero.get(name.removeprefix("reward/fail_"), 0) for name in FAILURE_COUNTS}


def score(scorer, responses, extra_info=None):
    n = len(responses)
    return scorer.score_batch(["s"] * n, responses, ["a"] * n, [extra_info] * n)


def pids_in(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


# ---------------------------------------------------------------- the worker's process tree


def test_what_a_timed_out_call_started_is_killed_with_it(reward_file, tmp_path):
    pids_file = tmp_path / "pids.txt"
    with RewardScorer(reward_file, num_workers=1, timeout_s=3.0, fallback_score=FALLBACK) as scorer:
        scores, _, counts = score(scorer, ["tree-then-hang"], {"pids": str(pids_file)})
        assert scores == [FALLBACK] and counts == counts_of(timeout=1)
        pids = pids_in(pids_file)
        assert len(pids) == 5  # a subprocess, a fork, a shell and the shell's two jobs
        assert wait_gone(pids, seconds=5) == []
        assert score(scorer, ["ok"]) == ([1.0], {}, counts_of())  # the worker was replaced


def test_what_a_call_left_running_is_killed_at_close(reward_file, tmp_path):
    pids_file = tmp_path / "pids.txt"
    scorer = RewardScorer(reward_file, num_workers=2, timeout_s=30.0)
    scores, _, counts = score(scorer, ["tree-then-return"], {"pids": str(pids_file)})
    assert scores == [1.0] and counts == counts_of()
    pids = pids_in(pids_file)
    assert len(pids) == 5 and live(pids) == pids  # still running after the call returned
    scorer.close()
    assert wait_gone(pids, seconds=5) == []


def test_what_a_call_started_is_killed_when_its_worker_dies(reward_file, tmp_path):
    pids_file = tmp_path / "pids.txt"
    with RewardScorer(reward_file, num_workers=1, timeout_s=30.0, fallback_score=FALLBACK) as scorer:
        scores, _, counts = score(scorer, ["tree-then-exit"], {"pids": str(pids_file)})
        assert scores == [FALLBACK] and counts == counts_of(crash=1)
        pids = pids_in(pids_file)
        assert len(pids) == 5
        assert wait_gone(pids, seconds=5) == []


def test_a_worker_stopped_before_it_leads_a_group_is_killed_alone():
    # The moment between the start of a worker and its os.setpgrp(): there is no group of its pid to kill.
    process = _WorkerContext().Process(target=time.sleep, args=(60,))
    process.start()
    try:
        process.terminate()
        process.join(10)
        assert process.exitcode == -signal.SIGKILL
    finally:
        process.kill()  # a no-op once it has ended


# ---------------------------------------------------------------- reward.memory_limit_mb


@pytest.fixture(scope="module")
def limited(reward_file):
    with RewardScorer(reward_file, num_workers=1, timeout_s=30.0, fallback_score=FALLBACK, memory_limit_mb=512) as s:
        yield s


def test_the_limit_holds_in_the_worker_and_in_the_processes_it_starts(limited):
    scores, extras, counts = score(limited, ["limits"])
    assert scores == [1.0] and counts == counts_of()
    assert extras == {"worker": [512 * MB], "child": [512 * MB]}


def test_an_allocation_under_the_limit_succeeds(limited):
    assert score(limited, ["alloc 128"]) == ([1.0], {}, counts_of())


def test_a_memory_error_past_the_limit_is_a_counted_exception_naming_the_key(limited, caplog):
    scores, _, counts = score(limited, ["alloc 64", "alloc 2048", "alloc 64"])
    assert scores == [1.0, FALLBACK, 1.0] and counts == counts_of(exception=1)
    assert limited.first_failure.startswith("MemoryError (at containment_reward.py:")
    assert limited.first_failure.endswith("in compute_score) (reward.memory_limit_mb=512)")
    assert "(exception) and scored -1; first: MemoryError" in caplog.text


def test_a_worker_killed_by_the_limit_is_a_counted_crash_naming_the_key(limited, reward_file):
    scores, _, counts = score(limited, ["c-alloc 1024"])
    assert scores == [FALLBACK] and counts == counts_of(crash=1)
    assert limited.first_failure == (
        "the reward worker died (signal SIGSEGV) in this call "
        "(if it ran out of memory: reward.memory_limit_mb=512 bounds each worker)"
    )
    assert score(limited, ["alloc 64"]) == ([1.0], {}, counts_of())  # the replacement works, limited too
    # Without the limit the same call allocates, so the crash above was the limit's.
    with RewardScorer(reward_file, num_workers=1, timeout_s=30.0, memory_limit_mb=0) as unlimited:
        assert score(unlimited, ["c-alloc 1024"]) == ([1.0], {}, counts_of())
        [unbounded] = score(unlimited, ["limits"])[1]["worker"]
        assert unbounded == resource.getrlimit(resource.RLIMIT_DATA)[0]  # as the trainer's, untouched


def test_a_reward_file_that_cannot_load_under_the_limit_fails_at_construction_naming_the_key(tmp_path):
    path = tmp_path / "big_on_import.py"
    path.write_text("TABLE = bytearray(2**30)  # a 1 GB table built on import\n" + REWARD)
    with pytest.raises(ValueError, match=r"(?s)importing it raised.*MemoryError.*reward.memory_limit_mb=256: raise it"):
        RewardScorer(str(path), num_workers=1, memory_limit_mb=256)


# ---------------------------------------------------------------- reward.log_max_mb


def test_the_workers_log_is_rotated_and_stays_bounded_while_every_row_scores(reward_file, tmp_path):
    # 4 calls of 4 MB, two at a time, each printing for 4 s: 16 MB written in about 8 s under a 1 MB bound.
    # Checked only when a task ends, the log would hold the 8 MB of the first two calls: the workers' once a
    # second checks keep it near the bound (plus what the two write in that second).
    log = tmp_path / "reward_workers_rank0.log"
    rotated = Path(f"{log}.1")
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            sizes = 0
            for path in (rotated, log):  # the older part first: a rotation in between cannot count a part twice
                try:
                    sizes += path.stat().st_size
                except FileNotFoundError:
                    pass
            peak[0] = max(peak[0], sizes)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    with RewardScorer(reward_file, num_workers=2, timeout_s=60.0, log_file=log, log_max_mb=1) as scorer:
        sampler.start()
        try:
            scores, _, counts = score(scorer, [f"chatty 4 row{i}" for i in range(4)])
        finally:
            stop.set()
            sampler.join()
    assert scores == [1.0] * 4 and counts == counts_of()
    assert peak[0] <= 7 * MB, f"log and {rotated.name} reached {peak[0] / MB:.1f} MB"
    # The part rotated last was past the bound when renamed: one worker renamed it, not a second one the
    # fresh file after it.
    assert rotated.stat().st_size > MB
    text = log.read_text() + rotated.read_text()
    assert "(reward.log_max_mb=1): the earlier output is in" in text
    assert "done row" in text  # the latest output is kept


def test_workers_that_find_the_log_too_large_together_rotate_it_once(tmp_path):
    # Two workers' once a second checks find the log past its bound while a third (the test) holds its lock
    # and rotates it. When the lock is theirs, the file they write is no longer at the path: they reopen the
    # path. Renaming it again would put the third one's fresh file in place of the rotated part.
    log = tmp_path / "reward_workers_rank0.log"
    rotated = Path(f"{log}.1")
    old_part = "old output\n" * (MB // 10 + 1)  # past the 1 MB bound
    log.write_text(old_part)
    script = f"""
        import os, time
        from dsrl.rewards import worker
        worker.initialize(None, "compute_score", False, (), os.getppid(), {str(log)!r}, 1, 0, None, None)
        first, deadline = os.fstat(1), time.monotonic() + 60
        while os.path.samestat(os.fstat(1), first) and time.monotonic() < deadline:  # the watcher moves fd 1
            time.sleep(0.02)
        print(os.getpid(), "writes to the new log")
    """
    with open(log, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        workers = [run_script(script, tmp_path) for _ in range(2)]
        deadline = time.monotonic() + 60
        while not {str(w.pid) for w in workers} <= waiting_for_a_lock() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {str(w.pid) for w in workers} <= waiting_for_a_lock(), "the workers did not find the log too large"
        os.replace(log, rotated)
        log.write_text("rotated by the test\n")
        fcntl.flock(held, fcntl.LOCK_UN)
    assert [w.wait(timeout=60) for w in workers] == [0, 0]
    assert rotated.read_text() == old_part
    assert sorted(log.read_text().splitlines()) == sorted(
        ["rotated by the test"] + [f"{w.pid} writes to the new log" for w in workers]
    )


def waiting_for_a_lock() -> set[str]:
    """The pids (text) waiting for a file lock: the lines of /proc/locks marked ``->``."""
    return {line.split()[5] for line in Path("/proc/locks").read_text().splitlines() if " -> " in line}


def test_without_a_bound_the_log_is_not_rotated(reward_file, tmp_path):
    log = tmp_path / "reward_workers_rank0.log"
    with RewardScorer(reward_file, num_workers=1, timeout_s=60.0, log_file=log, log_max_mb=0) as scorer:
        assert score(scorer, ["chatty 2 row0"])[0] == [1.0]
    assert log.stat().st_size > 2_000_000 and not Path(f"{log}.1").exists()  # 20 prints of 100 KB


def test_negative_bounds_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"log_max_mb=-1: must be >= 0"):
        RewardScorer(log_max_mb=-1)
    with pytest.raises(ValueError, match=r"memory_limit_mb=-1: must be >= 0"):
        RewardScorer(memory_limit_mb=-1)
