"""``RunSignals`` outside the training loop: a signal raises ``Interrupted`` where the process is, and one that
library code swallows (a bare ``except:`` around an import) is raised again where training would begin."""

from __future__ import annotations

import os
import signal

import pytest

from dsrl.runtime.phases import in_phase
from dsrl.runtime.signals import Interrupted, RunSignals


@pytest.fixture
def signals(monkeypatch):
    monkeypatch.setattr(
        "dsrl.runtime.phases._phase", "start-up"
    )  # an exception leaves its phase named: restore it after
    handlers = RunSignals().install()
    yield handlers
    handlers.restore()


def test_a_signal_outside_the_loop_raises_interrupted_naming_the_phase(signals):
    with pytest.raises(Interrupted) as raised, in_phase("export"):
        os.kill(os.getpid(), signal.SIGHUP)
    assert (raised.value.signum, raised.value.phase, raised.value.exit_code) == (signal.SIGHUP, "export", 129)


def test_a_swallowed_signal_is_raised_again_before_the_loop_defers_signals(signals):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except BaseException:  # what a bare except in a library's import does
        pass
    with pytest.raises(Interrupted) as raised, signals.deferred(rank=0):
        pass
    assert (raised.value.signum, raised.value.phase) == (signal.SIGTERM, "start-up")


def test_without_a_signal_the_loop_starts_and_a_signal_in_it_is_only_recorded(signals):
    signals.raise_swallowed()  # nothing to raise
    with signals.deferred(rank=0):
        os.kill(os.getpid(), signal.SIGINT)
    assert signals.signum == signal.SIGINT
