"""What a reward function starts or uses stays bounded (issue 20): the processes it starts go with its worker
(on a timeout, at close, when the worker dies). Real pebble pools and processes throughout."""

from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

import pytest

from dsrl.rewards import FAILURE_COUNTS, RewardScorer
from dsrl.rewards.scorer import _WorkerContext
from tests.process_helpers import live, wait_gone

FALLBACK = -1.0

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
