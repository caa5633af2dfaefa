"""The ``dsrl-train`` command: parse the config, validate it, run the loop.

    dsrl-train grpo cpu                                           # a shipped recipe on a CPU (the overlay configs/cpu.yaml)
    deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml     # the same as --module dsrl or $(which dsrl-train)
    python -m dsrl configs/otb.yaml --validate-only               # print the resolved config

Config files (paths, or names of shipped recipes) are merged left to right, then ``dotted.key=value``
overrides. The config is checked before torch or DeepSpeed is imported: a bad one exits with code 2
within a second, listing every problem (dotted key, value, rule, fix). Exit codes: 0 done; 2 a bad config
or a checkpoint that cannot be resumed from; 1 a run that cannot go on (e.g. non-finite updates);
143 / 130 stopped by SIGTERM / SIGINT after saving a checkpoint (resume with trainer.resume_mode=auto).
"""

from __future__ import annotations

import argparse
import os
import sys

from dsrl.config import ConfigError, load_and_validate, to_yaml
from dsrl.console import logger, setup_logging
from dsrl.tracking import redact_text


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The options, the config files and the overrides (``key=value``, after the files)."""
    parser = argparse.ArgumentParser(prog="dsrl-train", description="RL post-training of an LLM with DeepSpeed ZeRO.")
    parser.add_argument(
        "args",
        nargs="+",
        metavar="config | key=value",
        help="YAML files or shipped recipe names (e.g. configs/grpo.yaml configs/cpu.yaml, or grpo cpu), merged left "
        "to right, then dotted overrides, e.g. data.train_batch_size=16 trainer.logger=[console,mlflow]",
    )
    parser.add_argument("--validate-only", action="store_true", help="print the resolved config as YAML and exit")
    # The deepspeed launcher passes --local_rank=N; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    try:
        files, overrides = split_files_and_overrides(args.args)
    except ValueError as err:
        parser.error(str(err))
    return args, files, overrides


def split_files_and_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """The leading config files and the ``key=value`` overrides after them."""
    files = []
    for item in items:
        if "=" in item:
            break
        files.append(item)
    overrides = items[len(files) :]
    misplaced = [item for item in overrides if "=" not in item]
    if misplaced:
        raise ValueError(f"{misplaced[0]}: config files come before the key=value overrides")
    return files, overrides


def main(argv: list[str]) -> int:
    args, files, overrides = parse_args(argv)
    rank = os.environ.get("RANK", "0")  # set by the deepspeed launcher
    setup_logging(int(rank) if rank.isdigit() else 0)
    world_size = os.environ.get("WORLD_SIZE", "1")  # set by the deepspeed launcher; a single process otherwise
    if not world_size.isdigit() or int(world_size) < 1:
        print(
            f"dsrl: WORLD_SIZE={world_size}: must be a positive integer; fix: unset it or start with the deepspeed launcher",
            file=sys.stderr,
        )
        return 2
    where = " + ".join(files) or "the defaults"
    try:
        cfg, notes = load_and_validate(files, overrides, int(world_size))
    except ConfigError as err:
        print(f"dsrl: {where}: {len(err.violations)} problem(s) in the configuration:", file=sys.stderr)
        for violation in err.violations:
            print(f"  {violation}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # the resolved config, once per run
        print(redact_text("".join(f"# note: {note}\n" for note in notes) + to_yaml(cfg)), end="", flush=True)
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
        logger.info(f"{err}; exit code {err.exit_code}")
        return err.exit_code
    return 0


def run() -> None:
    """Entry point of the ``dsrl-train`` command and of ``python -m dsrl``."""
    sys.exit(main(sys.argv[1:]))
