"""One rank of a training run (hf or vLLM rollout): the real Trainer; every logged step's metrics go
to ``<out>/rank<N>.json`` at the end and, as they happen, to ``<out>/metrics_rank<N>.jsonl`` (so a
killed run keeps what it logged). Runs alone (a world of one) or under any launcher
(``tests.helpers.resume.start_worker``).

``engine_calls`` lists the rows of every generate call of the rollout engine (a multi-turn rollout calls it
once per turn). With a vLLM rollout, ``generator_states`` in the report lists, for every ``LLM.generate`` call, a digest
of the global generators (python, numpy, torch) the call started with: the ranks of a tensor-parallel group
must start every call alike, whichever model runner draws from which.

Fault injection: ``--kill-at PHASE@STEP`` sends SIGKILL to this process at one point of training
step STEP (1-based): ``update`` (in the middle of the step, right after the actor update), or during
that step's checkpoint save right after ``save_engines`` (DeepSpeed files written), ``write_state``
(the state file written, not yet published) or ``publish`` (renamed into place, before pruning).
After SIGTERM/SIGINT the process exits as scripts/train.py does, with 128 + the signal number; a run the
trainer stops (``TrainingStopped``) exits 1 with its message, as scripts/train.py does. ``--skip-push``
breaks the weight push: the rollout engine keeps its start-up weights (the actor's parameters are still
gathered, a collective, and dropped). ``--dump-loaded`` writes, once the Trainer is built, of a resumed run,
every trained parameter's fp32 master weight and Adam moments, gathered, and each base optimizer's steps to
``<out>/loaded_step_<N>.pt`` (rank 0). ``--slow-convert S``: rank 0's conversion of a checkpoint of another world
size first writes a KB a second for S seconds (a slow filesystem), so it outlasts a short
``actor_rollout_ref.nccl_timeout`` while it progresses.
"""

import argparse
import hashlib
import json
import os
import pickle
import random
import signal
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

import dsrl.checkpoint.save
from dsrl.commands.train import leave_together, split_files_and_overrides
from dsrl.config import load_and_validate
from dsrl.runtime.launch import join
from dsrl.trainer.loop import Trainer, TrainingInterrupted, TrainingStopped

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int)
parser.add_argument("--kill-at", default=None)
parser.add_argument("--skip-push", action="store_true")
parser.add_argument("--dump-loaded", action="store_true")
parser.add_argument("--slow-convert", type=int, default=0)
parser.add_argument("args", nargs="+", help="config files, then key=value overrides")
args = parser.parse_args()

files, overrides = split_files_and_overrides(args.args)
cfg, _ = load_and_validate(files, overrides, join().world_size)  # under any launcher (srun, mpirun too)
if args.slow_convert:
    import dsrl.checkpoint.universal

    convert = dsrl.checkpoint.universal.convert

    def slow_convert(checkpoint, roles, out):
        (out / "slow").mkdir(parents=True)
        for second in range(args.slow_convert):
            (out / "slow" / str(second)).write_bytes(b"x" * 1024)
            time.sleep(1)
        return convert(checkpoint, roles, out)

    dsrl.checkpoint.universal.convert = slow_convert
trainer = Trainer(cfg)
out = Path(args.out)
if args.dump_loaded and trainer.resume_from is not None:  # the engines right after the resume, before a step
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    loaded = {}
    for role_name, role in trainer._trained_roles().items():
        for name, param in role.engine.module.named_parameters():
            if not param.requires_grad:  # a LoRA actor's frozen base: not in its checkpoint
                continue
            loaded[f"{role_name}/{name}"] = {
                "fp32": safe_get_full_fp32_param(param).cpu(),
                **{key: safe_get_full_optimizer_state(param, key).cpu() for key in ("exp_avg", "exp_avg_sq")},
            }
        steps = {float(s["step"]) for s in role.engine.optimizer.optimizer.state.values()}
        loaded[f"{role_name}/optimizer_steps"] = sorted(steps)
    if trainer.rank == 0:
        torch.save(loaded, out / f"loaded_step_{trainer.global_step}.pt")
logged = []
metrics_log = out / f"metrics_rank{trainer.rank}.jsonl"


def log_metrics(metrics, step):
    logged.append({"step": step, "metrics": metrics})
    with metrics_log.open("a") as f:
        f.write(json.dumps({"step": step, "metrics": metrics}) + "\n")


trainer.tracker.log_metrics = log_metrics
generator_states = []


def recording_states(generate):
    def wrapped(*a, **kw):
        state = (random.getstate(), np.random.get_state(), torch.get_rng_state().numpy())
        generator_states.append(hashlib.sha256(pickle.dumps(state)).hexdigest())
        return generate(*a, **kw)

    return wrapped


engine = getattr(trainer.rollout, "engine", trainer.rollout)  # a multi-turn rollout wraps the engine
if hasattr(engine, "llm"):
    engine.llm.generate = recording_states(engine.llm.generate)
engine_calls = []  # per engine generate call: the rows it generated for (multi-turn: one call per turn)


def counting_rows(generate):
    def wrapped(prompt_ids, *a, **kw):
        engine_calls.append(len(prompt_ids))
        return generate(prompt_ids, *a, **kw)

    return wrapped


engine.generate = counting_rows(engine.generate)


def kill_after(fn, at_global_step):
    def wrapped(*a, **kw):
        result = fn(*a, **kw)
        if trainer.global_step == at_global_step:
            print(f"[worker] SIGKILL at {args.kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return wrapped


if args.kill_at:
    phase, step = args.kill_at.split("@")
    step = int(step)
    if phase == "update":  # global_step counts finished steps, so step STEP runs at STEP - 1
        trainer.actor.update = kill_after(trainer.actor.update, step - 1)
    else:
        setattr(dsrl.checkpoint.save, phase, kill_after(getattr(dsrl.checkpoint.save, phase), step))

if args.skip_push:
    trainer.rollout.update_weights = lambda named_tensors: deque(named_tensors, maxlen=0)

code = 0
try:
    trainer.fit()
except TrainingInterrupted as err:
    code = err.exit_code
except TrainingStopped as err:  # every rank raised it at the same step; rank 0 reports it
    if trainer.rank == 0:
        print(f"dsrl: {err}", file=sys.stderr, flush=True)
    code = 1
llm = getattr(engine, "llm", None)
tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size if llm is not None else None
report = {
    "world": trainer.world_size,
    "rollout": type(engine).__name__,
    "multi_turn": engine is not trainer.rollout,
    "engine_calls": engine_calls,
    "tp": tp,
    "logged": logged,
    "generator_states": generator_states,
    "model_dir": str(getattr(trainer, "model_dir", "")),
}
(out / f"rank{trainer.rank}.json").write_text(json.dumps(report))
if code == 1:
    leave_together(code)  # every rank has written its report before the launcher sees one of them fail
sys.exit(code)
