"""LoRA against full fine-tuning on the CPU quickstart: validation, peak memory and checkpoint size, a table.

    OMP_NUM_THREADS=1 python scripts/compare_lora.py                  # 100 steps an arm (~3 min each on 2 cores)
    OMP_NUM_THREADS=1 python scripts/compare_lora.py --steps 10 --arms full,lora
    OMP_NUM_THREADS=1 python scripts/compare_lora.py --model wide --steps 2 --arms full,lora

Each arm is one run of the quickstart (configs/grpo.yaml + configs/cpu.yaml + configs/quickstart.yaml: the tiny
model on two-number sums, GRPO, ZeRO-3 with CPU offload), in a process of its own, with the same seed, prompts and
steps; the model and data are built first when missing (scripts/quickstart.sh's paths). The arms:

- full: full fine-tuning at the quickstart's learning rate (2e-4);
- lora: adapters of rank 8, alpha 16 on every linear layer but the output layer, at 2e-3 (LoRA trains far fewer
  parameters and is usually run at ~10x the learning rate of full fine-tuning);
- lora-same-lr: the same adapters at the full arm's 2e-4.

``--model wide`` runs the arms on a 97M-parameter Qwen3 instead (the tiny model's tokenizer and vocabulary; hidden
1,024, 8 layers; random weights, built into outputs/wide_model), 8 prompts a step in micro-batches of 16 rows: its
validation scores mean nothing, its memory and checkpoint sizes show what the base weights' gradients and optimizer
states cost at a size where they dominate.

Columns: the validation score (val-core/arithmetic/reward/mean@1, greedy) before training and after the last
step; the trainable parameters; the run's peak resident memory (the trainer process and the workers it waited
for: ``os.wait4``'s ``ru_maxrss``); the size of the checkpoint written at the last step (``global_step_N``, all
of it) and of the actor's DeepSpeed files in it (``actor/ds``); the median seconds per step. Extra arguments are
dotted config overrides for every arm.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dsrl.commands.tiny_runs import build_tiny_inputs, markdown_table, run_logged

REPO = Path(__file__).resolve().parents[1]
RECIPE = [str(REPO / "configs" / name) for name in ("grpo.yaml", "cpu.yaml", "quickstart.yaml")]
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
ARMS = {
    "full": [],
    "lora": [*LORA, "actor_rollout_ref.actor.optim.lr=2e-3"],
    "lora-same-lr": LORA,
}
WIDE_BATCH = [
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
]
VALIDATION = re.compile(r"validation at step (\d+): val-core/arithmetic/reward/mean@1=([0-9.]+)")
STEP_SECONDS = re.compile(r" step \d+/\d+ .*step_s=([0-9.]+)")
ACTOR = re.compile(r"^\s*actor:\s+(ZeRO-.*)$", re.M)  # the start-up summary's line


def build_wide_model() -> Path:
    """outputs/wide_model: make_tiny_model.py --wide, 97M parameters, untrained (for memory, not learning)."""
    out = REPO / "outputs" / "wide_model"
    if not (out / "config.json").is_file():
        subprocess.run(
            [sys.executable, "scripts/make_tiny_model.py", "--wide", "--sft-steps", "0", "--out", str(out)],
            cwd=REPO,
            check=True,
        )
    return out


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def run_arm(name: str, steps: int, overrides: list[str], out: Path) -> dict:
    """One training run in a child process; its console output is kept in ``out/<name>.log``."""
    run_dir = out / name
    args = [
        sys.executable,
        "scripts/train.py",
        *RECIPE,
        *ARMS[name],
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        f"trainer.save_freq={steps}",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        *overrides,
    ]
    log = out / f"{name}.log"
    code, usage = run_logged(args, log, cwd=REPO)
    text = log.read_text()
    if code != 0:
        raise SystemExit(f"{name}: the run failed (exit {code}); see {log}")
    scores = {int(step): float(score) for step, score in VALIDATION.findall(text)}
    checkpoint = run_dir / f"global_step_{steps}"
    actor = ACTOR.search(text).group(1)
    trainable = re.search(r"([0-9.]+[KMB]?) trainable", actor)
    return {
        "arm": name,
        "val before": scores[0],
        "val after": scores[steps],
        "trainable": trainable.group(1) if trainable else re.search(r"([0-9.]+[KMB]?) params", actor).group(1),
        "peak RSS MiB": usage.ru_maxrss / 1024,
        "checkpoint MiB": folder_mib(checkpoint),
        "actor/ds MiB": folder_mib(checkpoint / "actor" / "ds"),
        "step s": statistics.median(float(s) for s in STEP_SECONDS.findall(text)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--model", choices=["tiny", "wide"], default="tiny", help="the quickstart's, or a 97M one")
    parser.add_argument("--keep", type=Path, help="keep the runs (logs, checkpoints) in this folder")
    args, overrides = parser.parse_known_args()
    arms = args.arms.split(",")
    if not set(arms) <= set(ARMS):
        parser.error(f"--arms {args.arms}: each must be one of {', '.join(ARMS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    build_tiny_inputs(REPO)
    if args.model == "wide":
        overrides = [f"actor_rollout_ref.model.path={build_wide_model()}", *WIDE_BATCH, *overrides]
    out = args.keep or Path(tempfile.mkdtemp(prefix="dsrl-compare-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows = [run_arm(name, args.steps, overrides, out) for name in arms]
    finally:
        if args.keep is None:
            shutil.rmtree(out, ignore_errors=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
