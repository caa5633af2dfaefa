"""The ``dsrl-compare`` command: algorithms on one task, several seeds each, as MLflow runs of one experiment,
and a report.

    dsrl-compare grpo rloo opo otb --quick --seeds 1,2 --out outputs/compare          # the tiny model, CPU, ~5 min
    dsrl-compare grpo opo configs/my_otb.yaml --task my_task.yaml --steps 200 --seeds 1,2,3 --out compare/ \\
        data.train_batch_size=256                                                     # any configs, any task

Each config (a shipped recipe name or a YAML path), with the ``--task`` files merged after it and the ``key=value``
overrides after those, trains ``--steps`` steps once per seed (``trainer.seed``; the prompts and their order stay
the same for every run: ``data.seed`` is the config's), each run a ``python -m dsrl`` process of its own whose
output goes to ``OUT/runs/<config>-seed<N>.log``. Every run tracks through dsrl's MLflow logger
(``trainer.logger=[console,mlflow]``) into one store, ``OUT/mlflow.db``: experiment ``--experiment``
(``trainer.project_name``), run ``<config>-seed<N>`` (``trainer.experiment_name``). The report is read back
from that store: ``OUT/report.md``, ``OUT/report.json`` and ``OUT/curves.png`` (per step, mean over the seeds and
the band from the lowest to the highest seed: validation score, KL to the initial policy, entropy, relative
gradient variance).

What compare adds to every run, so that every config logs the same measurements:

- ``actor_rollout_ref.actor.measure_grad_variance=true``: ``actor/grad_var``, the variance across micro-batches of
  the gradient each gives of the actor's loss (the trace of the covariance of the micro-batch estimates of the
  step's gradient, from hooks that measure each backward's gradient; ``dsrl.engines.grad_variance`` defines it)
  and ``actor/grad_var_relative``, the same over the squared norm of the step's gradient (scale-free: GRPO's
  advantages are divided by the group's std, RLOO's, OPO's and OTB's are not). It shrinks as micro-batches
  grow, so the runs must share ``actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`` (``--quick`` sets it).
- A config without a KL loss gets ``actor_rollout_ref.actor.use_kl_loss=true`` with ``kl_loss_coef=0.0``: the
  reference model loads (the initial policy: ``actor_rollout_ref.model.path``, or the LoRA actor with its
  adapters off, which is the initial policy unless ``lora_adapter_path`` gave a starting adapter) and ``actor/kl_loss``
  measures KL(policy || initial policy) each step without changing the update (its gradient is multiplied by 0). It is
  the ``kl_loss_type`` estimator (default ``low_var_kl``, k3) averaged over the step's response tokens before the
  update, on the step's own samples; a config that has a KL loss keeps its coefficient and type (the report names the
  type of each).
- ``trainer.val_before_train=true``, ``trainer.test_freq=--val-every``, ``trainer.total_training_steps=--steps``
  (``trainer.total_epochs`` raised so the steps end the run), no checkpoints, no generation tables.

The report, per config (mean over seeds ± the half-width of a 95% Student-t interval, ``t(0.975, n-1) s / sqrt(n)``
with ``s`` the seeds' sample standard deviation; none from one seed): the final validation score (the last
validation, at ``--steps``; the mean over data sources of ``val-core/<source>/<var>/mean@N``), the KL to the
initial policy and the entropy (``actor/entropy``, token-mean over the step's responses) as the mean over the last
quarter of the steps, and the gradient variance, absolute and relative, as the mean over all steps.

``--quick``: the CPU quickstart's task (``--task cpu quickstart``: the tiny model on two-number sums, built in
``./outputs`` when missing as scripts/quickstart.sh does), 20 steps, validation every 5 steps on 100 prompts,
micro-batches of 32 rows (8 per step: the quickstart's 32 prompts x 8 responses); ``--steps``, ``--val-every``,
``--task`` and overrides given still win; the runs go one per CPU core (``--jobs``), each on one thread. Four
configs x two seeds took 8.6 min on our 2-core machine: bench/compare_quick/.

Exit codes: 0 done; 2 a bad argument or config (every config is validated before anything trains); 1 a run
that failed (its log named); 128 + the signal number when SIGTERM, SIGINT or SIGHUP stopped it: the signal is passed
on to the runs in flight, which stop as ``dsrl-train`` does, and no further run starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dsrl.commands.tiny_runs import ChildRuns, build_tiny_inputs, markdown_table, run_logged
from dsrl.config import ConfigError, load_and_validate
from dsrl.config.loading import config_file_path, split_files_and_overrides
from dsrl.runtime.launch import LAUNCHER_VARIABLES

QUICK_TASK = ["cpu", "quickstart"]
QUICK_STEPS, QUICK_VAL_EVERY = 20, 5
QUICK_OVERRIDES = [
    "actor_rollout_ref.actor.use_dynamic_bsz=false",  # OTB's recipe cuts by tokens: one micro-batch at this size
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "data.val_max_samples=100",
]
CONFIDENCE = 0.95
# metric: (MLflow name, how a run's per-step values become one number)
STEP_METRICS = {
    "kl_to_initial": ("actor/kl_loss", "last quarter"),
    "entropy": ("actor/entropy", "last quarter"),
    "grad_var": ("actor/grad_var", "all steps"),
    "grad_var_relative": ("actor/grad_var_relative", "all steps"),
    "train_score": ("critic/score/mean", "last quarter"),
    "step_s": ("timing_s/step", "all steps"),
}
COLUMNS = {  # report column: summary key
    "final val score": "final_score",
    "KL to initial": "kl_to_initial",
    "entropy": "entropy",
    "grad var": "grad_var",
    "grad var (relative)": "grad_var_relative",
    "train score": "train_score",
    "s/step": "step_s",
}


@dataclass
class Arm:
    """One config of the comparison: its label, files and the overrides compare adds for it."""

    label: str
    files: list[str]
    added: list[str] = field(default_factory=list)
    kl_loss_type: str = ""


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(mean, half-width) of the two-sided Student-t confidence interval of the mean of ``values``:
    ``t(1 - (1 - confidence) / 2, n - 1) * s / sqrt(n)``, ``s`` the sample standard deviation (n - 1); the
    half-width is nan for fewer than two values, and both are nan for none."""
    from scipy.stats import t

    values = [v for v in values if math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    quantile = float(t.ppf(1 - (1 - confidence) / 2, len(values) - 1))
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    parser = argparse.ArgumentParser(prog="dsrl-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "args",
        nargs="+",
        metavar="config | key=value",
        help="the configs to compare (shipped recipe names or YAML files, e.g. grpo rloo opo otb), then dotted "
        "overrides for every run",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="the folder of the runs, the MLflow store and the report"
    )
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated trainer.seed values (default 1,2,3)")
    parser.add_argument("--steps", type=int, help=f"training steps per run (--quick: {QUICK_STEPS})")
    parser.add_argument(
        "--val-every", type=int, help=f"validate every N steps, and before training (--quick: {QUICK_VAL_EVERY})"
    )
    parser.add_argument(
        "--task",
        nargs="*",
        help="config files merged after each config: the task's data, model and sizes "
        f"(--quick: {' '.join(QUICK_TASK)})",
    )
    parser.add_argument("--experiment", default="dsrl-compare", help="the MLflow experiment (default dsrl-compare)")
    parser.add_argument(
        "--quick", action="store_true", help=f"the tiny model on the CPU quickstart's task, {QUICK_STEPS} steps"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="runs at a time (default 1; --quick: one per CPU core, each run one thread)",
    )
    args = parser.parse_intermixed_args(argv)
    try:
        configs, overrides = split_files_and_overrides(args.args)
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if not configs:
        parser.error("name the configs to compare (e.g. grpo rloo opo otb) before the key=value overrides")
    if len(set(args.seed_list)) != len(args.seed_list):
        parser.error(f"--seeds {args.seeds}: each seed once")
    if args.quick:  # what --quick sets where the option is not given (0 is given: it is refused below)
        args.jobs = (os.cpu_count() or 1) if args.jobs is None else args.jobs
        args.steps = QUICK_STEPS if args.steps is None else args.steps
        args.val_every = QUICK_VAL_EVERY if args.val_every is None else args.val_every
        args.task = QUICK_TASK if args.task is None else args.task
        overrides = [*QUICK_OVERRIDES, *overrides]
    if args.steps is None:
        parser.error("--steps N (N >= 1) is required without --quick")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1 training step")
    args.jobs = 1 if args.jobs is None else args.jobs
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1")
    args.val_every = args.steps if args.val_every is None else args.val_every
    if args.val_every < 1:
        parser.error(f"--val-every {args.val_every}: must be >= 1")
    return args, configs, overrides


def arm_label(config: str) -> str:
    """A config's name in the report and the run names: the recipe name, or the YAML file's stem."""
    return Path(config).stem


def common_overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """What every run gets after the task files: the user's overrides, then the comparison's settings."""
    return [
        *overrides,
        f"trainer.total_training_steps={args.steps}",
        f"trainer.total_epochs={10**6}",  # the steps end each run, however many epochs of prompts that takes
        f"trainer.test_freq={args.val_every}",
        "trainer.val_before_train=true",
        "trainer.logger=[console,mlflow]",
        f"trainer.project_name={args.experiment}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.log_val_generations=0",
        "trainer.log_samples_freq=-1",
        "actor_rollout_ref.actor.measure_grad_variance=true",
    ]


def run_overrides(arm: Arm, common: list[str], out: Path, seed: int) -> list[str]:
    name = f"{arm.label}-seed{seed}"
    return [
        *common,
        *arm.added,
        f"trainer.seed={seed}",
        f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={out / 'runs' / name}",
    ]


def validated_arms(configs: list[str], task: list[str], common: list[str], out: Path, seed: int) -> list[Arm]:
    """The arms, each config checked (with the first seed) before anything trains; a config without a KL loss gets
    one of coefficient 0 (the module docstring). Raises ConfigError listing every config's problems."""
    arms, problems = [], []
    for config in configs:
        arm = Arm(arm_label(config), [str(config_file_path(config)), *task])
        try:
            cfg, _ = load_and_validate(arm.files, run_overrides(arm, common, out, seed), 1)
            if not cfg.actor_rollout_ref.actor.use_kl_loss:
                arm.added = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.0"]
                cfg, _ = load_and_validate(arm.files, run_overrides(arm, common, out, seed), 1)
            arm.kl_loss_type = cfg.actor_rollout_ref.actor.kl_loss_type
        except ConfigError as err:
            problems += [f"{config}: {violation}" for violation in err.violations]
        arms.append(arm)
    labels = [arm.label for arm in arms]
    problems += [
        f"{label}: named twice (configs are told apart by their file name)"
        for label in sorted({label for label in labels if labels.count(label) > 1})
    ]
    if problems:
        raise ConfigError(problems)
    return arms


# ---- reading the runs back from MLflow ------------------------------------------------------------------


def mlflow_name(metric: str) -> str:
    from dsrl.tracking import sanitize_metric_name

    return sanitize_metric_name(metric)


def read_run(client, experiment_id: str, name: str) -> dict:
    """The newest run called ``name`` in the experiment: its id, validation scores by step (the mean of its
    ``val-core/*/mean@N`` metrics at each step, as ``dsrl.trainer.validation.validation_score``) and each of
    ``STEP_METRICS`` by step."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.mlflow.runName = '{name}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise LookupError(f"no MLflow run named {name} in the experiment")
    run = runs[0]
    history = lambda key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}  # noqa: E731
    core = [k for k in run.data.metrics if k.startswith("val-core/") and k.rpartition("/")[2].startswith("mean_at_")]
    by_step: dict[int, list[float]] = {}
    for key in core:
        for step, value in history(key).items():
            by_step.setdefault(step, []).append(value)
    return {
        "run_id": run.info.run_id,
        "status": run.info.status,
        "validation": {step: statistics.fmean(values) for step, values in sorted(by_step.items())},
        "steps": {metric: history(mlflow_name(key)) for metric, (key, _) in STEP_METRICS.items()},
    }


def run_summary(run: dict, steps: int) -> dict[str, float]:
    """One number per measurement of one run (the module docstring says which)."""
    last_quarter = steps - math.ceil(steps / 4)  # the steps after this one
    summary = {"final_score": run["validation"].get(steps, math.nan)}
    for metric, (_, span) in STEP_METRICS.items():
        values = [v for step, v in run["steps"][metric].items() if span == "all steps" or step > last_quarter]
        summary[metric] = statistics.fmean(values) if values else math.nan
    return summary


# ---- the report -------------------------------------------------------------------------------------


def cell(mean: float, half: float) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.3g}" if not math.isfinite(half) else f"{mean:.3g} ± {half:.2g}"


def build_report(arms: list[Arm], runs: dict[str, dict[int, dict]], steps: int) -> dict:
    """The report's content: per arm, each run's summary and, per measurement, mean and half-width over seeds."""
    report = {}
    for arm in arms:
        per_seed = {seed: run_summary(run, steps) for seed, run in runs[arm.label].items()}
        summary = {}
        for key in ["final_score", *STEP_METRICS]:
            mean, half = t_interval([s[key] for s in per_seed.values()])
            summary[key] = {"mean": mean, "ci95_half_width": half, "n": len(per_seed)}
        report[arm.label] = {
            "kl_loss_type": arm.kl_loss_type,
            "added_overrides": arm.added,
            "runs": {str(seed): {"run_id": runs[arm.label][seed]["run_id"], **per_seed[seed]} for seed in per_seed},
            "summary": summary,
        }
    return report


def plot_curves(arms: list[Arm], runs: dict[str, dict[int, dict]], path: Path) -> None:
    """curves.png: per step, each arm's mean over seeds (line) and lowest-to-highest seed (band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("validation score", lambda run: run["validation"]),
        ("KL to the initial policy (actor/kl_loss)", lambda run: run["steps"]["kl_to_initial"]),
        ("entropy (actor/entropy)", lambda run: run["steps"]["entropy"]),
        ("relative gradient variance (actor/grad_var_relative)", lambda run: run["steps"]["grad_var_relative"]),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, series) in zip(axes.flat, panels, strict=True):
        for arm in arms:
            curves = [series(run) for run in runs[arm.label].values()]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            values = [[c[s] for c in curves] for s in steps]
            ax.plot(
                steps, [statistics.fmean(v) for v in values], marker="o" if len(steps) < 12 else None, label=arm.label
            )
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    figure.suptitle("mean over seeds; band: lowest to highest seed")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report_markdown(report: dict, args: argparse.Namespace, command: str, wall_s: float) -> str:
    rows = []
    for label, arm in report.items():
        s = arm["summary"]
        rows.append(
            {"config": label, **{col: cell(s[key]["mean"], s[key]["ci95_half_width"]) for col, key in COLUMNS.items()}}
        )
    seeds = ",".join(map(str, args.seed_list))
    kl_types = ", ".join(f"{label}: {arm['kl_loss_type']}" for label, arm in report.items())
    return "\n".join(
        [
            f"# dsrl-compare: {', '.join(report)}",
            "",
            f"`{command}`",
            "",
            f"{args.steps} steps per run, seeds {seeds}, validation every {args.val_every} steps; {wall_s / 60:.1f} "
            f"min in all, {args.jobs} run(s) at a time. "
            f"MLflow experiment `{args.experiment}` in `{args.out / 'mlflow.db'}`.",
            "",
            markdown_table(rows),
            "",
            f"Each cell: the mean over the {len(args.seed_list)} seeds ± the half-width of a 95% Student-t interval "
            "(t(0.975, n-1) · s / √n, s the sample standard deviation over seeds).",
            "",
            "- final val score: the validation score (mean of val-core/<source>/<var>/mean@N) at the last step.",
            "- KL to initial: actor/kl_loss, KL(policy ‖ reference) with the reference the initial policy, averaged "
            "over the step's response tokens, mean over the last quarter of the steps; estimator per config: "
            f"{kl_types}.",
            "- entropy: actor/entropy (token-mean over the step's responses), mean over the last quarter of the steps.",
            "- grad var: actor/grad_var, the variance across micro-batches of the gradient each gives of the actor's "
            "loss (trace of the covariance of the micro-batch estimates, measured by gradient hooks; "
            "dsrl/engines/grad_variance.py); grad var (relative): the same over ‖G‖², G the step's gradient. "
            "Means over all steps.",
            "- train score: critic/score/mean (the training responses' mean score), mean over the last quarter of the "
            "steps.",
            "- s/step: timing_s/step, mean over all steps.",
            "",
            "![curves](curves.png)",
            "",
        ]
    )


