"""Time N training steps of the quickstart model and print the per-phase split and tokens/s.

    OMP_NUM_THREADS=1 python scripts/bench_step.py                  # the quickstart's configs, 10 steps
    OMP_NUM_THREADS=1 python scripts/bench_step.py --steps 5 actor_rollout_ref.rollout.n=4
    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 scripts/bench_step.py  # two CPU ranks (rank 0 prints)
    OMP_NUM_THREADS=1 python scripts/bench_step.py --profile 25     # and where the time goes

The first step is reported apart (it includes one-off warm-up) and left out of the means.
Extra arguments are dotted config overrides.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from dsrl.config import ConfigError, load_and_validate  # noqa: E402

PHASES = (
    "release_memory",
    "update_weights",
    "wake",
    "gen",
    "sleep",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        nargs="+",
        default=["configs/grpo.yaml", "configs/cpu.yaml", "configs/quickstart.yaml"],
        help="config files, merged left to right (default: the quickstart's)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also print rank 0's N costliest functions (cProfile, internal time) over the steps",
    )
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [
        *args.overrides,
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[console]",
        "trainer.resume_mode=disable",
    ]
    try:
        cfg, _ = load_and_validate(args.config, overrides, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as err:
        print("\n".join(err.violations), file=sys.stderr)
        return 2

    from dsrl.trainer.loop import Trainer

    trainer = Trainer(cfg)
    steps: list[dict[str, float]] = []
    trainer.tracker.log_metrics = lambda metrics, step: steps.append(metrics)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    trainer.fit()
    if trainer.rank != 0:
        return 0
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    timed = steps[1:] or steps
    step_s = statistics.mean(m["timing_s/step"] for m in timed)
    print(f"\n{len(timed)} steps after the first ({steps[0]['timing_s/step']:.2f} s); world size {trainer.world_size}")
    print(f"{'phase':<16}{'mean s':>10}{'share':>8}")
    for phase in PHASES:
        key = f"timing_s/{phase}"
        if key in timed[0]:
            seconds = statistics.mean(m[key] for m in timed)
            print(f"{phase:<16}{seconds:>10.3f}{seconds / step_s:>8.1%}")
    print(f"{'step':<16}{step_s:>10.3f}{1:>8.0%}")
    tokens = statistics.mean(m["perf/throughput"] for m in timed)
    print(
        f"tokens/s per rank: {tokens:.0f}; response length mean "
        f"{statistics.mean(m['response_length/mean'] for m in timed):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
