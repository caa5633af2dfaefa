"""The config reference that ``dsrl-train --show-keys [prefix]`` prints: every key of the typed tree in ``schema`` with
its type, default and one-line documentation, so the tree is the one source of the reference."""

from __future__ import annotations

import dataclasses
from typing import Any, Union, get_args, get_origin

from omegaconf import MISSING

from dsrl.config.keys import SCHEMA
from dsrl.config.problems import show


def _type_text(tp: Any) -> str:
    """A key's type as a reader writes it: int, float | null, list[str], dict (free-form), any."""
    if get_origin(tp) is Union:
        return " | ".join("null" if arg is type(None) else _type_text(arg) for arg in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{_type_text(get_args(tp)[0])}]"
    if tp is dict:
        return "dict (free-form: any keys)"
    if tp is Any:
        return "any"
    return tp.__name__


def describe_keys(prefix: str = "") -> list[str]:
    """One line per key that starts with ``prefix``, in the tree's order: a section as ``# key: what it holds``,
    a leaf as ``key: type = default  # help`` (``???`` marks a value every run must give)."""
    lines = []
    for key, info in SCHEMA.items():
        if not key.startswith(prefix):
            continue
        if dataclasses.is_dataclass(info.type):
            lines.append(f"# {key}: {info.help}")
        else:
            default = "??? (required)" if info.default == MISSING else show(info.default)
            lines.append(f"{key}: {_type_text(info.type)} = {default}  # {info.help}")
    return lines
