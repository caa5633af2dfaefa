"""What this rank is doing now (``start-up``, ``gen``, ``validate``, ``save`` ...), for the messages that
say where something happened: a collective that timed out (``dsrl.runtime.distributed``), a signal that stopped the
run (``dsrl.runtime.signals``); and how long each phase of a step took (``PhaseTimer``). Imports nothing heavy."""

from __future__ import annotations

import time
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


class PhaseTimer:
    """Wall-clock seconds per phase of one step, as ``timing_s/<phase>``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        with in_phase(phase):  # named by a collective that times out in it
            yield
        self.seconds[f"timing_s/{phase}"] = self.seconds.get(f"timing_s/{phase}", 0.0) + time.perf_counter() - start
