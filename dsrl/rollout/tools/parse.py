"""Tool calls out of an assistant turn's text, and tool outputs cut to what the model may read."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field

from dsrl.config.names import TOOL_FORMATS

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
# Far past any real call's nesting, far below Python's recursion limit, which the arguments meet again when they
# are checked, pickled to a tool worker and logged: a degenerate "[[[[..." is a malformed call, not a crash.
MAX_NESTING = 100


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict = field(default_factory=dict)


def parse_tool_calls(text: str, format: str = "hermes") -> tuple[list[ToolCall], list[str]]:
    """The calls of one assistant turn (decoded text), in order, and one message per malformed call.

    ``hermes`` (Qwen2.5, Qwen3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    whitespace around the JSON optional, any number per turn, text around them ignored. A block is
    malformed when its JSON does not parse (nesting past ``MAX_NESTING`` levels and integers past Python's
    digit limit included), is not an object, has no string ``name``, has ``arguments`` that are not an
    object (absent = ``{}``), or the block is not closed; the message says which, for the model to read.
    verl drops such blocks with a log line; they are answered here so the model learns. No text makes it
    raise (``tests/rollout/test_tool_text_properties.py``).
    """
    if format not in TOOL_FORMATS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={format!r}: known formats: {list(TOOL_FORMATS)}")
    calls, errors = [], []
    for match in _HERMES_BLOCK.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            errors.append("the <tool_call> block is not closed: write </tool_call> after the JSON object")
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"the <tool_call> block is not valid JSON ({exc}): {_quoted(body)}")
            continue
        except RecursionError:
            errors.append(f"the <tool_call> block nests deeper than {MAX_NESTING} levels: {_quoted(body)}")
            continue
        except ValueError:  # an integer past Python's limit of digits for int(str)
            errors.append(
                f"the <tool_call> block holds a number of more than {sys.get_int_max_str_digits()} digits: "
                f"{_quoted(body)}"
            )
            continue
        if _nesting(call) > MAX_NESTING:
            errors.append(f"the <tool_call> block nests deeper than {MAX_NESTING} levels: {_quoted(body)}")
        elif not isinstance(call, dict):
            errors.append(f"the <tool_call> block must hold a JSON object, got {type(call).__name__}: {_quoted(body)}")
        elif not isinstance(call.get("name"), str):
            errors.append(f'the <tool_call> object has no "name" string: {_quoted(body)}')
        elif not isinstance(call.get("arguments", {}), dict):
            errors.append(f'the "arguments" of tool call {call["name"]!r} must be a JSON object: {_quoted(body)}')
        else:
            calls.append(ToolCall(call["name"], call.get("arguments", {})))
    return calls, errors


def _nesting(value) -> int:
    """How deeply lists and objects nest in a decoded JSON value (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _quoted(body: str, limit: int = 200) -> str:
    return body if len(body) <= limit else body[:limit] + "..."


def truncate(text: str, max_length: int, side: str) -> str:
    """``text`` cut to ``max_length`` characters as verl cuts a tool output, the cut marked: ``left`` keeps
    the end (``(truncated)...`` + the last characters), ``right`` the start (+ ``...(truncated)``),
    ``middle`` half of each around ``...(truncated)...``."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - max_length :]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half :]
