"""On-policy distillation on a CPU: the quickstart's warm start teaches a weaker copy of itself, against GRPO alone.

    python scripts/make_tiny_model.py                                            # the teacher, outputs/tiny_model
    python scripts/make_tiny_model.py --sft-steps 120 --out outputs/tiny_student # the student
    python scripts/prepare_data.py --task arithmetic
    python bench/distillation.py                    # 4 arms x 5 seeds x 50 steps, two runs at a time
    python bench/distillation.py --report-only      # the tables again, from the runs in --out

The teacher is the quickstart's model (``scripts/make_tiny_model.py``: supervised until its probe reaches 25%, 135
steps with seed 0); the student is the same network and seed stopped after 120 of those steps, so it shares the
teacher's tokenizer and is weaker (greedy exact match on the 200 validation sums 35% and 12% when built here;
the accuracy rises steeply over these steps, so another CPU's kernels may land a few points away).

Each run is the recipe's CPU command, ``scripts/train.py configs/distill.yaml configs/cpu.yaml
configs/distill_cpu.yaml`` (32 prompts x 4 responses a step, one optimizer step a batch, greedy validation on the
200 test sums before training and every 10 steps), with ``trainer.seed=S`` (the sampling; the prompts and their
order are the same in every run), one process on one thread, tracked into ``--out``/mlflow.db (experiment
``distillation-bench``, run ``<arm>-seed<S>``). The arms differ in ``distillation.distillation_loss`` only:

- ``distill``: the recipe, k1 as each token's reward in the clipped policy-gradient loss, no task loss;
- ``distill+task``: the same beside GRPO's loss of the task's reward (``use_task_rewards=true``, coef 1);
- ``k3``: verl's default form, k3 backpropagated (``loss_mode=k3``, ``use_policy_gradient=false``), no task loss;
- ``grpo``: GRPO alone on the task's reward (``use_task_rewards=true``, ``distillation_loss_coef=0``: the teacher
  still scores the samples, so ``distillation/reverse_kl`` is measured, but it adds nothing to the gradient).

Printed: the teacher's and the student's greedy exact match on the validation sums (``make_tiny_model.py``'s
``greedy_accuracy``, what the validation measures); then per arm the validation score
(``val-core/arithmetic/reward/mean@1``) at step 0 and at the last step (mean over the seeds ± the half-width of
the 95% Student-t interval, as dsrl-compare reports, and each seed's), the seeds' mean at the validations between,
``distillation/reverse_kl`` (the mean over a step's sampled tokens of log p_student - log p_teacher, under the
policy that sampled them) averaged over the first 5 and the last 5 steps, and the median ``timing_s/step`` and
``timing_s/teacher`` over steps 2.. (the first includes one-off warm-up).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dsrl before an installed one

from recipe_runs import (  # noqa: E402  (bench/, the script's own folder)
    arguments,
    curve,
    history,
    make_tiny_model,
    median_after_first,
    print_table,
    tracking,
    train_arms,
)

RECIPE = ["configs/distill.yaml", "configs/cpu.yaml", "configs/distill_cpu.yaml"]
TEACHER, STUDENT = "outputs/tiny_model", "outputs/tiny_student"  # configs/distill_cpu.yaml's
LOSS = "distillation.distillation_loss"
ARMS = {
    "distill": [],
    "distill+task": [f"{LOSS}.use_task_rewards=true"],
    "k3": [f"{LOSS}.loss_mode=k3", f"{LOSS}.use_policy_gradient=false"],
    "grpo": [f"{LOSS}.use_task_rewards=true", f"{LOSS}.distillation_loss_coef=0"],
}
EXPERIMENT = "distillation-bench"
EDGE_STEPS = 5  # reverse KL: the mean of the first and of the last this many steps (all of a shorter run)


def edge(steps: int) -> int:
    """The steps averaged at each end of a run of ``steps``."""
    return min(EDGE_STEPS, steps)


def greedy_accuracies() -> tuple[dict[str, float], int]:
    """The teacher's and the student's greedy exact match on the validation sums (scripts/make_tiny_model.py's), and
    the number of sums."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrl.data import arithmetic

    module = make_tiny_model()
    val = arithmetic.problems("test", arithmetic.DEFAULT_TEST_SIZE, arithmetic.DEFAULT_SEED)
    found = {}
    for role, path in (("teacher", TEACHER), ("student", STUDENT)):
        model = AutoModelForCausalLM.from_pretrained(ROOT / path).eval()
        found[role] = module.greedy_accuracy(model, AutoTokenizer.from_pretrained(ROOT / path), val)
    return found, len(val)


def figures(client, experiment: str, name: str, steps: int) -> dict:
    """One run's validation by step, its reverse KL at the two ends, its median step and teacher seconds."""
    from dsrl.commands import compare

    run = compare.read_run(client, experiment, name)
    kl = history(client, run["run_id"], "distillation/reverse_kl")
    return {
        "validation": run["validation"],
        "kl_first": statistics.fmean(kl[s] for s in range(1, edge(steps) + 1)),
        "kl_last": statistics.fmean(kl[s] for s in range(steps - edge(steps) + 1, steps + 1)),
        "step_s": median_after_first(client, run["run_id"], "timing_s/step"),
        "teacher_s": median_after_first(client, run["run_id"], "timing_s/teacher"),
    }


def report(found: dict[str, dict[int, dict]], seeds: list[int], steps: int) -> None:
    """The table: one row per arm, over its seeds."""
    columns, curves = curve(found, "validation", seeds, steps, ("val, ", "val, "))
    columns += [f"reverse KL, steps 1-{edge(steps)}", f"steps {steps - edge(steps) + 1}-{steps}", "step s", "teacher s"]
    rows = []
    for arm, runs in found.items():
        mean = lambda key, runs=runs: statistics.fmean(run[key] for run in runs.values())  # noqa: E731
        rows.append([arm, *curves[arm], *(f"{mean(k):.3f}" for k in ("kl_first", "kl_last"))])
        rows[-1] += [f"{mean('step_s'):.2f}", f"{mean('teacher_s'):.2f}"]
    print_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, list(ARMS), [1, 2, 3, 4, 5], "outputs/distillation", argv)
    names, code = train_arms(RECIPE, ARMS, args, EXPERIMENT)
    if code != 0:
        return code
    accuracies, problems = greedy_accuracies()
    print(
        f"\ngreedy exact match on the {problems} validation sums: teacher ({TEACHER}) "
        f"{accuracies['teacher']:.3f}, student ({STUDENT}) {accuracies['student']:.3f}"
    )
    client, experiment = tracking(args.out, EXPERIMENT)
    found = {
        arm: {seed: figures(client, experiment, names[arm, seed], args.steps) for seed in args.seeds}
        for arm in args.arms
    }
    report(found, args.seeds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
