"""The ``dsrl-train`` command: parse the config, validate it, run the loop.

    dsrl-train grpo cpu                                           # a shipped recipe on a CPU (the overlay
                                                                  # configs/cpu.yaml)
    deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml     # the same as --module dsrl or $(which dsrl-train)
    python -m dsrl configs/otb.yaml --validate-only               # print the resolved config
    dsrl-train configs/opo.yaml --validate-only --world-size 8    # ... checked for 8 ranks
    dsrl-train grpo --plan --world-size 8 --device-memory 141GiB  # memory per rank and phase (dsrl.plan.plan)
    dsrl-train --show-keys actor_rollout_ref.actor.optim          # the config reference: type, default, meaning

Config files (paths, or names of shipped recipes) are merged left to right, then ``dotted.key=value`` overrides. The
config is checked before torch or DeepSpeed is imported (the DeepSpeed JSON files it names included): a bad one
exits with code 2 within a second, listing every problem (dotted key, value, rule, fix); so do the data files and
model directories it names, as far as their headers tell, and the rest of them when they load (before any model). A
LoRA run's adapters are checked against its model built on the meta device, which takes the seconds of importing
torch. Under a launcher of several ranks every rank checks, and the ranks meet to report together: rank 0 prints
every rank's problems, a problem only some ranks have marked with their ranks and hosts (a file missing on one
node), which takes the seconds of importing torch.
Exit codes: 0 done; 2 a bad config, data file or model directory, a run folder another run holds, or a
checkpoint that cannot be resumed from; 1 a run that cannot go on (e.g. non-finite updates, a checkpoint
that cannot be written, a rank stuck past actor_rollout_ref.nccl_timeout, an unexpected error: its rank,
host and traceback printed); 128 + the signal number when stopped by a signal (143 SIGTERM, 130 SIGINT,
129 SIGHUP), after saving a checkpoint when the signal came during training (resume with
trainer.resume_mode=auto). Signals are handled from the start (``dsrl.runtime.signals``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

from dsrl.checkpoint.run_folder import RunFolderBusy
from dsrl.config import SCHEMA, ConfigError, describe_keys, load_and_validate, to_yaml
from dsrl.config.loading import split_files_and_overrides
from dsrl.config.schema import lora_enabled
from dsrl.plan.inputs import Device, detect_device, parse_size
from dsrl.plan.plan import plan_for_config, plan_problems, render
from dsrl.plan.shape import GIB, PlanError, model_config_path
from dsrl.runtime.launch import LaunchError, RendezvousError, join
from dsrl.runtime.redaction import redact_text
from dsrl.runtime.signals import Interrupted, RunSignals, TrainingInterrupted
from dsrl.tracking.console import logger, refuse, setup_logging


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
    parser.add_argument(
        "--validate-only",
        action="store_true",
        help="print the resolved config as YAML and exit; a config whose memory plan exceeds the device is refused "
        "(trainer.memory_plan_check)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan (per rank and phase: parameters, gradients, optimizer states, activations, "
        "log-prob head, rollout weights and KV cache, DeepSpeed buffers; device and host) and exit, before anything "
        "loads; exit code 2 when a phase exceeds the device and trainer.memory_plan_check=error",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with --validate-only or --plan: check the batch sizes and DeepSpeed configs for N ranks, e.g. 8 for "
        "deepspeed --num_gpus 8 (default: $WORLD_SIZE, else 1)",
    )
    parser.add_argument(
        "--device-memory",
        type=_size,
        metavar="SIZE",
        help="with --validate-only or --plan: memory of one GPU, e.g. 141GiB, 80GB (default: with DS_ACCELERATOR=cpu "
        "the machine's memory, shared by every rank; else the smallest GPU nvidia-smi lists; else none, and "
        "--validate-only notes that the plan was not checked)",
    )
    parser.add_argument(
        "--model-config",
        metavar="PATH",
        help="with --validate-only or --plan: a config.json that gives the model's shape, for a hub id not "
        "downloaded here (default: actor_rollout_ref.model.path's config.json, or the Hugging Face cache's)",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="under the launcher: check that the ranks make one sound cluster (hosts, devices, a shared "
        "trainer.default_local_dir, versions), print it and exit, before any model loads",
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
    checks_alone = args.validate_only or args.plan
    for option, value in (("--world-size", args.world_size), ("--device-memory", args.device_memory),
                          ("--model-config", args.model_config)):  # fmt: skip
        if value is not None and not checks_alone:
            parser.error(
                f"{option} goes with --validate-only or --plan; a run takes its world and devices from the launcher"
            )
    if args.preflight and checks_alone:
        parser.error(
            "--preflight checks the ranks the launcher started; --validate-only and --plan check the config alone"
        )
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be a positive number of ranks")
    try:
        files, overrides = split_files_and_overrides(args.args)
    except ValueError as err:
        parser.error(str(err))
    return args, files, overrides


def _size(text: str) -> int:
    """``--device-memory``'s bytes (``dsrl.plan.inputs.parse_size``), an argparse error otherwise."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def checked_cluster(cfg, problems: list[str], launch, where: str, timeout_s: int | None):
    """The ranks meet and run the preflight (``dsrl.trainer.preflight``) whether their own config check passed or not,
    so that what only one rank sees (a file missing on its node) reaches the report rank 0 prints (``refuse``);
    the cluster, or None when the run must stop (exit code 2, once every rank got here: the launcher stops
    every rank when one exits). Collective."""
    from dsrl.engines import init_distributed
    from dsrl.runtime.stalls import startup_watchdog
    from dsrl.trainer.preflight import preflight

    init_distributed(timeout_s)
    with startup_watchdog():  # a rank that waits a minute on the others says so
        cluster, problems = preflight(cfg, problems, launch)
    if problems:
        leave_together(refuse(f"{where}: {len(problems)} problem(s) in the configuration or the cluster", problems))
        return None
    return cluster


