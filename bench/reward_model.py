"""PPO scored by a reward model on a CPU: the quickstart's warm start trained on a tiny reward model's scores alone,
against the same PPO trained on the rule that checks an answer.

    python scripts/make_tiny_model.py && python scripts/make_tiny_model.py --reward-model
    python scripts/prepare_data.py --task arithmetic
    python bench/reward_model.py                    # 3 arms x 3 seeds x 50 steps, two runs at a time
    python bench/reward_model.py --report-only      # the table again, from the runs in --out

The policy is the quickstart's model (``outputs/tiny_model``); the reward model (``outputs/tiny_reward_model``,
``make_tiny_model.py --reward-model``) is the same warm start with a one-label score head, trained with the
Bradley-Terry loss to rank the true answer above each wrong answer the warm start samples at temperature 1: it never
saw the policy's later samples, nor the rule.

Each run is the recipe's CPU command, ``scripts/train.py configs/ppo_rm.yaml configs/cpu.yaml
configs/ppo_rm_cpu.yaml`` (PPO with GAE and a critic, 64 prompts a step in two mini-batches, greedy validation on
the 200 test sums before training and every 10 steps), with ``trainer.seed=S`` (the sampling; the prompts and their
order are the same in every run), one process on one thread, tracked into ``--out``/mlflow.db (experiment
``reward-model-bench``, run ``<arm>-seed<S>``). Both arms set a reward function (``bench/reward_model_functions.py``)
that logs the rule's exact match as the extra ``acc`` beside the reward:

- ``rm``: the reward is the reward model's score, the number the recipe trains on without a function;
- ``rm+kl``: the same, less ``KL_COEF`` x (log p_policy - log p_reference) at each token (``use_kl_in_reward``,
  InstructGPT's guard against over-optimising the reward model; the reference is the warm start);
- ``rule``: the reward is the rule's exact match (1 or 0); the reward model still scores every response, unused.

Printed: how often the reward model scores the true answer of a validation sum above a near miss (the true sum +
d, for d in ``OFFSETS``); then per arm: the validation's exact match (``val-core/arithmetic/acc/mean@1``) at step 0
and at the last step (mean over the seeds ± the half-width of the 95% Student-t interval, as dsrl-compare reports,
and each seed's), the seeds' mean at the validations between, the validation's mean reward-model score
(``val-aux/arithmetic/reward_model_score/mean@1``) at the two ends, and the median ``timing_s/step`` and
``timing_s/reward`` (the reward model's forward and the function) over steps 2.. (the first includes one-off warm-up).
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

RECIPE = ["configs/ppo_rm.yaml", "configs/cpu.yaml", "configs/ppo_rm_cpu.yaml"]
FUNCTIONS = "custom_reward_function"
# The rm+kl arm's penalty per token of log p_policy - log p_reference in the reward (the reference is the warm start);
# the reward model's scores span about -10..10 (seed 1, one run each: 0.5 drifts as without, 2 holds)
KL_COEF = 2.0
ARMS = {
    "rm": [f"{FUNCTIONS}.path=bench/reward_model_functions.py", f"{FUNCTIONS}.name=reward_model_score"],
    "rm+kl": [
        f"{FUNCTIONS}.path=bench/reward_model_functions.py",
        f"{FUNCTIONS}.name=reward_model_score",
        "algorithm.use_kl_in_reward=true",
        f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
    ],
    "rule": [f"{FUNCTIONS}.path=bench/reward_model_functions.py", f"{FUNCTIONS}.name=rule_score"],
}
EXPERIMENT = "reward-model-bench"
ACC, RM = "val-core/arithmetic/acc/mean@1", "val-aux/arithmetic/reward_model_score/mean@1"
REWARD_MODEL = "outputs/tiny_reward_model"  # configs/ppo_rm_cpu.yaml's
OFFSETS = (-10, -2, -1, 1, 2, 10)  # wrong answers: the true sum plus these


def near_misses() -> tuple[dict[int, float], int]:
    """The share of the validation sums on which the reward model scores the true answer above the true sum + d, for
    each d of ``OFFSETS`` (make_tiny_model.py's ranking, as dsrl's engine scores), and the number of sums."""
    from transformers import AutoModelForSequenceClassification

    from dsrl.data import arithmetic
    from dsrl.engines.reward_model import LastTokenScore

    module = make_tiny_model()
    tokenizer = module.build_tokenizer()
    scorer = LastTokenScore(AutoModelForSequenceClassification.from_pretrained(ROOT / REWARD_MODEL).eval())
    val = arithmetic.problems("test", arithmetic.DEFAULT_TEST_SIZE, arithmetic.DEFAULT_SEED)

    def sequence(a: int, b: int, text: str) -> list[int]:
        return (
            module.prompt_ids(tokenizer, a, b)
            + tokenizer(text, add_special_tokens=False)["input_ids"]
            + [tokenizer.eos_token_id]
        )

    found = {}
    for d in OFFSETS:
        pairs = [(sequence(a, b, str(a + b)), sequence(a, b, str(a + b + d))) for a, b in val if a + b + d >= 0]
        found[d] = module.ranked_right(scorer, pairs, tokenizer.pad_token_id)
    return found, len(val)


def figures(client, experiment: str, name: str) -> dict:
    """One run's validation exact match and reward-model score by step, its median step and reward seconds."""
    from dsrl.commands import compare

    run_id = compare.read_run(client, experiment, name)["run_id"]
    return {
        "acc": history(client, run_id, ACC),
        "rm": history(client, run_id, RM),
        "step_s": median_after_first(client, run_id, "timing_s/step"),
        "reward_s": median_after_first(client, run_id, "timing_s/reward"),
    }


def report(found: dict[str, dict[int, dict]], seeds: list[int], steps: int) -> None:
    """The table: one row per arm, over its seeds."""
    columns, curves = curve(found, "acc", seeds, steps, ("exact match, ", ""))
    columns += ["RM score, step 0", f"step {steps}", "step s", "reward s"]
    rows = []
    for arm, runs in found.items():
        mean = lambda value, runs=runs: statistics.fmean(value(run) for run in runs.values())  # noqa: E731
        rows.append([arm, *curves[arm], f"{mean(lambda run: run['rm'][0]):+.2f}"])
        rows[-1] += [f"{mean(lambda run: run['rm'][steps]):+.2f}", f"{mean(lambda run: run['step_s']):.2f}"]
        rows[-1] += [f"{mean(lambda run: run['reward_s']):.2f}"]
    print_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, list(ARMS), [1, 2, 3], "outputs/reward_model_bench", argv)
    names, code = train_arms(RECIPE, ARMS, args, EXPERIMENT)
    if code != 0:
        return code
    ranked, problems = near_misses()
    print(
        f"\n{REWARD_MODEL} on the {problems} validation sums, the true answer scored above the true sum + d: "
        + ", ".join(f"d={d:+d} {share:.1%}" for d, share in ranked.items())
    )
    client, experiment = tracking(args.out, EXPERIMENT)
    found = {arm: {seed: figures(client, experiment, names[arm, seed]) for seed in args.seeds} for arm in args.arms}
    report(found, args.seeds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
