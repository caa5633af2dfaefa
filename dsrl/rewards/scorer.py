"""Batch reward scoring in a pool of worker processes (pebble), with a time limit per call.

Why processes: a reward function (a user's, or a checker on a pathological response) can hang or hold
the GIL in C code; a thread cannot be stopped, and ``signal.alarm`` works only in the main thread and
not inside C calls. A worker process can always be killed, and a crashing function (even a segfault)
does not take the trainer down. pebble's ``ProcessPool`` kills and replaces only the worker whose task
ran past its timeout (or died), so the rest of the batch goes on in the other workers. The clock of a
task starts when a worker takes it, so K hanging calls on W workers cost about ceil(K / W) limits (plus
the start-up of the replacements), not K. A per-row function gets one task per row (the isolation
above); the parent's share of a task (pebble's scheduling and three messages) bounds cheap rules at a
few thousand rows per second (scripts/bench_rewards.py). A batch function gets one task per chunk.

A function that hangs on every input would still cost ceil(K / W) limits per batch (256 rows on 2
workers with the 10 s default: 21 minutes a step), so a batch whose first ``max(W, 8)`` calls all ran
past the limit, with not one score back, is cut short: the calls not finished are cancelled and count
as timeouts. Tasks go to the workers in a shuffled order, so those first calls come from different
prompts rather than from one prompt's responses (a ground truth that makes a checker hang). A batch
still running after 30 s logs how far it got, and again every 30 s.

Output: with ``log_file`` the workers' stdout and stderr (file descriptors 1 and 2: prints, warnings,
tracebacks, C libraries) are appended to that file, not the trainer's console; past ``log_max_mb`` it is
rotated to ``<log_file>.1`` (``dsrl.workers.process``). Memory: each worker, and every process it starts,
is bounded by ``memory_limit_mb`` (``RLIMIT_DATA``); a call past it fails and is counted (a
``MemoryError`` as an exception, a worker that dies of it as a crash), both messages naming the key.

The pool itself (spawn without the training script, process groups killed with their worker, workers
that die with the trainer) is ``dsrl.workers.pool``, shared with the rollout's tools.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import time

from dsrl.rewards import worker
from dsrl.workers.pool import WorkerPool, default_num_workers

logger = logging.getLogger(__name__)

# Failure kinds, in the order the counts are returned (every rank returns the same keys in the same order).
FAILURE_KINDS = ("exception", "timeout", "invalid", "crash")
FAILURE_COUNTS = tuple(f"reward/fail_{kind}" for kind in FAILURE_KINDS)
# Calls in a row that ran past the limit, none scoring, that cut a batch short (at least one per worker):
# with the tasks shuffled, a batch in which half the rows hang is cut short with probability 1/256.
_HANG_EVIDENCE_CALLS = 8
_SLOW_BATCH_REPORT_S = 30.0  # a batch running this long says how far it got, and again every as long


# ---------------------------------------------------------------- the scorer


class RewardScorer:
    """Scores batches of responses with the built-in dispatcher or a user function, in a process pool.

    Args:
        custom_path: ``custom_reward_function.path``; None uses the built-in dispatcher
            (``dsrl.rewards.compute_score``, with ``math_verify_sources`` scored by Math-Verify).
        custom_name: ``custom_reward_function.name``, the function to load from ``custom_path``.
        batch: ``custom_reward_function.batch``: the function takes lists (``data_sources,
            solution_strs, ground_truths, extra_infos``) and returns a list, as verl's batch reward
            manager calls it; each call gets one chunk of the batch.
        num_workers: worker processes; None = :func:`default_num_workers`.
        timeout_s: time limit of one call (one row, or one chunk of a batch function) in seconds.
        fallback_score: the score of a row whose call failed.
        batch_chunk_size: rows per call of a batch function; None = the batch split evenly over the workers.
        math_verify_sources: data sources the built-in dispatcher scores with Math-Verify.
        log_file: where the workers' stdout and stderr go (appended; its folder is created); None = the
            trainer's own stdout and stderr.
        log_max_mb: ``log_file`` is rotated to ``<log_file>.1`` past this many MB; 0 = never.
        memory_limit_mb: the ``RLIMIT_DATA`` of every worker and of each process it starts; 0 = none.
        sandbox_fusion: ``reward.sandbox_fusion``'s ``{url, max_concurrent, memory_limit_mb}``: each worker builds
            the client the code data sources run on (``dsrl.rewards.code``); None = no server.

    Raises ValueError at construction when the custom file or function is missing, its import fails,
    its signature does not fit ``batch``, or math-verify is needed and not installed, so a broken reward
    shows up before training starts. Use as a context manager or call :meth:`close` (done at exit
    otherwise); the workers also die with this process (see the module doc).
    """

    def __init__(
        self,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
        *,
        batch: bool = False,
        num_workers: int | None = None,
        timeout_s: float = 10.0,
        fallback_score: float = 0.0,
        batch_chunk_size: int | None = None,
        math_verify_sources: tuple[str, ...] | list[str] = (),
        log_file: str | os.PathLike | None = None,
        log_max_mb: int = 64,
        memory_limit_mb: int = 4096,
        sandbox_fusion: dict | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s={timeout_s}: must be > 0 seconds")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"reward num_workers={num_workers}: must be >= 1, or None for the CPU count")
        if not math.isfinite(fallback_score):
            raise ValueError(f"reward fallback_score={fallback_score}: must be finite")
        if batch_chunk_size is not None and batch_chunk_size < 1:
            raise ValueError(f"reward batch_chunk_size={batch_chunk_size}: must be >= 1, or None")
        if log_max_mb < 0:
            raise ValueError(f"reward log_max_mb={log_max_mb}: must be >= 0 MB (0 = no limit)")
        if memory_limit_mb < 0:
            raise ValueError(f"reward memory_limit_mb={memory_limit_mb}: must be >= 0 MB (0 = no limit)")
        if batch and custom_path is None:
            raise ValueError("custom_reward_function.batch=true needs custom_reward_function.path (a batch function)")
        self.timeout_s = float(timeout_s)
        self.fallback_score = float(fallback_score)
        self.num_workers = num_workers or default_num_workers()
        self.batch = bool(batch)
        self.batch_chunk_size = batch_chunk_size
        self.log_max_mb, self.memory_limit_mb = log_max_mb, memory_limit_mb
        self.log_file = None if log_file is None else os.path.abspath(log_file)
        if self.log_file is not None:  # here, so that an unwritable place fails in the trainer, not in each worker
            os.makedirs(os.path.dirname(self.log_file), exist_ok=True)
            open(self.log_file, "a").close()
        # The message of the first failure (in time) of the last score_batch; None when every row scored.
        self.first_failure: str | None = None
        self._workers = WorkerPool(
            "reward",
            self.num_workers,
            worker.initialize,
            (
                custom_path,
                custom_name,
                self.batch,
                tuple(math_verify_sources),
                os.getpid(),
                self.log_file,
                log_max_mb,
                memory_limit_mb,
                sandbox_fusion,
            ),
            memory_limit_mb=memory_limit_mb,
            memory_key="reward.memory_limit_mb",
        )
        self.startup_s = self._workers.start()
        output = f"; their output goes to {self.log_file}" if self.log_file else ""
        logger.info("reward: %d worker processes ready in %.2f s%s", self.num_workers, self.startup_s, output)

    @classmethod
    def from_config(cls, cfg, log_file: str | os.PathLike | None = None) -> RewardScorer:
        """The scorer of a run: ``custom_reward_function.*`` and ``reward.*`` of the config; the
        workers' output goes to ``log_file``."""
        fn, reward, sandbox = cfg.custom_reward_function, cfg.reward, cfg.reward.sandbox_fusion
        return cls(
            fn.path,
            fn.name,
            batch=fn.batch,
            num_workers=reward.num_workers,
            timeout_s=reward.timeout_s,
            fallback_score=reward.fallback_score,
            batch_chunk_size=reward.batch_chunk_size,
            math_verify_sources=tuple(reward.math_verify_sources),
            log_file=log_file,
            log_max_mb=reward.log_max_mb,
            memory_limit_mb=reward.memory_limit_mb,
            sandbox_fusion=(
                None
                if sandbox.url is None
                else dict(
                    url=sandbox.url, max_concurrent=sandbox.max_concurrent, memory_limit_mb=sandbox.memory_limit_mb
                )
            ),
        )

    @property
    def _pool(self):
        """The pebble pool; None after :meth:`close`."""
        return self._workers.pebble

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._workers.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """The pids of the live workers (for tests and diagnostics)."""
        return self._workers.worker_pids()

    def score_batch(
        self, data_sources: list[str], responses: list[str], ground_truths: list, extra_infos: list[dict | None]
    ) -> tuple[list[float], dict[str, list], dict[str, int]]:
        """Score B responses (decoded text, one per row), in order.

        Returns ``(scores, extras, counts)``: ``scores`` B floats (``fallback_score`` where the call
        failed); ``extras`` maps each non-``score`` key of dict results to a list of B values (None where
        a row did not give it); ``counts`` = ``{"reward/fail_exception": n, "reward/fail_timeout": n,
        "reward/fail_invalid": n, "reward/fail_crash": n}`` (rows, always these keys in this order):
        a call that raised; ran past ``timeout_s``; returned None, a non-number, a non-finite number, a
        dict without ``score`` or unpicklable extras (a batch function: or the wrong number of results);
        killed its worker (segfault, ``os._exit``, out of memory). Each kind is also logged once as a
        warning with its first message; ``first_failure`` holds the message of the first call to fail.
        """
        n = len(responses)
        if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
            raise ValueError(
                f"score_batch: got {len(data_sources)} data_sources, {n} responses, {len(ground_truths)} "
                f"ground_truths, {len(extra_infos)} extra_infos; all must have one entry per response"
            )
        if self._pool is None:
            raise RuntimeError("score_batch after close()")
        self._replace_broken_pool()
        rows = list(zip(data_sources, responses, ground_truths, extra_infos, strict=True))
        outcomes, self.first_failure = self._run(rows)
        # pebble breaks the whole pool when a worker dies before pebble has recorded which call it took: the
        # calls in flight then fail through no fault of their own. They run once more, on a new pool; what
        # fails so again counts as a crash.
        lost = [i for i, outcome in enumerate(outcomes) if outcome[0] == "broken"]
        if lost:
            self._replace_broken_pool()
            again, _ = self._run([rows[i] for i in lost])
            for i, outcome in zip(lost, again, strict=True):
                outcomes[i] = ("crash", outcome[1]) if outcome[0] == "broken" else outcome

        scores, row_extras = [self.fallback_score] * n, [{}] * n
        failures: dict[str, list[str]] = {kind: [] for kind in FAILURE_KINDS}
        for i, outcome in enumerate(outcomes):
            if outcome[0] == "ok":
                _, scores[i], row_extras[i] = outcome
            else:
                failures[outcome[0]].append(outcome[1])
        keys = sorted({k for extra in row_extras for k in extra})
        extras = {k: [extra.get(k) for extra in row_extras] for k in keys}
        for kind, messages in failures.items():
            if messages:
                logger.warning(
                    "reward: %d of %d rows failed (%s) and scored %g; first: %s",
                    len(messages),
                    n,
                    kind,
                    self.fallback_score,
                    messages[0],
                )
        return (
            scores,
            extras,
            {name: len(failures[kind]) for name, kind in zip(FAILURE_COUNTS, FAILURE_KINDS, strict=True)},
        )

    def _replace_broken_pool(self) -> None:
        self._workers.replace_if_broken()

    def _run(self, rows: list[tuple]) -> tuple[list[tuple], str | None]:
        """One outcome per row (see ``dsrl.rewards.worker``), ``("timeout" | "crash" | "broken", message)`` added
        (``broken``: the pool broke down under the call), and the message of the first call to fail (in time: a call
        that ran, not one cancelled). Cuts short a batch that hangs and reports a slow one (the module doc)."""
        if self.batch:
            size = self.batch_chunk_size or max(1, -(-len(rows) // self.num_workers))
            task, spans = worker.score_chunk, [(i, min(i + size, len(rows))) for i in range(0, len(rows), size)]
        else:
            task, spans = worker.score_rows, [(i, i + 1) for i in range(len(rows))]
        results: dict[int, list[tuple]] = {}  # span -> its rows' outcomes
        pending = {}  # future -> span
        finished: queue.SimpleQueue = queue.SimpleQueue()  # futures as pebble's threads complete them
        for i in random.Random(len(spans)).sample(range(len(spans)), len(spans)):  # seeded: reproducible
            start, stop = spans[i]
            try:
                future = self._pool.schedule(task, (rows[start:stop],), timeout=self.timeout_s)
            except RuntimeError as exc:  # the pool broke down while scheduling
                results[i] = self._outcomes(exc, stop - start)
                continue
            pending[future] = i
            future.add_done_callback(finished.put)
        hang_evidence = max(self.num_workers, _HANG_EVIDENCE_CALLS)
        scored = timed_out = 0
        first_failure = next((o[1] for outcomes in results.values() for o in outcomes), None)  # calls refused
        start = time.monotonic()
        report_at = start + _SLOW_BATCH_REPORT_S
        while pending:
            try:
                future = finished.get(timeout=max(0.0, report_at - time.monotonic()))
            except queue.Empty:
                future = None
            if future is not None:
                i = pending.pop(future)
                results[i] = self._outcomes(future, spans[i][1] - spans[i][0])
                first_failure = first_failure or next((o[1] for o in results[i] if o[0] != "ok"), None)
                scored += any(outcome[0] == "ok" for outcome in results[i])
                timed_out += results[i][0][0] == "timeout"
            if pending and not scored and timed_out >= hang_evidence:
                message = (
                    f"not run: the first {timed_out} calls of this batch all ran past reward.timeout_s="
                    f"{self.timeout_s:g} s and none returned a score (the reward function seems to hang), "
                    f"so the other {len(pending)} were cancelled"
                )
                logger.warning("reward: %s", message)
                for i in pending.values():
                    results[i] = [("timeout", message)] * (spans[i][1] - spans[i][0])
                # A new pool: pebble would hand each queued call to a worker, then kill that worker.
                self._workers.start()
                break
            if pending and time.monotonic() >= report_at:
                logger.info(
                    "reward: %d calls of this batch still running after %.0f s: %d done (%d timed out), "
                    "%d pending; reward.timeout_s=%g s per call, %d workers",
                    len(spans),
                    time.monotonic() - start,
                    len(spans) - len(pending),
                    timed_out,
                    len(pending),
                    self.timeout_s,
                    self.num_workers,
                )
                report_at += _SLOW_BATCH_REPORT_S
        return [outcome for i in range(len(spans)) for outcome in results[i]], first_failure

    def _outcomes(self, future, size: int) -> list[tuple]:
        if isinstance(future, Exception):  # refused at scheduling
            return [("broken", f"the reward worker pool broke down: {future}")] * size
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 -- every way a task can fail is an outcome
            timeout = f"the call ran past reward.timeout_s={self.timeout_s:g} s and was killed"
            return [self._workers.failure(exc, timeout)] * size


def numeric_extras(extras: dict[str, list]) -> dict[str, list[float]]:
    """The extras that are numbers (``acc``, ``format`` ...), as floats of the rows that gave a finite
    one; text extras such as a parsed ``pred`` are left out."""
    numeric: dict[str, list[float]] = {}
    for name, values in extras.items():
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        if numbers:
            numeric[name] = numbers
    return numeric


def reward_components(
    keys: list[str], extras: dict[str, list], data_sources: list[str]
) -> tuple[list[list[float]], list[str]]:
    """gdpo's reward components: for each of B rows, the finite numbers its reward gave under ``keys``
    (``algorithm.gdpo_reward_keys``, in that order), and one problem line per key and data source whose
    rows gave none (no such key in the row's dict, a failed call, a non-number or a non-finite one)."""
    columns, problems = [], []
    for key in keys:
        values = extras.get(key) or [None] * len(data_sources)
        bad = [i for i, v in enumerate(values) if not (isinstance(v, (int, float)) and math.isfinite(v))]
        for source in sorted({data_sources[i] for i in bad}):
            rows = [i for i in bad if data_sources[i] == source]
            problems.append(
                f"algorithm.gdpo_reward_keys: the reward of data source {source!r} gave no finite number under {key!r} "
                f"for {len(rows)} of {len(values)} rows of this step (first: row {rows[0]}, {values[rows[0]]!r}); "
                f"gdpo normalises every component of every row, so the reward function must return a dict with a "
                f"number under {key!r} for each row (a failed call, counted in reward/fail_*, returns none). Fix the "
                f"reward function, or remove {key!r} from algorithm.gdpo_reward_keys"
            )
        columns.append(values)
    if problems:
        return [], problems
    return [[float(v) for v in row] for row in zip(*columns, strict=True)], []