def leave_together(code: int) -> int:
    """``code``, once every rank got here (a run of several ranks): the launcher stops every rank when one
    exits, which would cut rank 0 off while it reports. Collective."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        # Torn down here, while every rank is alive: left to the interpreter's exit, a rank whose peer has
        # already gone may abort ("terminate called without an active exception", exit code 250).
        dist.destroy_process_group()
    return code


def where_stopped(err: Interrupted) -> str:
    """The message of a run a signal stopped outside the training loop, with what is left and how to go on."""
    if err.phase == "export":
        after = "training finished and its checkpoints are complete, but the final model was not exported"
    else:
        after = "nothing of this run needed saving yet"
    return (
        f"stopped by {signal.Signals(err.signum).name} during {err.phase}: {after}; run the same command again "
        "(trainer.resume_mode=auto resumes from the newest checkpoint, if any)"
    )


def check_memory_plan(cfg, world_size: int, args: argparse.Namespace, where: str, rank: int) -> tuple[int, str]:
    """``--plan`` and ``--validate-only``: the memory plan (``dsrl.plan.plan``), printed with ``--plan``, and
    ``trainer.memory_plan_check``: exit code 2 (error) or a warning (warn) per phase that exceeds the device.
    Returns the exit code and, for ``--validate-only``, the comment line to print after the config. Every rank
    of a launcher decides alike; rank 0 prints."""
    check = cfg.trainer.memory_plan_check
    if check == "ignore" and not args.plan:
        return 0, ""
    given = args.device_memory is not None
    device = Device("cuda", args.device_memory, "--device-memory") if given else detect_device()
    try:
        if device is None:
            raise PlanError(
                "no GPU here (nvidia-smi) and DS_ACCELERATOR is not cpu; fix: pass --device-memory SIZE (one GPU's "
                "memory, e.g. 141GiB), or set DS_ACCELERATOR=cpu to plan for this machine's memory"
            )
        plan = plan_for_config(cfg, world_size, device, args.model_config)
    except PlanError as err:
        if args.plan:
            return refuse(f"{where}: no memory plan", [str(err)]), ""
        return 0, f"# memory plan: not checked: {err}\n"
    lines = plan_problems(plan) if check != "ignore" else []
    if rank == 0 and args.plan:
        print(render(plan, f"{where} at world size {world_size}"), flush=True)
    if lines and check == "error":
        return refuse(f"{where}: {len(lines)} phase(s) of the memory plan exceed the device", lines), ""
    for line in lines if rank == 0 else []:  # warn: on stderr, as the refusal would be (stdout holds the YAML)
        print(redact_text(f"dsrl: warning: {line}"), file=sys.stderr, flush=True)
    if lines:
        return 0, f"# memory plan: {len(lines)} phase(s) exceed the device (trainer.memory_plan_check=warn)\n"
    return (
        0,
        f"# memory plan: every phase fits {device.bytes / GIB:.1f} GiB ({device.kind}, {device.source}); dsrl-train "
        "--plan shows it\n",
    )


PLAN_UNREAD = ("data.train_files", "data.val_files", "custom_reward_function.path", "trainer.default_local_dir")


def plan_reads(key: str) -> bool:
    """Whether ``--plan`` reads ``key``: it needs the model's shape and the run's sizes, not the files of its data, its
    reward or its run folder (the README's plan of a GSM8K recipe runs on a machine without GSM8K)."""
    return key not in PLAN_UNREAD


def lora_problems(cfg, model_config: str | None) -> list[str]:
    """A LoRA run's adapters against its model (``dsrl.engines.lora.lora_target_problems``: the model built on the
    meta device from its config.json, or ``--model-config``'s): the only check before the run that imports torch,
    transformers and peft (seconds), so that a target that matches nothing, or no linear layer, is refused here and
    not after the model loaded."""
    from dsrl.engines.lora import lora_target_problems

    model = cfg.actor_rollout_ref.model
    config_file = Path(model_config).expanduser() if model_config else model_config_path(model.path)
    return lora_target_problems(model, config_file)


def show_keys(prefix: str) -> int:
    """``--show-keys [PREFIX]``: the config reference on stdout; exit code 2 when no key starts with ``prefix``."""
    lines = describe_keys(prefix)
    if not lines:
        sections = ", ".join(key for key in SCHEMA if "." not in key)
        print(
            f"dsrl: --show-keys {prefix}: no config key starts with it; fix: start it with one of {sections}",
            file=sys.stderr,
        )
        return 2
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    args, files, overrides = parse_args(argv)
    if args.show_keys is not None:
        return show_keys(args.show_keys)
    if args.world_size is not None:  # checked for another world: this process's launch does not matter
        launch, world_size, source = None, str(args.world_size), "--world-size"
    else:
        try:
            launch = join()  # the rank and world of any launcher, before validation checks the batch sizes for it
        except LaunchError as err:
            print(f"dsrl: {err}", file=sys.stderr)
            return 2
        world_size = str(launch.world_size)
        source = {
            "none": "no launcher: one process; --world-size N checks N",
            "environment": "RANK and WORLD_SIZE in the environment",
        }.get(launch.launcher, f"the {launch.launcher} launcher")
    rank = launch.rank if launch is not None else 0
    setup_logging(rank)
    where = " + ".join(files) or "the defaults"
    cfg, problems = None, []
    plan_only = args.plan and not args.validate_only  # the plan reads no data, reward, tool or run-folder file
    try:
        cfg, notes = load_and_validate(files, overrides, int(world_size), reads=plan_reads if plan_only else None)
    except ConfigError as err:
        problems = err.violations  # the rules that depend on the world size name it in their own lines
    if cfg is not None and cfg.actor_rollout_ref.rollout.multi_turn.enable and not plan_only:
        from dsrl.rollout.tools import check_tool_files  # imports no torch

        problems = check_tool_files(cfg)
        cfg = None if problems else cfg
    if cfg is not None and lora_enabled(cfg.actor_rollout_ref.model) and not plan_only:
        problems = lora_problems(cfg, args.model_config)
        cfg = None if problems else cfg
    checks_alone = args.validate_only or args.plan
    launched = not checks_alone and (int(world_size) > 1 or args.preflight)
    if problems and not launched:
        return refuse(f"{where}: {len(problems)} problem(s) in the configuration", problems)
    planned = ""
    if checks_alone:  # refused before the config is printed
        code, planned = check_memory_plan(cfg, int(world_size), args, where, rank)
        if code or args.plan:
            return code
    if cfg is not None and rank == 0 and not args.preflight:  # the resolved config, once per run
        checked = f"# validated for world size {world_size} ({source})\n"
        print(
            redact_text("".join(f"# note: {note}\n" for note in notes) + checked + to_yaml(cfg) + planned),
            end="",
            flush=True,
        )
    if args.validate_only:
        return 0
    signals = RunSignals().install()  # before the trainer's imports: a Ctrl-C there is a stop like any other
    try:
        timeout = cfg.actor_rollout_ref.nccl_timeout if cfg is not None else None
        cluster = checked_cluster(cfg, problems, launch, where, timeout) if launched else None
        if launched and cluster is None:
            return 2
        if args.preflight:
            if launch.rank == 0:
                print(cluster.table(str(Path(cfg.trainer.default_local_dir).expanduser().resolve())), flush=True)
            return leave_together(0)
        return run_training(cfg, signals, where, cluster)
    except RendezvousError as err:
        print(redact_text(f"dsrl: {err}"), file=sys.stderr, flush=True)
        return 1
    except Interrupted as err:
        logger.warning(where_stopped(err), extra={"all_ranks": True})
        return err.exit_code
    finally:
        signals.restore()


def run_training(cfg, signals: RunSignals, where: str, cluster) -> int:
    """``dsrl.trainer.loop.train`` and what its end means: the exit code, and the message where it is not 0."""
    from dsrl.checkpoint.save import CheckpointError, CheckpointWriteError
    from dsrl.trainer.loop import TrainingStopped, train

    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        train(cfg, signals, cluster)
    except ConfigError as err:  # found while loading the tokenizer and the prompts, on any rank
        refuse(f"{where}: {len(err.violations)} problem(s) in the files the configuration names", err.violations)
        return leave_together(2)
    except (CheckpointError, RunFolderBusy, TrainingStopped) as err:  # every rank raised it, decided together
        if first_rank:
            print(redact_text(f"dsrl: {err}"), file=sys.stderr, flush=True)
        return leave_together(1 if isinstance(err, TrainingStopped) else 2)
    except CheckpointWriteError as err:  # this rank's own write failed
        print(
            redact_text(f"dsrl: rank {os.environ.get('RANK', '0')} on {socket.gethostname()}: {err}"), file=sys.stderr
        )
        return 1
    except TrainingInterrupted as err:
        logger.info(f"{err}; exit code {err.exit_code}")
        return err.exit_code
    except Exception as err:  # noqa: BLE001 -- reported with the rank and host it happened on
        from dsrl.runtime.distributed import collective_timeout_message, leave_timed_out_group

        message = collective_timeout_message(err)
        if message is not None:
            print(redact_text(f"dsrl: {message}"), file=sys.stderr)  # every rank that waited says so
            leave_timed_out_group()
            return 1
        rank = os.environ.get("RANK", "0")
        print(
            redact_text(
                f"dsrl: rank {rank} on {socket.gethostname()}: the run failed with an unexpected error:\n"
                + traceback.format_exc()
            ),
            file=sys.stderr,
            end="",
        )
        return 1
    return 0


def run() -> None:
    """Entry point of the ``dsrl-train`` command, ``python -m dsrl`` and ``scripts/train.py``."""
    code = main(sys.argv[1:])
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() == 1:
            # A lone rank's group left to the interpreter's exit aborted once on a loaded machine (exit code -6,
            # "terminate called without an active exception"); several ranks tear theirs down in leave_together.
            # Here and not there: in-process callers of main (the trainer tests) keep their group.
            dist.destroy_process_group()
    sys.exit(code)