def json_ready(value):
    """``value`` with nan (a measurement a run did not log) as null: report.json stays standard JSON."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ready(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main(argv: list[str] | None = None) -> int:
    args, configs, overrides = parse_args(argv)
    out = args.out.resolve()
    args.out = out
    root = Path.cwd()  # the runs' working directory: the task files' relative paths start here
    if args.quick:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        build_tiny_inputs(root)
    task = [str(config_file_path(name)) for name in args.task or []]
    common = common_overrides(args, overrides)
    try:
        arms = validated_arms(configs, task, common, out, args.seed_list[0])
    except ConfigError as err:
        print(
            "dsrl-compare: the configs have problems:\n" + "\n".join(f"  {v}" for v in err.violations), file=sys.stderr
        )
        return 2
    (out / "runs").mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)  # each run is a world of its own, whatever launched this command
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(args.experiment) is None:
        client.create_experiment(args.experiment)  # the store's tables exist before runs write to it side by side
    started = time.perf_counter()
    names = [f"{arm.label}-seed{seed}" for seed in args.seed_list for arm in arms]
    commands = {f"{arm.label}-seed{seed}": [sys.executable, "-m", "dsrl", *arm.files,
                                            *run_overrides(arm, common, out, seed)]
                for seed in args.seed_list for arm in arms}  # fmt: skip

    def train(name: str) -> int:
        if runs.signum:  # stopped by a signal: no further run starts
            return 128 + runs.signum
        log, begin = out / "runs" / f"{name}.log", time.perf_counter()
        code, _ = run_logged(commands[name], log, cwd=root, env=env, runs=runs)
        print(f"{name}: exit {code} in {time.perf_counter() - begin:.0f} s (log: {log})", flush=True)
        return code

    with ChildRuns() as runs, ThreadPoolExecutor(args.jobs) as pool:
        codes = dict(zip(names, pool.map(train, names), strict=True))
    if runs.signum:
        print(
            f"dsrl-compare: stopped by {signal.Signals(runs.signum).name}; the runs in flight got it too and stopped "
            f"(their logs: {out / 'runs'})",
            file=sys.stderr,
        )
        return 128 + runs.signum
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        logs = ", ".join(f"{name} (exit {codes[name]}): {out / 'runs' / name}.log" for name in failed)
        print(f"dsrl-compare: {len(failed)} run(s) failed; see {logs}", file=sys.stderr)
        return 1
    wall_s = time.perf_counter() - started
    experiment_id = client.get_experiment_by_name(args.experiment).experiment_id
    runs = {
        arm.label: {seed: read_run(client, experiment_id, f"{arm.label}-seed{seed}") for seed in args.seed_list}
        for arm in arms
    }
    report = build_report(arms, runs, args.steps)
    command = "dsrl-compare " + shlex.join(argv if argv is not None else sys.argv[1:])
    (out / "report.json").write_text(
        json.dumps(
            json_ready(
                {
                    "command": command,
                    "experiment": args.experiment,
                    "tracking_uri": uri,
                    "steps": args.steps,
                    "seeds": args.seed_list,
                    "val_every": args.val_every,
                    "jobs": args.jobs,
                    "wall_s": wall_s,
                    "confidence": CONFIDENCE,
                    "configs": report,
                    "curves": {
                        label: {
                            str(seed): {"validation": run["validation"], **run["steps"]}
                            for seed, run in by_seed.items()
                        }
                        for label, by_seed in runs.items()
                    },
                }
            ),
            indent=1,
        )
    )
    plot_curves(arms, runs, out / "curves.png")
    markdown = report_markdown(report, args, command, wall_s)
    (out / "report.md").write_text(markdown)
    print(markdown)
    return 0


def run() -> None:
    """The ``dsrl-compare`` console script."""
    sys.exit(main())


if __name__ == "__main__":  # python -m dsrl.commands.compare, the same as dsrl-compare
    run()
