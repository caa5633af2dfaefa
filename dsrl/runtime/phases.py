"""What this rank is doing now (``start-up``, ``gen``, ``validate``, ``save`` ...), for the messages that
say where something happened: a collective that timed out (``dsrl.runtime.distributed``), a signal that stopped the
run (``dsrl.runtime.signals``). Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_phase = "start-up"


@contextmanager
def in_phase(name: str) -> Iterator[None]:
    """Within ``with``: this rank is in phase ``name`` (the outer phase again after it)."""
    global _phase
    outer, _phase = _phase, name
    yield
    _phase = outer  # skipped by an exception: the phase it was raised in stays named for the error message


def current_phase() -> str:
    return _phase
