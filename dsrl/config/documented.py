"""The one way a config key is declared: a dataclass field that carries its one-line documentation."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def documented(default: Any, help: str) -> Any:
    """A dataclass field with its one-line documentation; a callable default is a default factory."""
    if callable(default):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})
