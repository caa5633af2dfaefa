"""One fresh process per variant of a measurement (a vLLM engine, a DeepSpeed engine: each keeps state for the
life of its process). The script runs itself again with ``FLAG VARIANT`` added; the child prints its result with
``report`` and the parent reads it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "RESULT "


def report(result: dict) -> None:
    """The child's side: its result, for ``in_children``."""
    print(MARK + json.dumps(result))


def in_children(flag: str, variants: Iterable[str]) -> list[dict]:
    """The results of this script run again with ``flag variant`` for each variant, in order; exits with the
    child's error output when one fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    results = []
    for variant in variants:
        child = subprocess.run(
            [sys.executable, sys.argv[0], *sys.argv[1:], flag, variant], env=env, capture_output=True, text=True
        )
        if child.returncode:
            sys.exit(f"{variant}: exit {child.returncode}\n{child.stderr[-3000:]}")
        [line] = [line for line in child.stdout.splitlines() if line.startswith(MARK)]
        results.append(json.loads(line.removeprefix(MARK)))
    return results
