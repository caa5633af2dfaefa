"""The run's tools and the pool of worker processes that runs their calls (the reward scorer's pool)."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import wait
from dataclasses import dataclass, field

from dsrl.config.loading import tool_config_file
from dsrl.config.names import TRUNCATE_SIDES
from dsrl.rollout.tools import worker
from dsrl.rollout.tools.parse import ToolCall
from dsrl.rollout.tools.specs import MULTI_TURN_KEY, ToolFileError, ToolSpec, argument_problem, load_tool_specs
from dsrl.workers.pool import WorkerPool, default_num_workers

logger = logging.getLogger(__name__)

TOOL_FAILURE_KINDS = ("parse", "timeout", "exception", "crash", "invalid")


@dataclass(frozen=True)
class ToolRequest:
    """A call to run, with the row's ``extra_info["tools_kwargs"]`` (verl's field: ``{tool name:
    {"create_kwargs": {...}}}``; a class tool's ``execute`` gets its ``create_kwargs`` as keywords)."""

    call: ToolCall
    tools_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What the model is shown (the output, cut; or the error), the failure kind (one of
    ``TOOL_FAILURE_KINDS``) or None, and the seconds the call took."""

    text: str
    failure: str | None = None
    seconds: float = 0.0


class ToolSet:
    """The tools of a run, their calls run in worker processes, each under ``tool_timeout`` seconds.

    Args:
        specs: the tools (``dsrl.rollout.tools.specs.load_tool_specs``).
        tool_timeout: seconds one call may run; past it the worker is killed with its process group.
        max_tool_response_length, tool_response_truncate_side: an output longer than this many characters
            is cut on this side (left | right | middle), the cut marked.
        yaml_path: the tool YAML (``file.py:Class`` names are relative to its folder).
        num_workers: worker processes; None = :func:`dsrl.rewards.default_num_workers`.
        log_file, log_max_mb: where the workers' output goes, rotated past this many MB.
        memory_limit_mb: ``RLIMIT_DATA`` of each worker and the processes it starts; 0 = none.

    Raises ValueError when a worker cannot build a tool. Use as a context manager or :meth:`close`.
    """

    def __init__(
        self,
        specs: list[ToolSpec],
        *,
        tool_timeout: float,
        max_tool_response_length: int,
        tool_response_truncate_side: str,
        yaml_path: str | None = None,
        num_workers: int | None = None,
        log_file: str | os.PathLike | None = None,
        log_max_mb: int = 64,
        memory_limit_mb: int = 4096,
    ):
        if not tool_timeout > 0:
            raise ValueError(f"{MULTI_TURN_KEY}.tool_timeout={tool_timeout}: must be > 0 seconds")
        if max_tool_response_length < 1:
            raise ValueError(
                f"{MULTI_TURN_KEY}.max_tool_response_length={max_tool_response_length}: must be >= 1 character"
            )
        if tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(
                f"{MULTI_TURN_KEY}.tool_response_truncate_side={tool_response_truncate_side!r}: must be one of "
                f"{list(TRUNCATE_SIDES)}"
            )
        if not specs:
            raise ValueError(f"{MULTI_TURN_KEY}: no tools; set tool_config_path and/or function_tool_path")
        self.tool_timeout = float(tool_timeout)
        self._specs = {spec.name: spec for spec in specs}
        self.schemas = [spec.schema for spec in specs]
        log_file = None if log_file is None else os.path.abspath(log_file)
        if log_file is not None:  # here, so that an unwritable place fails in the trainer, not in each worker
            os.makedirs(os.path.dirname(log_file), exist_ok=True)
            open(log_file, "a").close()
        self._workers = WorkerPool(
            "tool",
            num_workers or default_num_workers(),
            worker.initialize,
            (
                tuple(specs),
                yaml_path,
                max_tool_response_length,
                tool_response_truncate_side,
                os.getpid(),
                log_file,
                log_max_mb,
                memory_limit_mb,
            ),
            memory_limit_mb=memory_limit_mb,
            memory_key=worker.MEMORY_KEY,
        )
        self.startup_s = self._workers.start()
        logger.info(
            "tools %s: %d worker processes ready in %.2f s",
            sorted(self._specs),
            self._workers.num_workers,
            self.startup_s,
        )

    @classmethod
    def from_config(cls, cfg, log_file: str | os.PathLike | None = None) -> ToolSet:
        """The tools of a run: ``actor_rollout_ref.rollout.multi_turn.*``; the workers' log rotates at
        ``reward.log_max_mb``. ValueError with every problem of the tool files."""
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        specs, problems = load_tool_specs(multi_turn)
        if problems:
            raise ToolFileError(problems)
        return cls(
            specs,
            tool_timeout=multi_turn.tool_timeout,
            max_tool_response_length=multi_turn.max_tool_response_length,
            tool_response_truncate_side=multi_turn.tool_response_truncate_side,
            yaml_path=multi_turn.tool_config_path and tool_config_file(multi_turn.tool_config_path),
            log_file=log_file,
            log_max_mb=cfg.reward.log_max_mb,
            memory_limit_mb=multi_turn.tool_memory_limit_mb,
        )

    def close(self) -> None:
        """Stop the workers, each with its process group (idempotent)."""
        self._workers.close()

    def __enter__(self) -> ToolSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """The pids of the live workers (for tests and diagnostics)."""
        return self._workers.worker_pids()

    def run(self, requests: list[ToolRequest]) -> list[ToolResult]:
        """One result per request, in order; the calls run in parallel on the workers. Never raises for a
        tool's fault: an unknown tool or arguments that do not fit its schema (``parse``, checked here),
        a call past ``tool_timeout`` (``timeout``), one that raised (``exception``), killed its worker
        (``crash``) or returned no text (``invalid``) gives an error text and its failure kind."""
        if self._workers.pebble is None:
            raise RuntimeError("ToolSet.run after close()")
        results: list[ToolResult | None] = [None] * len(requests)
        todo = []
        for i, request in enumerate(requests):
            problem = self._problem(request.call)
            if problem:
                results[i] = ToolResult(problem, "parse")
            else:
                todo.append(i)
        self._workers.replace_if_broken()
        outcomes = self._dispatch([requests[i] for i in todo])
        # A worker that dies before pebble recorded its call breaks the whole pool: the calls in flight
        # run once more on a new one; what fails so again counts as a crash.
        lost = [j for j, outcome in enumerate(outcomes) if outcome[0] == "broken"]
        if lost:
            self._workers.replace_if_broken()
            for j, outcome in zip(lost, self._dispatch([requests[todo[j]] for j in lost]), strict=True):
                outcomes[j] = ("crash", *outcome[1:]) if outcome[0] == "broken" else outcome
        for i, (kind, text, seconds) in zip(todo, outcomes, strict=True):
            name = requests[i].call.name
            if kind == "ok":
                results[i] = ToolResult(text, None, seconds)
            else:
                results[i] = ToolResult(f"Error executing tool {name!r}: {text}", kind, seconds)
        return results

    def _problem(self, call: ToolCall) -> str | None:
        spec = self._specs.get(call.name)
        if spec is None:
            return f"Unknown tool {call.name!r}; the tools are {sorted(self._specs)}"
        return argument_problem(spec.schema, call.arguments)

    def _dispatch(self, requests: list[ToolRequest]) -> list[tuple]:
        """``(kind, text, seconds)`` per request; ``broken``: the pool broke down under the call."""
        futures, started = [], time.perf_counter()
        for request in requests:
            name = request.call.name
            create_kwargs = ((request.tools_kwargs or {}).get(name) or {}).get("create_kwargs") or {}
            try:
                futures.append(
                    self._workers.pebble.schedule(
                        worker.run_call, (name, request.call.arguments, create_kwargs), timeout=self.tool_timeout
                    )
                )
            except RuntimeError as exc:  # the pool broke down while scheduling
                futures.append(exc)
        wait([f for f in futures if not isinstance(f, Exception)])
        timeout = f"ran past {MULTI_TURN_KEY}.tool_timeout={self.tool_timeout:g} s and was stopped"
        outcomes = []
        for future in futures:
            if isinstance(future, Exception):
                outcomes.append(("broken", f"the tool worker pool broke down: {future}", 0.0))
                continue
            try:
                outcomes.append(future.result())
            except Exception as exc:  # noqa: BLE001 -- every way a task can fail is an outcome
                kind, message = self._workers.failure(exc, timeout)
                seconds = self.tool_timeout if kind == "timeout" else time.perf_counter() - started
                outcomes.append((kind, message, seconds))
        return outcomes
