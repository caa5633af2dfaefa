"""What the python tool's sandbox costs per call: ``dsrl:python`` with ``config.sandbox: bubblewrap`` against
``none`` (the tool before the sandbox), in this process, without the worker pool (whose dispatch both share).

    python bench/python_tool_cost.py --calls 20

For each script (``print(6 * 7)``, and one that imports numpy), ``--calls`` calls of each variant, interleaved
(so that a loaded machine slows both alike), then the median and the 90th percentile of their wall seconds;
and the seconds the sandbox's construction took (once per tool worker: its probe runs a command).
"""

from __future__ import annotations

import argparse
import statistics
import time

from dsrl.rollout.tools.builtin import PythonInterpreter

SCRIPTS = {"print": "print(6 * 7)", "numpy": "import numpy; print(numpy.arange(6).sum())"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    start = time.perf_counter()
    tools = {"bubblewrap": PythonInterpreter({"timeout": 30, "sandbox": "bubblewrap"}, {})}
    built_s = time.perf_counter() - start
    tools["none"] = PythonInterpreter({"timeout": 30, "sandbox": "none"}, {})
    print(f"sandbox built in {built_s:.3f} s: {tools['bubblewrap'].sandbox.describe()}")
    print(f"{'script':8} {'sandbox':11} {'median s':>9} {'p90 s':>7}")
    for name, code in SCRIPTS.items():
        seconds: dict[str, list[float]] = {variant: [] for variant in tools}
        for _ in range(args.calls):
            for variant, tool in tools.items():
                start = time.perf_counter()
                tool.execute({"code": code})
                seconds[variant].append(time.perf_counter() - start)
        for variant, values in seconds.items():
            p90 = statistics.quantiles(values, n=10)[-1]
            print(f"{name:8} {variant:11} {statistics.median(values):9.3f} {p90:7.3f}")


if __name__ == "__main__":
    main()
