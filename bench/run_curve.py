"""The validation curve and step profile of a finished run, from its MLflow metrics (the README's SmolLM2 table).

    python bench/run_curve.py --run-name smollm2       # the newest run named smollm2 in ./mlflow.db
    python bench/run_curve.py --run-name quickstart --tracking-uri sqlite:////tmp/qs/mlflow.db

Prints markdown: the validation score (greedy ``val-core`` mean@1) and the mean training score of the steps
since the previous validation, at each validation step; then each phase's median seconds per step over
the steps after the first (``timing_s/*``; the first step includes one-off warm-up), and the run's wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mlflow import MlflowClient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="dsrl", help="trainer.project_name of the run")
    parser.add_argument("--run-name", required=True, help="trainer.experiment_name of the run")
    args = parser.parse_args(argv)

    client = MlflowClient(tracking_uri=args.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment)
    runs = (
        []
        if experiment is None
        else client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.mlflow.runName = '{args.run_name}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
    )
    if not runs:
        print(
            f"no run named {args.run_name!r} in experiment {args.experiment!r} at {args.tracking_uri}", file=sys.stderr
        )
        return 1
    run = runs[0]

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    [val_key] = [k for k in run.data.metrics if k.startswith("val-core/") and k.endswith("mean_at_1")]
    validation, train = history(val_key), history("critic/score/mean")
    print(f"| step | validation ({val_key}) | training score, mean of the steps since the last validation |")
    print("|---|---|---|")
    previous = 0
    for step, score in sorted(validation.items()):
        since = [train[s] for s in range(previous + 1, step + 1) if s in train]
        print(f"| {step} | {score:.2f} | {statistics.fmean(since):.3f} |" if since else f"| {step} | {score:.2f} | |")
        previous = step

    phases = sorted(k for k in run.data.metrics if k.startswith("timing_s/"))
    print("\n| phase | median s per step |\n|---|---|")
    for key in phases:
        values = [v for s, v in history(key).items() if s > 1]
        if values:
            print(f"| {key.removeprefix('timing_s/')} | {statistics.median(values):.2f} |")
    wall = (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else float("nan")
    print(f"\nrun {run.info.run_id}: {run.info.status}, {len(train)} steps, wall time {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
