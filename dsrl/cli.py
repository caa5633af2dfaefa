"""The ``dsrl-train`` command: parse the config, validate it, run the loop.

    dsrl-train grpo cpu                                           # a shipped recipe on a CPU (the overlay configs/cpu.yaml)
    deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml     # the same as --module dsrl or $(which dsrl-train)
    python -m dsrl configs/otb.yaml --validate-only               # print the resolved config
    dsrl-train configs/opo.yaml --validate-only --world-size 8    # ... checked for 8 ranks
    dsrl-train --show-keys actor_rollout_ref.actor.optim          # the config reference: type, default, meaning

Config files (paths, or names of shipped recipes) are merged left to right, then ``dotted.key=value``
overrides. The config is checked before torch or DeepSpeed is imported (the DeepSpeed JSON files it names
included): a bad one exits with code 2 within a second, listing every problem (dotted key, value, rule, fix); so do the data files and model
directories it names, as far as their headers tell, and the rest of them when they load (before any model).
Exit codes: 0 done; 2 a bad config, data file or model directory, or a checkpoint that cannot be resumed
from; 1 a run that cannot go on (e.g. non-finite updates, a rank stuck past actor_rollout_ref.nccl_timeout);
143 / 130 stopped by SIGTERM / SIGINT after saving a checkpoint (resume with trainer.resume_mode=auto).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dsrl.config import SCHEMA, ConfigError, describe_keys, load_and_validate, to_yaml
from dsrl.console import logger, setup_logging
from dsrl.tracking import redact_text

# How long ranks other than 0 wait before exiting on a problem rank 0 reports: the launcher stops every
# rank as soon as one exits, which could cut rank 0 off before it printed.
REPORT_GRACE_S = 5.0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The options, the config files and the overrides (``key=value``, after the files)."""
    parser = argparse.ArgumentParser(prog="dsrl-train", description="RL post-training of an LLM with DeepSpeed ZeRO.")
    parser.add_argument(
        "args",
        nargs="*",
        metavar="config | key=value",
        help="YAML files or shipped recipe names (e.g. configs/grpo.yaml configs/cpu.yaml, or grpo cpu), merged left "
        "to right, then dotted overrides, e.g. data.train_batch_size=16 trainer.logger=[console,mlflow]",
    )
    parser.add_argument("--validate-only", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with --validate-only: check the batch sizes and DeepSpeed configs for N ranks, e.g. 8 for "
        "deepspeed --num_gpus 8 (default: $WORLD_SIZE, else 1)",
    )
    parser.add_argument(
        "--show-keys",
        nargs="?",
        const="",
        metavar="PREFIX",
        help="print every config key (or those starting with PREFIX, e.g. actor_rollout_ref.actor.optim) with its "
        "type, default and meaning, and exit",
    )
    # The deepspeed launcher passes --local_rank=N; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    if not args.args and args.show_keys is None:
        parser.error("give config files (or shipped recipe names) and/or key=value overrides, or --show-keys")
    if args.world_size is not None and not args.validate_only:
        parser.error("--world-size goes with --validate-only; a run takes its world size from the deepspeed launcher")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be a positive number of ranks")
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


def refuse(header: str, problems: list[str]) -> int:
    """Exit code 2 with the problems (one line each) printed once, by rank 0; every rank found the same."""
    if os.environ.get("RANK", "0") == "0":
        print(f"dsrl: {header}:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
    else:
        time.sleep(REPORT_GRACE_S)
    return 2


def show_keys(prefix: str) -> int:
    """``--show-keys [PREFIX]``: the config reference on stdout; exit code 2 when no key starts with ``prefix``."""
    lines = describe_keys(prefix)
    if not lines:
        sections = ", ".join(key for key in SCHEMA if "." not in key)
        print(f"dsrl: --show-keys {prefix}: no config key starts with it; fix: start it with one of {sections}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    args, files, overrides = parse_args(argv)
    if args.show_keys is not None:
        return show_keys(args.show_keys)
    rank = os.environ.get("RANK", "0")  # set by the deepspeed launcher
    setup_logging(int(rank) if rank.isdigit() else 0)
    if args.world_size is not None:
        world_size, source = str(args.world_size), "--world-size"
    else:  # set by the deepspeed launcher; a single process otherwise
        world_size = os.environ.get("WORLD_SIZE", "1")
        source = "WORLD_SIZE" if "WORLD_SIZE" in os.environ else "no WORLD_SIZE: one process; --world-size N checks N"
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
        # The rules that depend on the world size name it in their own lines.
        return refuse(f"{where}: {len(err.violations)} problem(s) in the configuration", err.violations)
    if os.environ.get("RANK", "0") == "0":  # the resolved config, once per run
        checked = f"# validated for world size {world_size} ({source})\n"
        print(redact_text("".join(f"# note: {note}\n" for note in notes) + checked + to_yaml(cfg)), end="", flush=True)
    if args.validate_only:
        return 0
    from dsrl.trainer import CheckpointError, TrainingInterrupted, TrainingStopped, train

    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        train(cfg)
    except ConfigError as err:  # found while loading the tokenizer and the prompts
        return refuse(f"{where}: {len(err.violations)} problem(s) in the files the configuration names", err.violations)
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
    except RuntimeError as err:
        from dsrl.distributed import collective_timeout_message

        message = collective_timeout_message(err)
        if message is None:
            raise
        print(f"dsrl: {message}", file=sys.stderr)  # every rank that waited says so: the stuck one may be rank 0
        return 1
    return 0


def run() -> None:
    """Entry point of the ``dsrl-train`` command and of ``python -m dsrl``."""
    sys.exit(main(sys.argv[1:]))
