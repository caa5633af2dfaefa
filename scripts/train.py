"""Train a policy with dsrl: parse the config, validate it, run the loop.

    python scripts/train.py configs/grpo.yaml data.train_batch_size=16            # one process
    deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
    python scripts/train.py configs/otb.yaml --validate-only                      # print the resolved config

The config is checked before torch or DeepSpeed is imported: a bad one exits with code 2 within a
second, listing every problem (dotted key, value, rule, fix). Exit codes: 0 done; 2 a bad config or a
checkpoint that cannot be resumed from; 1 a run that cannot go on (e.g. non-finite updates);
143 / 130 stopped by SIGTERM / SIGINT after saving a checkpoint (resume with trainer.resume_mode=auto).
"""

from __future__ import annotations

import argparse
import os
import sys

from dsrl.config import ConfigError, load_and_validate, to_yaml


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="RL post-training of an LLM with DeepSpeed ZeRO.")
    parser.add_argument("config", help="YAML file, e.g. configs/grpo.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides applied after the file, e.g. data.train_batch_size=16 trainer.logger=[console,mlflow]",
    )
    parser.add_argument("--validate-only", action="store_true", help="print the resolved config as YAML and exit")
    # The deepspeed launcher passes --local_rank=N; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    world_size = os.environ.get("WORLD_SIZE", "1")  # set by the deepspeed launcher; a single process otherwise
    if not world_size.isdigit() or int(world_size) < 1:
        print(
            f"dsrl: WORLD_SIZE={world_size}: must be a positive integer; fix: unset it or start with the deepspeed launcher",
            file=sys.stderr,
        )
        return 2
    try:
        cfg, notes = load_and_validate(args.config, args.overrides, int(world_size))
    except ConfigError as err:
        print(f"dsrl: {args.config}: {len(err.violations)} problem(s) in the configuration:", file=sys.stderr)
        for violation in err.violations:
            print(f"  {violation}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # the resolved config, once per run
        print("".join(f"# note: {note}\n" for note in notes) + to_yaml(cfg), end="", flush=True)
    if args.validate_only:
        return 0
    from dsrl.trainer import CheckpointError, TrainingInterrupted, TrainingStopped, train

    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        train(cfg)
    except CheckpointError as err:
        if first_rank:
            print(f"dsrl: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        if first_rank:
            print(f"dsrl: {err}", file=sys.stderr)
        return 1
    except TrainingInterrupted as err:
        if first_rank:
            print(f"[dsrl] {err}; exit code {err.exit_code}", flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
