"""GRPO with tools, TIR-OTB with tools and GRPO without tools on the calculator task, on CPU: a table.

    OMP_NUM_THREADS=1 python scripts/compare_tools.py                   # 30 steps an arm (~5 min on 2 cores)
    OMP_NUM_THREADS=1 python scripts/compare_tools.py --steps 5 --val-size 8

Each arm trains the tiny tool model (scripts/make_tiny_model.py --task calculator) on products of two 3-digit
numbers (scripts/prepare_data.py --task calculator), in this process, with the same seed, prompts and number of
optimizer steps (one per step), under configs/cpu.yaml and configs/calculator_cpu.yaml:

- grpo-tools: configs/grpo.yaml, multi-turn rollouts with the calculator (a call's result comes back as a
  tool message, the model answers in a second turn);
- tir-otb-tools: configs/tir_otb.yaml (algorithm.adv_estimator=tir_optimal_token_baseline), the same tools;
- grpo-no-tools: configs/grpo.yaml with actor_rollout_ref.rollout.multi_turn.enable=false: a call ends the
  response unanswered, so only a direct product can score, and the tiny model cannot multiply.

The GRPO arms drop the reference KL (actor_rollout_ref.actor.use_kl_loss=false) as TIR-OTB does, so the arms differ
in the estimator and the tools only. The model and data are built first when missing. Per arm:

- val acc: the validation score (val-core/calculator/reward/mean@N, N responses sampled at temperature 1 as
  configs/calculator_cpu.yaml sets) before and after training;
- val calls: the share of validation responses with a tool call (a ``<tool_call>`` in the decoded response,
  counted here from the generated batches, so it also counts the unanswered calls of the no-tools arm);
- train calls: tool calls per response in the first and the last step (the loop's ``CALLS_METRIC``; counted
  like val calls where the loop is off);
- gen tok/step: tokens the model generated per step (response_mask: tool outputs left out); resp tok/step: the
  responses' tokens, tool outputs included (response_attention); validation's left out of both;
- train score: the updates' mean score (critic/score/mean); step s: seconds per step.

One process only. Extra arguments are dotted config overrides for every arm.
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
CPU = [str(REPO / "configs" / name) for name in ("cpu.yaml", "calculator_cpu.yaml")]
ARMS = {  # name: (recipe, overrides)
    "grpo-tools": ("grpo.yaml", []),
    "tir-otb-tools": ("tir_otb.yaml", []),
    "grpo-no-tools": ("grpo.yaml", ["actor_rollout_ref.rollout.multi_turn.enable=false"]),
}
# What the agent loop logs per training step (dsrl.trainer.metrics); without the loop the table counts the calls itself.
CALLS_METRIC = "multi_turn/calls_per_response/mean"
CALL_MARK = "<tool_call>"


def call_counts(responses: list[str]) -> tuple[float, float]:
    """(share of responses with a tool call, tool calls per response) of decoded responses."""
    calls = [text.count(CALL_MARK) for text in responses]
    return sum(c > 0 for c in calls) / len(calls), sum(calls) / len(calls)


def arm_overrides(args: argparse.Namespace, name: str) -> tuple[list[str], list[str]]:
    """(config files, overrides) of one arm."""
    recipe, own = ARMS[name]
    common = [
        *args.overrides,
        f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",  # one optimizer step per batch
        f"actor_rollout_ref.rollout.n={args.n}",
        f"data.val_max_samples={args.val_size}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.steps}",
        "trainer.val_before_train=true",
        "trainer.logger=[console]",
        "trainer.resume_mode=disable",
        "trainer.log_val_generations=0",
        "trainer.log_samples_freq=-1",
    ]
    return [str(REPO / "configs" / recipe), *CPU], [*common, *own]


def run_arm(files: list[str], overrides: list[str], out: Path) -> dict:
    """Train one arm in this process; the logged metrics and the calls counted in the generated batches."""
    from dsrl.trainer.loop import Trainer
    from dsrl.trainer.validation import validation_score

    cfg, _ = load_and_validate(files, [*overrides, f"trainer.default_local_dir={out}"], 1)
    trainer = Trainer(cfg)
    logged: list[tuple[int, dict[str, float]]] = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    # per step / per validation: decoded responses, generated tokens, response tokens (tool outputs included)
    train: list[dict] = []
    val: list[list[str]] = []
    in_step = [False]
    generate, step = trainer.generate, trainer.step

    def spy_generate(prompts, sampling):
        batch = generate(prompts, sampling)
        texts = trainer.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        if in_step[0]:
            train[-1]["texts"] += texts
            train[-1]["gen_tokens"] += int(batch.response_mask.sum())
            train[-1]["resp_tokens"] += int(batch.response_attention.sum())
        else:
            val[-1] += texts
        return batch

    def spy_step(prompts):
        in_step[0] = True
        train.append({"texts": [], "gen_tokens": 0, "resp_tokens": 0})
        try:
            return step(prompts)
        finally:
            in_step[0] = False

    validate = trainer.validate

    def spy_validate():
        val.append([])
        return validate()

    trainer.generate, trainer.step, trainer.validate = spy_generate, spy_step, spy_validate
    trainer.fit()
    steps = [m for _, m in logged if "training/global_step" in m]
    validations = [validation_score(m) for _, m in logged if any(k.startswith("val-core/") for k in m)]
    calls = [
        m[CALLS_METRIC] if CALLS_METRIC in m else call_counts(counted["texts"])[1]
        for m, counted in zip(steps, train, strict=True)
    ]
    return {
        "steps": len(steps),
        "val_acc": (validations[0], validations[-1]),
        "val_calls": (call_counts(val[0])[0], call_counts(val[-1])[0]),
        "train_calls": (calls[0], calls[-1]),
        "gen_tokens": statistics.mean(t["gen_tokens"] for t in train),
        "resp_tokens": statistics.mean(t["resp_tokens"] for t in train),
        "score": statistics.mean(m["critic/score/mean"] for m in steps),
        "step_s": statistics.mean(m["timing_s/step"] for m in steps),
    }


def format_table(results: dict[str, dict]) -> list[str]:
    """The table's lines: a header, a rule and a row per arm (before -> after where there are two values)."""
    header = (
        f"{'arm':<16}{'val acc':>15}{'val calls':>15}{'train calls':>15}{'gen tok/step':>14}{'resp tok/step':>15}"
        f"{'train score':>13}{'step s':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        lines.append(
            f"{name:<16}{'{:.3f} -> {:.3f}'.format(*r['val_acc']):>15}{'{:.0%} -> {:.0%}'.format(*r['val_calls']):>15}"
            f"{'{:.2f} -> {:.2f}'.format(*r['train_calls']):>15}{r['gen_tokens']:>14.0f}{r['resp_tokens']:>15.0f}"
            f"{r['score']:>13.3f}{r['step_s']:>8.2f}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per arm (default 30)")
    parser.add_argument("--batch", type=int, default=4, help="prompts per step (data.train_batch_size, default 4)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (rollout.n, default 8)")
    parser.add_argument(
        "--val-size", type=int, default=32, help="validation prompts (data.val_max_samples, default 32)"
    )
    parser.add_argument(
        "--arms", nargs="+", choices=list(ARMS), default=list(ARMS), metavar="ARM", help=f"of {list(ARMS)}"
    )
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every arm")
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "n", "val_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    build_tiny_inputs(REPO, "calculator")
    os.chdir(REPO)  # the CPU overlays' paths are relative to the checkout
    arms = {name: arm_overrides(args, name) for name in args.arms}
    try:
        for files, overrides in arms.values():
            load_and_validate(files, overrides, 1)
    except ConfigError as err:
        print("\n".join(err.violations), file=sys.stderr)
        return 2
    results = {}
    scratch = Path(tempfile.mkdtemp(prefix="dsrl-compare-tools-"))
    try:
        for i, (name, (files, overrides)) in enumerate(arms.items()):
            results[name] = run_arm(files, overrides, scratch / str(i))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"\ncalculator task, tiny tool model, {args.steps} optimizer steps per arm, {args.batch} prompts x {args.n} "
        f"responses per step, {args.val_size} validation prompts, seed 1"
    )
    print("\n".join(format_table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
