"""GRPO against GRPO with DAPO's dynamic sampling (algorithm.filter_groups) on the CPU quickstart: a table.

    OMP_NUM_THREADS=1 python scripts/compare_dynamic_sampling.py                 # 100 steps an arm (~3 min on 2 cores)
    OMP_NUM_THREADS=1 python scripts/compare_dynamic_sampling.py --steps 20 --val-every 5

Both arms run the quickstart (configs/grpo.yaml configs/cpu.yaml configs/quickstart.yaml, the arithmetic task's
0/1 exact-match reward) in this process with the same seed and the same number of optimizer steps (one per
step: the quickstart's mini-batch is its batch); the second adds algorithm.filter_groups (metric seq_reward,
the score). The model and data are built first when missing, as scripts/quickstart.sh does. Per arm:

- zero-adv groups: the share of the updates' groups whose responses all have the same score, so GRPO gives
  each a zero advantage and they teach nothing (read from the batch the estimator gets; 0 with filtering);
- rounds/step: generation rounds per step (train/num_gen_batches; 1 without filtering);
- gen tokens/step: response tokens generated per step, every round's included (validation's left out);
- train score: the updates' mean score (critic/score/mean; with filtering, over the kept groups only);
- val last K: the mean of the last K validations' score (val-core/arithmetic/reward/mean@1), and the curve.

One process only: the zero-advantage count reads the rank's own rows. Extra arguments are dotted config
overrides for both arms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from dsrl.commands.tiny_runs import build_tiny_inputs  # noqa: E402
from dsrl.config import ConfigError, load_and_validate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = [str(REPO / "configs" / name) for name in ("grpo.yaml", "cpu.yaml", "quickstart.yaml")]
FILTERING = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"]


def zero_advantage_share(group_ids, scores) -> tuple[int, int]:
    """(groups of two or more responses whose scores are all equal, groups) over rows ``group_ids`` [B] with
    ``scores`` [B]. A group of one is not counted: GRPO gives it mean 0, std 1, so its score is its advantage."""
    groups: dict[int, list[float]] = {}
    for gid, score in zip(group_ids.tolist(), scores.tolist(), strict=True):
        groups.setdefault(gid, []).append(score)
    zero = sum(len(members) > 1 and all(s == members[0] for s in members) for members in groups.values())
    return zero, len(groups)


def run_arm(overrides: list[str], out: Path) -> dict:
    """Train one arm in this process; the per-step spies' counts and the logged metrics."""
    from dsrl.trainer.loop import Trainer
    from dsrl.trainer.validation import validation_score

    cfg, _ = load_and_validate(QUICKSTART, [*overrides, f"trainer.default_local_dir={out}"], 1)
    trainer = Trainer(cfg)
    logged: list[tuple[int, dict[str, float]]] = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    counts = {"zero": 0, "groups": 0, "gen_tokens": []}
    in_step = [False]

    generate, advantages, step = trainer.generate, trainer.advantages, trainer.step

    def spy_generate(prompts, sampling):
        batch = generate(prompts, sampling)
        if in_step[0]:  # training rounds only, not validation
            counts["gen_tokens"][-1] += int(batch.response_mask.sum())
        return batch

    def spy_advantages(batch):
        zero, groups = zero_advantage_share(batch.group_ids, batch.token_level_rewards.sum(-1))
        counts["zero"] += zero
        counts["groups"] += groups
        return advantages(batch)

    def spy_step(prompts):
        in_step[0] = True
        counts["gen_tokens"].append(0)
        try:
            return step(prompts)
        finally:
            in_step[0] = False

    trainer.generate, trainer.advantages, trainer.step = spy_generate, spy_advantages, spy_step
    trainer.fit()
    steps = [m for _, m in logged if "training/global_step" in m]
    validations = [(s, validation_score(m)) for s, m in logged if any(k.startswith("val-core/") for k in m)]
    return {
        "steps": len(steps),
        "zero_share": counts["zero"] / counts["groups"],
        "rounds": statistics.mean(m.get("train/num_gen_batches", 1) for m in steps),
        "gen_tokens": statistics.mean(counts["gen_tokens"]),
        "score": statistics.mean(m["critic/score/mean"] for m in steps),
        "validations": validations,
        "step_s": statistics.mean(m["timing_s/step"] for m in steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per arm (the quickstart's 100)")
    parser.add_argument("--val-every", type=int, default=10, help="validate every N steps, and before training")
    parser.add_argument("--last", type=int, default=3, help="average the last K validations (default 3)")
    parser.add_argument("--max-rounds", type=int, default=10, help="algorithm.filter_groups.max_num_gen_batches")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    build_tiny_inputs(REPO)
    os.chdir(REPO)  # the CPU overlay's paths are relative to the checkout
    common = [
        *args.overrides,
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",  # the steps end each arm; filtering's extra rounds read past one epoch
        f"trainer.test_freq={args.val_every}",
        "trainer.val_before_train=true",
        "trainer.logger=[console]",
        "trainer.resume_mode=disable",
        "trainer.log_val_generations=0",
        "trainer.log_samples_freq=-1",
    ]
    arms = {
        "grpo": common,
        "grpo + dynamic sampling": [
            *common,
            *FILTERING,
            f"algorithm.filter_groups.max_num_gen_batches={args.max_rounds}",
        ],
    }
    try:
        for overrides in arms.values():
            load_and_validate(QUICKSTART, overrides, 1)
    except ConfigError as err:
        print("\n".join(err.violations), file=sys.stderr)
        return 2
    results = {}
    scratch = Path(tempfile.mkdtemp(prefix="dsrl-compare-"))
    try:
        for i, (name, overrides) in enumerate(arms.items()):
            results[name] = run_arm(overrides, scratch / str(i))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    k = args.last
    print(f"\nquickstart, {args.steps} optimizer steps per arm, seed 1, validation every {args.val_every} steps")
    header = (
        f"{'arm':<26}{'zero-adv groups':>16}{'rounds/step':>12}{'gen tokens/step':>16}{'train score':>12}"
        f"{f'val last {k}':>11}{'step s':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        last = statistics.mean(v for _, v in r["validations"][-k:])
        print(
            f"{name:<26}{r['zero_share']:>16.1%}{r['rounds']:>12.2f}{r['gen_tokens']:>16.0f}{r['score']:>12.3f}"
            f"{last:>11.3f}{r['step_s']:>8.2f}"
        )
    for name, r in results.items():
        print(f"validation curve, {name}: " + ", ".join(f"{s}:{v:.3f}" for s, v in r["validations"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
