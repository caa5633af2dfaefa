"""The slice of a run's config a ``ToolSet`` reads, for tests that start tool workers without a run."""

from __future__ import annotations

from types import SimpleNamespace


def tool_run_config(tool_config_path, **multi_turn) -> SimpleNamespace:
    """``actor_rollout_ref.rollout.multi_turn``'s tool keys (``multi_turn`` replaces the defaults) and the workers'
    log bound, as attributes."""
    values = dict(
        tool_config_path=None if tool_config_path is None else str(tool_config_path),
        function_tool_path=None,
        tool_timeout=10.0,
        max_tool_response_length=200,
        tool_response_truncate_side="middle",
        tool_memory_limit_mb=2048,
    )
    values.update(multi_turn)
    return SimpleNamespace(
        actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(multi_turn=SimpleNamespace(**values))),
        reward=SimpleNamespace(log_max_mb=64),
    )
