"""Batch reward scoring in a worker process, with a time limit per call.

Why a process: a reward function (a user's, or a checker on a pathological response) can hang or
hold the GIL in C code; a thread cannot be stopped and ``signal.alarm`` works only in the main
thread and not inside C calls. A child process can always be killed, works the same under the
``deepspeed`` launcher as in a plain script, and keeps a crashing function (even a segfault) from
taking the trainer down. The child is started with ``python -m dsrl.rewards.worker`` (not
``multiprocessing`` spawn, which would re-import the training script and torch).

Protocol: the parent sends the batch once; the worker replies once per call, in order. The parent
waits at most ``timeout_s`` for each reply; on a timeout it kills the worker, scores that call 0,
starts a new worker and resends the rest of the batch.
"""

import logging
import math
import os
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

logger = logging.getLogger(__name__)

# Python start-up plus loading the user's file; a worker that is not ready by then is broken.
_STARTUP_TIMEOUT_S = 60.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class RewardScorer:
    """Scores batches of responses with the built-in dispatcher or a user function, one worker process.

    Args:
        custom_path: ``custom_reward_function.path``; None uses ``dsrl.rewards.compute_score``.
        custom_name: ``custom_reward_function.name``, the function to load from ``custom_path``.
        timeout_s: time limit of one call in seconds; a call that exceeds it scores 0.

    Raises ValueError at construction when the custom file or function is missing or its import
    fails, so a broken reward shows up before training starts. Use as a context manager or call
    :meth:`close`; the worker also exits by itself when this process dies.
    """

    def __init__(self, custom_path: str | None = None, custom_name: str = "compute_score", timeout_s: float = 10.0):
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s={timeout_s}: must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self._args = [custom_path, custom_name] if custom_path is not None else []
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._start_worker()

    def _start_worker(self) -> None:
        parent_end, child_end = Pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dsrl.rewards.worker", str(child_end.fileno()), *self._args],
            pass_fds=(child_end.fileno(),),
            env=env,
        )
        child_end.close()
        self._conn = parent_end
        if not parent_end.poll(_STARTUP_TIMEOUT_S):
            self._stop_worker()
            raise RuntimeError(f"the reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            status, message = parent_end.recv()
        except EOFError:
            code = self._stop_worker()
            raise RuntimeError(
                f"the reward worker exited during start-up (exit code {code}); see its stderr above"
            ) from None
        if status != "ready":
            self._stop_worker()
            raise ValueError(message)

    def _stop_worker(self) -> int | None:
        """Kill and reap the worker; returns its exit code."""
        if self._proc is None:
            return None
        self._conn.close()
        self._proc.kill()
        code = self._proc.wait()
        self._proc, self._conn = None, None
        return code

    def close(self) -> None:
        """Stop the worker (closing the pipe makes it exit; kill it if it is stuck)."""
        if self._proc is None:
            return
        self._conn.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc, self._conn = None, None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score_batch(
        self, data_sources: list[str], responses: list[str], ground_truths: list, extra_infos: list[dict | None]
    ) -> tuple[list[float], dict[str, list], dict[str, int]]:
        """Score B responses (decoded text, one per row).

        Returns ``(scores, extras, counts)``: ``scores`` B floats (0.0 where a call raised, timed out,
        or returned something that is not a finite number or a dict with ``"score"``); ``extras``
        maps each non-``score`` key of dict results to a list of B values (None where a row did not
        give it); ``counts`` = ``{"reward/errors": n, "reward/timeouts": n}``. Errors and timeouts
        are also logged as a warning with the first message.
        """
        n = len(responses)
        if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
            raise ValueError(
                f"score_batch: got {len(data_sources)} data_sources, {n} responses, {len(ground_truths)} "
                f"ground_truths, {len(extra_infos)} extra_infos; all must have one entry per response"
            )
        calls = list(zip(data_sources, responses, ground_truths, extra_infos, strict=True))
        replies = self._run(calls)

        scores, row_extras, errors = [0.0] * n, [{}] * n, []
        timeouts = 0
        for i, (status, value) in enumerate(replies):
            if status == "timeout":
                timeouts += 1
            elif status == "error":
                errors.append(value)
            else:
                try:
                    scores[i], row_extras[i] = _as_score(value)
                except ValueError as exc:
                    errors.append(str(exc))
        keys = sorted({k for extra in row_extras for k in extra})
        extras = {k: [extra.get(k) for extra in row_extras] for k in keys}
        if errors:
            logger.warning("reward: %d of %d calls failed and scored 0; first: %s", len(errors), n, errors[0])
        if timeouts:
            logger.warning("reward: %d of %d calls exceeded %.3g s and scored 0", timeouts, n, self.timeout_s)
        return scores, extras, {"reward/errors": len(errors), "reward/timeouts": timeouts}

    def _run(self, calls: list[tuple]) -> list[tuple[str, object]]:
        """One ``(status, value)`` per call: ``("ok", result)``, ``("error", message)`` or ``("timeout", None)``."""
        replies: list[tuple[str, object]] = []
        while len(replies) < len(calls):
            if self._proc is None:
                self._start_worker()
            self._conn.send(calls[len(replies) :])
            while len(replies) < len(calls):
                if not self._conn.poll(self.timeout_s):
                    replies.append(("timeout", None))
                    self._stop_worker()
                    break
                try:
                    replies.append(self._conn.recv())
                except EOFError:
                    code = self._stop_worker()
                    replies.append(("error", f"the reward worker died (exit code {code}) while scoring this row"))
                    break
        return replies


def _as_score(result) -> tuple[float, dict]:
    """``(score, extras)`` from a reward function's return value; ValueError if it is not usable."""
    extras = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without 'score' (keys: {list(result)})")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise ValueError(
            f"reward function returned {type(result).__name__}; it must return a float or a dict with 'score'"
        ) from None
    if not math.isfinite(score):
        raise ValueError(f"reward function returned {score}; scores must be finite")
    return score, extras


def numeric_extras(extras: dict[str, list]) -> dict[str, list[float]]:
    """The extras that are numbers (``acc``, ``format`` ...), as floats of the rows that gave a finite
    one; text extras such as a parsed ``pred`` are left out."""
    numeric: dict[str, list[float]] = {}
    for name, values in extras.items():
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        if numbers:
            numeric[name] = numbers
    return numeric
