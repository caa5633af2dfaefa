"""Stopping a run by signal: SIGTERM, SIGINT (Ctrl-C) and SIGHUP, from the first line of a run to its last.

``RunSignals`` is installed by ``dsrl-train`` before the trainer is even imported. Where the run has a step to
finish (``RunSignals.deferred``: the training loop, its validations and checkpoints), the first signal is only
recorded: every rank finishes the step, a checkpoint is saved and the run ends with ``TrainingInterrupted``; a
second signal exits at once. Anywhere else (start-up, the validation before training, ``trainer.val_only``, the
final export) nothing is left to finish, so the signal raises ``Interrupted`` where the process is; should
library code swallow it (a bare ``except:`` in an import), it is raised again where training would begin. Either way
the process ends with code 128 + the signal number (143 SIGTERM, 130 SIGINT, 129 SIGHUP), and what was
registered with ``at_kill`` (the MLflow run marked KILLED) runs first.

``Interrupted`` is a ``BaseException``, as ``KeyboardInterrupt`` is: raised from a signal handler in the middle
of any library code, it must not be taken for that code's own error by an ``except Exception``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dsrl.runtime.phases import current_phase

logger = logging.getLogger("dsrl")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
AT_KILL_TIMEOUT_S = 5.0  # how long a second signal waits for the at_kill callbacks before the process ends


class Interrupted(BaseException):
    """A signal stopped the run at once, in ``phase`` (no checkpoint was written for it)."""

    def __init__(self, signum: int, phase: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} during {phase}")
        self.signum, self.phase = signum, phase

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class TrainingInterrupted(Interrupted):
    """A signal stopped the run after training step ``step``, whose checkpoint was saved at ``checkpoint``."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        BaseException.__init__(
            self, f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved to {checkpoint}"
        )
        self.signum, self.phase, self.step, self.checkpoint = signum, f"step {step}", step, checkpoint


class RunSignals:
    """The run's handlers of ``SIGNALS`` (see the module doc); ``signum`` is the signal recorded inside ``deferred``."""

    def __init__(self):
        self.signum = 0
        self.rank = 0
        self._raised = 0  # the signal last raised as Interrupted: the process should be on its way out
        self._deferring = False
        self._at_kill: list[Callable[[], None]] = []
        self._previous: dict[int, object] = {}

    def install(self) -> RunSignals:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def at_kill(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` before a second signal ends the process (an ``Interrupted`` leaves through the
        ``except`` and ``finally`` blocks of its callers instead)."""
        self._at_kill.append(callback)

    @contextmanager
    def deferred(self, rank: int) -> Iterator[RunSignals]:
        """Within ``with``: the first signal is recorded in ``signum`` for the loop to act on; a second one exits."""
        self.raise_swallowed()
        self.rank, self._deferring = rank, True
        try:
            yield self
        finally:
            self._deferring = False

    def raise_swallowed(self) -> None:
        """Raise again the ``Interrupted`` of a signal that library code caught and dropped."""
        if self._raised:
            raise Interrupted(self._raised, current_phase())

    def _handle(self, signum, frame) -> None:
        if not self._deferring:
            self._raised = signum
            raise Interrupted(signum, current_phase())
        if self.signum:
            self._exit_now(signum)
        self.signum = signum
        logger.warning(
            f"rank {self.rank}: {signal.Signals(signum).name} received: finishing this step, then saving "
            "a checkpoint (send it again to exit at once)",
            extra={"all_ranks": True},
        )

    def _exit_now(self, signum: int) -> None:
        """End the process with 128 + ``signum`` after the ``at_kill`` callbacks, given ``AT_KILL_TIMEOUT_S``."""

        def run_callbacks() -> None:
            for callback in self._at_kill:
                try:
                    callback()
                except Exception:  # noqa: BLE001 -- the process ends next; one failing callback must not stop the rest
                    logger.exception("while stopping")

        worker = threading.Thread(target=run_callbacks, daemon=True)
        worker.start()
        worker.join(AT_KILL_TIMEOUT_S)
        os._exit(128 + signum)
