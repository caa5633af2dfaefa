"""What runs inside a tool worker process of :class:`dsrl.rollout.tools.ToolSet` (the reward scorer's
pool, ``dsrl.workers.pool``): :func:`initialize` builds the run's tools once per worker, :func:`run_call`
runs one call. No torch here. A call never raises for the tool's fault: it returns an outcome,
``("ok", text, seconds)``, ``("exception" | "invalid" | "timeout", message, seconds)``; the pool sees
timeouts past ``multi_turn.tool_timeout`` and dead workers itself.
"""

from __future__ import annotations

import asyncio
import inspect
import reprlib
import time
import traceback

from dsrl.rollout.tools.builtin import BUILTINS, ToolTimeout
from dsrl.rollout.tools.parse import truncate
from dsrl.rollout.tools.specs import MULTI_TURN_KEY, ToolSpec, import_file, load_tool_class
from dsrl.workers import process

# name -> (call(arguments, create_kwargs), the user's function a traceback should point into; None: a built-in)
_tools: dict[str, tuple] = {}
MEMORY_KEY = f"{MULTI_TURN_KEY}.tool_memory_limit_mb"
_max_length, _side = 0, "middle"


def initialize(
    specs: tuple[ToolSpec, ...],
    yaml_path: str | None,
    max_length: int,
    side: str,
    parent_pid: int,
    log_file: str | None,
    log_max_mb: int,
    memory_limit_mb: int,
    ready,
) -> None:
    """The tool pool's initializer: ``dsrl.workers.process.setup``, then every tool built once."""
    global _max_length, _side
    process.setup(
        parent_pid,
        log_file,
        log_max_mb,
        memory_limit_mb,
        ready,
        what="tool",
        memory_key=MEMORY_KEY,
    )
    _max_length, _side = max_length, side
    for spec in specs:
        try:
            _tools[spec.name] = _build(spec, yaml_path)
        except BaseException as exc:  # noqa: BLE001 -- whatever a tool's module or constructor does
            message = f"tool {spec.name!r} ({spec.source}) could not be built in a worker:\n{traceback.format_exc()}"
            process.keep_load_error(message + (process.memory_hint() if isinstance(exc, MemoryError) else ""))
            return


def _build(spec: ToolSpec, yaml_path: str | None):
    if spec.kind == "function":
        fn = getattr(import_file(spec.source), spec.name)
        return (lambda arguments, create_kwargs: fn(**arguments)), fn
    tool_class = BUILTINS.get(spec.source) or load_tool_class(spec.source, yaml_path)
    tool = tool_class(dict(spec.config), spec.schema)
    # A built-in's error needs no line of dsrl's code to point at.
    code = None if spec.source in BUILTINS else tool.execute
    return (lambda arguments, create_kwargs: tool.execute(arguments, **create_kwargs)), code


def run_call(name: str, arguments: dict, create_kwargs: dict) -> tuple:
    """Run the tool ``name`` once; its output cut to ``multi_turn.max_tool_response_length``."""
    start = time.perf_counter()
    call, code = _tools[name]
    try:
        result = call(arguments, create_kwargs)
        if inspect.iscoroutine(result):  # verl's tools are async
            result = asyncio.run(result)
    except ToolTimeout as exc:
        return "timeout", truncate(str(exc), _max_length, _side), time.perf_counter() - start
    except BaseException as exc:  # noqa: BLE001 -- SystemExit and KeyboardInterrupt inside a tool too
        message = process.describe(exc, code) if code else f"{type(exc).__name__}: {exc}"
        return "exception", truncate(message, _max_length, _side), time.perf_counter() - start
    finally:
        process.bound_log()
    text = as_text(result)
    if text is None:
        message = (
            f"tool {name!r} returned {type(result).__name__} {reprlib.repr(result)}; it must return a str "
            "(or an object with a str .text, or a (text, reward, metrics) tuple)"
        )
        return "invalid", message, time.perf_counter() - start
    return "ok", truncate(text, _max_length, _side), time.perf_counter() - start


def as_text(result) -> str | None:
    """The text of a tool's result: a str; verl's ``ToolResponse`` (an object with a str ``.text``); the
    first item of a verl-style ``(text, reward, metrics)`` tuple (reward and metrics are dropped). None
    for anything else."""
    if isinstance(result, tuple) and 1 <= len(result) <= 3:
        result = result[0]
    if isinstance(result, str):
        return result
    text = getattr(result, "text", None)
    return text if isinstance(text, str) else None
