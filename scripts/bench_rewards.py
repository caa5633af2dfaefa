"""Reward scoring throughput of ``dsrl.rewards.RewardScorer`` for 1 and N worker processes.

Two workloads, each ``--responses`` rows (default 8,192) scored in one ``score_batch`` call:

- ``io``: a custom reward that sleeps ``--io-ms`` (default 50 ms) per row, standing in for an
  I/O-bound reward (a judge model behind HTTP); it scales with the workers whatever the CPU count.
- ``gsm8k``: the built-in GSM8K rule (microseconds per row): what the pool itself costs per row.

Prints one line per (workload, workers): responses/s, seconds, the speed-up over 1 worker and the
scaling efficiency (speed-up / workers; the I/O target is >= 0.8 up to 16 workers), and the pool's
start-up time. Usage::

    python scripts/bench_rewards.py                    # N = 1, 2, 4, 8, 16; both workloads
    python scripts/bench_rewards.py --workers 1 4 --workload io --responses 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrl.rewards import RewardScorer  # noqa: E402

IO_REWARD = textwrap.dedent(
    """
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep({seconds})
        return float(solution_str.endswith(ground_truth))
    """
)


def rows(n: int) -> tuple[list, list, list, list]:
    """GSM8K-style responses, half of them right."""
    responses = [f"Step 1: {i} + {i} = {2 * i}.\n#### {2 * i if i % 2 else 2 * i + 1}" for i in range(n)]
    return ["openai/gsm8k"] * n, responses, [str(2 * i) for i in range(n)], [None] * n


def bench(workload: str, workers: int, n: int, reward_file: str | None) -> tuple[float, float]:
    """(seconds for one score_batch of n rows, pool start-up seconds)."""
    data = rows(n)
    with RewardScorer(reward_file, num_workers=workers, timeout_s=60) as scorer:
        start = time.perf_counter()
        scores, _, counts = scorer.score_batch(*data)
        seconds = time.perf_counter() - start
    if any(counts.values()) or len(scores) != n:
        raise SystemExit(f"{workload}: failures {counts}")
    if sum(scores) != n // 2:
        raise SystemExit(f"{workload}: expected {n // 2} correct rows, got {sum(scores)}")
    return seconds, scorer.startup_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--responses", type=int, default=8192)
    parser.add_argument("--io-ms", type=float, default=50.0)
    parser.add_argument("--workload", choices=["io", "gsm8k", "both"], default="both")
    args = parser.parse_args(argv)
    workloads = ["io", "gsm8k"] if args.workload == "both" else [args.workload]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"# {args.responses} responses per run, {cpus} CPUs, io = time.sleep({args.io_ms:g} ms) per row")
    print(f"{'workload':<8} {'workers':>7} {'resp/s':>9} {'seconds':>8} {'speedup':>8} {'eff':>5} {'startup_s':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        io_file = Path(tmp) / "io_reward.py"
        io_file.write_text(IO_REWARD.format(seconds=args.io_ms / 1000))
        for workload in workloads:
            base = None
            for workers in args.workers:
                reward_file = str(io_file) if workload == "io" else None
                seconds, startup = bench(workload, workers, args.responses, reward_file)
                rate = args.responses / seconds
                base = base or rate / workers  # per-worker rate of the first (smallest) N
                speedup = rate / base
                print(
                    f"{workload:<8} {workers:>7} {rate:>9.1f} {seconds:>8.2f} {speedup:>8.2f} "
                    f"{speedup / workers:>5.2f} {startup:>9.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
