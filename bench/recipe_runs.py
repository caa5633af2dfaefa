"""Training runs of a recipe's CPU command for the learning benches (bench/distillation.py, bench/reward_model.py):
arms (overrides) x seeds, each run in a child process on one thread, tracked into one MLflow store, its metrics read
back by step; and scripts/make_tiny_model.py as a module, for the benches that measure its models."""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_tiny_model():
    """scripts/make_tiny_model.py as a module (its prompt format, training loop, greedy accuracy, reward-model
    scoring)."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(
    recipe: list[str], name: str, overrides: list[str], *, steps: int, experiment: str, out: Path, runs
) -> tuple[str, int, float]:
    """``scripts/train.py`` on ``recipe`` (config files, left to right) and ``overrides`` for ``steps`` steps in a
    child process, tracked as run ``name`` of ``experiment`` into ``out``/mlflow.db, its output in
    ``out``/runs/``name``.log: (name, exit code, wall seconds). ``runs``: the ``ChildRuns`` it registers with."""
    from dsrl.commands.tiny_runs import run_logged

    command = [
        sys.executable, "scripts/train.py", *recipe, *overrides,
        f"trainer.total_training_steps={steps}", "trainer.logger=[console,mlflow]",
        f"trainer.project_name={experiment}", f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={out / 'runs' / name}",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    begin = time.perf_counter()
    code, _ = run_logged(command, out / "runs" / f"{name}.log", cwd=ROOT, env=env, runs=runs)
    return name, code, time.perf_counter() - begin


def history(client, run_id: str, key: str) -> dict[int, float]:
    """A dsrl metric of one run by step (``key`` as dsrl names it; MLflow stores it under ``compare.mlflow_name``)."""
    from dsrl.commands import compare

    return {m.step: m.value for m in client.get_metric_history(run_id, compare.mlflow_name(key))}


def arguments(
    description: str, arms: list[str], seeds: list[int], out: str, argv: list[str] | None
) -> argparse.Namespace:
    """A bench's command line: the overrides of every run, ``--arms`` (of ``arms``), ``--seeds``, ``--steps``,
    ``--jobs``, ``--out`` and ``--report-only``; the defaults are every arm, ``seeds`` and ``out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    parser.add_argument("--arms", type=lambda text: text.split(","), default=arms, help=", ".join(arms))
    parser.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",")], default=seeds)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--out", default=out)
    parser.add_argument("--report-only", action="store_true", help="read the runs already in --out")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.arms) - set(arms))
    if unknown:
        parser.error(f"--arms {','.join(unknown)}: unknown; one of {', '.join(arms)}")
    args.out = (ROOT / args.out).resolve()
    return args


def train_arms(
    recipe: list[str], arms: dict[str, list[str]], args: argparse.Namespace, experiment: str
) -> tuple[dict[tuple[str, int], str], int]:
    """Each arm of ``args.arms`` (its overrides in ``arms``) with each seed of ``args.seeds`` (``trainer.seed``), the
    command line's overrides last, ``args.jobs`` runs at a time (none with ``--report-only``): the run names by
    ``(arm, seed)`` and the first failed run's exit code (0 when none failed)."""
    from dsrl.commands.tiny_runs import ChildRuns

    out = args.out
    (out / "runs").mkdir(parents=True, exist_ok=True)
    names = {(arm, seed): f"{arm}-seed{seed}" for arm in args.arms for seed in args.seeds}
    if args.report_only:
        return names, 0
    begin = time.perf_counter()
    with ChildRuns() as runs, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [
            pool.submit(
                train,
                recipe,
                name,
                [*arms[arm], f"trainer.seed={seed}", *args.overrides],
                steps=args.steps,
                experiment=experiment,
                out=out,
                runs=runs,
            )
            for (arm, seed), name in names.items()
        ]
        for job in jobs:
            name, code, wall = job.result()
            print(f"{name}: exit {code} in {wall:.0f} s (log {out / 'runs' / name}.log)", flush=True)
            if code != 0:
                return names, code
    print(f"all runs: {time.perf_counter() - begin:.0f} s wall", flush=True)
    return names, 0


def tracking(out: Path, experiment: str):
    """The MLflow client of ``out``/mlflow.db and the id of ``experiment`` in it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    return client, client.get_experiment_by_name(experiment).experiment_id


def median_after_first(client, run_id: str, key: str) -> float:
    """A per-step metric's median over steps 2.. (the first includes one-off warm-up)."""
    return statistics.median(v for s, v in history(client, run_id, key).items() if s > 1)


def curve(
    found: dict[str, dict[int, dict]], key: str, seeds: list[int], steps: int, labels: tuple[str, str]
) -> tuple[list[str], dict[str, list[str]]]:
    """A validation metric's columns and each arm's cells (``found``: arm -> seed -> figures, ``key`` the figure
    holding the metric by step): at step 0 and at ``steps`` the mean over the seeds ± the half-width of the 95%
    Student-t interval (as dsrl-compare reports), the means at the validations between, and each seed's last.
    ``labels``: the first and the last columns' names before their step."""
    from dsrl.commands import compare

    val_steps = sorted({s for runs in found.values() for run in runs.values() for s in run[key]})
    between = [s for s in val_steps if 0 < s < steps]
    columns = ["arm", f"{labels[0]}step 0", *(f"step {s}" for s in between), f"{labels[1]}step {steps}", "each seed"]
    cells = {}
    for arm, runs in found.items():
        at = {step: [runs[seed][key].get(step, float("nan")) for seed in seeds] for step in val_steps}
        cells[arm] = [compare.cell(*compare.t_interval(at[0])), *(f"{statistics.fmean(at[s]):.3f}" for s in between)]
        cells[arm] += [compare.cell(*compare.t_interval(at[steps])), ", ".join(f"{v:.3f}" for v in at[steps])]
    return columns, cells


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    """A markdown table."""
    print("\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
