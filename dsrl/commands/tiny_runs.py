"""What dsrl's comparisons on a CPU share (``dsrl-compare``, ``scripts/compare_*.py``): the tiny model and its task
built where the CPU overlays look for them when missing, a training run in a child process, a Markdown table.

The model and data come from the source checkout's ``scripts/make_tiny_model.py`` and ``scripts/prepare_data.py``
(as ``scripts/quickstart.sh`` builds them); an installed package without the checkout asks for them to be built.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from dsrl.runtime.signals import SIGNALS

CHECKOUT = Path(__file__).resolve().parents[2]  # the source checkout dsrl is imported from
# task: (model directory, data directory), relative to the working directory, as configs/cpu.yaml and
# configs/calculator_cpu.yaml name them
TINY_INPUTS = {
    "arithmetic": (Path("outputs") / "tiny_model", Path("outputs") / "data" / "arithmetic"),
    "calculator": (Path("outputs") / "tiny_tool_model", Path("outputs") / "data" / "calculator"),
}


def build_tiny_inputs(root: Path, task: str = "arithmetic") -> None:
    """The tiny model of ``task`` (``arithmetic``: the quickstart's; ``calculator``: the tool model) and its prompts
    under ``root``, each built with the checkout's scripts when missing. Raises FileNotFoundError, with the
    commands to run, when they are missing and the scripts are not there."""
    model, data = TINY_INPUTS[task]
    model_args = ["--out", str(model)] + (["--task", task] if task != "arithmetic" else [])
    wanted = [
        (root / model / "config.json", "make_tiny_model.py", model_args),
        (root / data / "train.parquet", "prepare_data.py", ["--task", task, "--out", str(data)]),
    ]
    for marker, script, args in wanted:
        if marker.is_file():
            continue
        path = CHECKOUT / "scripts" / script
        if not path.is_file():
            raise FileNotFoundError(
                f"{marker.parent} is missing and {path} is not there to build it (dsrl is installed without its "
                f"source checkout); fix: run python scripts/{script} {' '.join(args)} in a dsrl checkout, from {root}"
            )
        subprocess.run([sys.executable, str(path), *args], cwd=root, check=True)


class ChildRuns:
    """The runs a command has started and not yet waited for, so that a signal to the command reaches them: within
    ``with ChildRuns() as runs:``, a SIGTERM, SIGINT or SIGHUP is passed on to every run in flight (each stops as
    ``dsrl-train`` does on that signal) and to any run started after it; ``signum`` records it, for the command to
    start no more runs and to exit with 128 + it. Without this, a signal sent to the command's pid alone (``kill``,
    a scheduler that signals one process) ended the command and left its runs training, orphaned."""

    def __init__(self):
        self.signum = 0
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()  # taken by the runs' threads and the handler (the main thread)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ChildRuns:
        self._previous = {signum: signal.signal(signum, self._forward) for signum in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    # os.kill, not Popen.send_signal, which polls and so may reap the child its thread waits for. A child in
    # _running is alive or a zombie not yet reaped (run_logged reaps it after ended): its pid is still its own.
    def _forward(self, signum: int, frame) -> None:
        with self._lock:
            self.signum = self.signum or signum
            for child in self._running:
                os.kill(child.pid, signum)

    def started(self, child: subprocess.Popen) -> None:
        with self._lock:
            self._running.add(child)
            if self.signum:  # the signal came while it was starting
                os.kill(child.pid, self.signum)

    def ended(self, child: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(child)


def run_logged(
    args: list[str], log: Path, *, cwd: Path, env: dict[str, str] | None = None, runs: ChildRuns | None = None
) -> tuple[int, os.struct_rusage]:
    """Run ``args`` in a child process with its output (stdout and stderr) in ``log``; its exit code and resource
    use (``os.wait4``: ``ru_maxrss`` is the peak resident memory of it and of the children it waited for). With
    ``runs``, a signal to this process is passed on to the child (``ChildRuns``)."""
    with log.open("w") as sink:
        child = subprocess.Popen(args, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        if runs is not None:
            runs.started(child)
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: no signal reaches another
            runs.ended(child)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return child.returncode, usage


def markdown_table(rows: list[dict]) -> str:
    """The rows (dicts with the same keys, the columns) as a Markdown table; floats with 3 significant digits,
    or as whole numbers with thousands separators from 100 up."""

    def cell(value) -> str:
        if not isinstance(value, float):
            return str(value)
        return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"

    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
