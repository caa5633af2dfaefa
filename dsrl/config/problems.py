"""How a config problem reads: a value as an override would write it, and the one line with the key, the rule
and the fix."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def show(value: Any) -> str:
    """A value as it would be written in an override: null, true, [a,b]."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return " ".join(str(value).split())


def violation(key: str, value: Any, rule: str, fix: str) -> str:
    return f"{key}={show(value)}: {rule}; fix: {fix}"
