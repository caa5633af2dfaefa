"""The reward scorer's side of a worker process of :class:`dsrl.workers.pool.WorkerPool`: :func:`initialize` (the
pool's initializer) and the tasks :func:`score_rows` and :func:`score_chunk`. What every worker does whatever its
tasks (process group, parent watchdog, memory bound, log) is ``dsrl.workers.process``.

The pool starts each worker with the ``spawn`` method and without re-running the training script (see
``dsrl.workers.pool``), so a worker imports only this package, pebble and the user's file: no torch. The
initializer runs once per worker (and once per replacement of a killed one): ``process.setup``, then the
user's function loaded once. A loading error is kept (``process.keep_load_error``), not raised (pebble would
restart a worker whose initializer fails, forever); ``process.probe`` reports it so the pool fails at
construction.

Tasks return one *outcome* per row and never raise for a reward function's fault, not even for
``sys.exit`` or ``KeyboardInterrupt`` raised inside it (pebble would re-raise those in the trainer):
``("ok", score, extras)``, ``("exception", message)`` or ``("invalid", message)``. Timeouts and
crashed workers are seen by the parent (pebble's ``TimeoutError`` / ``ProcessExpired``). pebble's
workers ignore SIGINT, so a Ctrl-C in the terminal reaches the trainer alone, which decides.
"""

from __future__ import annotations

import inspect
import math
import pickle
import reprlib
import traceback
from collections.abc import Callable

from dsrl.workers import process
from dsrl.workers.process import Outcome

_fn: Callable | None = None
_batch = False


def initialize(
    custom_path: str | None,
    custom_name: str,
    batch: bool,
    math_verify_sources: tuple[str, ...],
    parent_pid: int,
    log_file: str | None,
    log_max_mb: int,
    memory_limit_mb: int,
    sandbox_fusion: dict | None,
    ready,
) -> None:
    """The reward pool's initializer: ``process.setup``, the SandboxFusion client of the code data sources
    (``sandbox_fusion``: ``dsrl.rewards.code.configure``'s arguments, or None), then the reward function loaded once."""
    global _fn, _batch
    process.setup(parent_pid, log_file, log_max_mb, memory_limit_mb, ready)
    _batch = batch
    try:
        if sandbox_fusion is not None:
            from dsrl.rewards import code

            code.configure(**sandbox_fusion)
        _fn = load_reward_function(custom_path, custom_name, batch, math_verify_sources)
    except ValueError as exc:
        process.keep_load_error(str(exc))
    except BaseException as exc:  # noqa: BLE001 -- anything the user's module does on import, SystemExit included
        message = f"custom_reward_function.path={custom_path!r}: importing it raised\n{traceback.format_exc()}"
        process.keep_load_error(message + (process.memory_hint() if isinstance(exc, MemoryError) else ""))


def load_reward_function(
    custom_path: str | None, custom_name: str, batch: bool, math_verify_sources: tuple[str, ...]
) -> Callable:
    """The function the worker calls: the built-in dispatcher, or the user's function (its signature
    checked against ``batch``). ValueError with the fix when it cannot be used."""
    from dsrl.rewards import load_custom_reward_function, make_compute_score

    if custom_path is None:
        return make_compute_score(math_verify_sources)
    fn = load_custom_reward_function(custom_path, custom_name)
    _check_signature(fn, custom_name, batch)
    return fn


def _check_signature(fn: Callable, name: str, batch: bool) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    per_row = "def {}(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"
    per_batch = "def {}(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]"
    if batch and "solution_strs" not in params:
        raise ValueError(
            f"custom_reward_function.batch=true calls {name}(data_sources=, solution_strs=, ground_truths=, "
            f"extra_infos=) with lists (verl's batch reward manager), but {name} takes {list(params)}. "
            f"Fix: define {per_batch.format(name)}, or set custom_reward_function.batch=false."
        )
    if not batch and "solution_str" not in params:
        hint = " (it looks like a batch function)" if "solution_strs" in params else ""
        raise ValueError(
            f"custom_reward_function.name={name!r} takes {list(params)}{hint}, but each row is scored with "
            f"{name}(data_source=, solution_str=, ground_truth=, extra_info=). Fix: define "
            f"{per_row.format(name)}, or set custom_reward_function.batch=true for a function of lists."
        )


@process.then_bound_log
def score_rows(rows: list[tuple]) -> list[Outcome]:
    """One outcome per ``(data_source, solution_str, ground_truth, extra_info)`` row, calling the
    per-row function with keyword arguments (verl's signature)."""
    if process.load_error() is not None:
        return [("exception", process.load_error())] * len(rows)
    outcomes = []
    for data_source, solution_str, ground_truth, extra_info in rows:
        try:
            result = _fn(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
            )
        except BaseException as exc:  # noqa: BLE001 -- a reward function's failure is a counted outcome
            outcomes.append(("exception", process.describe(exc, _fn)))
            continue
        outcomes.append(as_outcome(result))
    return outcomes


@process.then_bound_log
def score_chunk(rows: list[tuple]) -> list[Outcome]:
    """One outcome per row from ONE call of a batch function (verl's ``BatchRewardManager``:
    ``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)`` with lists, returning a list of
    floats or dicts). A call that raises or returns the wrong number of results fails every row."""
    if process.load_error() is not None:
        return [("exception", process.load_error())] * len(rows)
    data_sources, solution_strs, ground_truths, extra_infos = (list(column) for column in zip(*rows, strict=True))
    try:
        results = _fn(
            data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths, extra_infos=extra_infos
        )
    except BaseException as exc:  # noqa: BLE001
        return [("exception", process.describe(exc, _fn))] * len(rows)
    if isinstance(results, (str, bytes, dict)) or not hasattr(results, "__len__") or len(results) != len(rows):
        got = f"{len(results)} results" if hasattr(results, "__len__") else type(results).__name__
        return [
            (
                "invalid",
                f"batch reward function returned {got} for {len(rows)} rows; it must return a list, one per row",
            )
        ] * len(rows)
    return [as_outcome(result) for result in results]


def as_score(result) -> tuple[float, dict]:
    """``(score, extras)`` from a reward function's return value; ValueError if it is not usable: not
    a number (None, a string ...) or a dict with a numeric ``"score"``, or not finite."""
    extras = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without 'score' (keys: {list(result)})")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    unusable = f"reward function returned {_shown(result)}; it must return a number or a dict with 'score'"
    if result is None or isinstance(result, (str, bytes)):
        raise ValueError(unusable)
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise ValueError(unusable) from None
    if not math.isfinite(score):
        raise ValueError(f"reward function returned {score}; scores must be finite")
    return score, extras


def _shown(value) -> str:
    """``None``, ``str '1.0'``, ``list [1, 2]``: a returned value as a message quotes it (short)."""
    return "None" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


def as_outcome(result) -> Outcome:
    try:
        score, extras = as_score(result)
        if extras:
            pickle.dumps(extras)  # what cannot travel back to the trainer is an invalid result, not a crash
    except ValueError as exc:
        return ("invalid", str(exc))
    except Exception as exc:  # noqa: BLE001 -- pickling errors come in many types
        return ("invalid", f"reward function returned extras that cannot be pickled: {type(exc).__name__}: {exc}")
    return ("ok", score, extras)
