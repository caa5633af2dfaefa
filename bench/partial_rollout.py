"""Partial rollout (``trainer.v1.trainer_mode=colocate_async``) against ``sync`` on a long-tail task, CPU quickstart.

The task: the quickstart (configs/grpo.yaml + cpu.yaml + quickstart.yaml: the tiny model on two-number sums, 32
prompts x 8 responses a step, transformers rollout at temperature 1, one rank, OMP_NUM_THREADS=1) with
``data.max_response_length=64``. Its warm start (outputs/tiny_model) has no tail: it ends every response within 6
tokens. So ``model`` builds outputs/tiny_long_tail_model from it: 150 steps (lr 3e-4, 64 problems a step) of
fine-tuning on its own answers, sampled at temperature 1, with soft targets (its next-token distributions, so the
answers keep their distribution), 5% of them behind a run of 24-56 spaces, which the arithmetic reward accepts
(surrounding whitespace): some responses "pause" before answering, at no cost in reward. Nothing else changes: the
same prompts, reward and validation file (outputs/data/arithmetic/test.parquet, 200 problems, greedy mean@1).

    python scripts/make_tiny_model.py && python scripts/prepare_data.py --task arithmetic   # the quickstart's inputs
    python bench/partial_rollout.py model       # outputs/tiny_long_tail_model (~2.5 min)
    python bench/partial_rollout.py lengths     # response lengths of both models at temperature 1
    python bench/partial_rollout.py timing --reps 2 --out outputs/partial_rollout/timing_chunk8 \\
        trainer.v1.colocate_async.chunk_tokens=8                                          # ~4.5 min
    python bench/partial_rollout.py timing --reps 3 --out outputs/partial_rollout/timing_default   # chunk_tokens 32
    python bench/partial_rollout.py learning trainer.v1.colocate_async.chunk_tokens=8   # dsrl-compare, 100 steps x 2
    python bench/partial_rollout.py learning --rollout-is token --arms colocate_async_is_token \\
        trainer.v1.colocate_async.chunk_tokens=8   # + colocate_async with algorithm.rollout_correction.rollout_is=token

``timing`` runs 20 steps of each mode, same seed (trainer.seed=1), alternately (sync, colocate_async, sync, ...), each
a ``scripts/train.py`` process tracking into ``--out``/mlflow.db, and prints per mode and run: ``timing_s/gen``
median and mean over steps 2..20 (the first includes one-off warm-up), the trained response tokens (``timing_s/gen``
/ ``timing_per_token_ms/gen``: the step's batch), gen seconds per 1k trained tokens, the median ``timing_s/step``;
the ratios colocate_async / sync; per step both modes' gen seconds and response lengths and the pool's
``training/off_policy/*`` metrics; the steps by their largest trajectory span against ``max_off_policy_threshold``.
``learning`` runs dsrl-compare (``--quick`` on the same task: one run per core, reference KL measured, validation
before training and at the last step) with one arm per mode and prints each arm's final validation, mean ± the
half-width of dsrl-compare's 95% Student-t interval over the seeds, against sync's. Key=value arguments go to every
run (``chunk_tokens`` does nothing in sync). ``--report-only`` prints the tables again from the runs in ``--out``.

Measured 2026-12-07 on a 2-core CPU machine shared with another engineer's test runs (load average 3-4 throughout):
quote the medians and ratios, not the absolute seconds.

Response lengths (tokens, the end token counted; 256 training prompts x 8 at temperature 1, cap 64; ``lengths``):

| model | median | p90 | p99 | max | mean | p99 / median | > 8 x median |
|---|---|---|---|---|---|---|---|
| outputs/tiny_model (the quickstart's) | 3 | 4 | 5 | 6 | 3.47 | 1.7 | 0.0% |
| outputs/tiny_long_tail_model | 4 | 4 | 49 | 64 | 4.82 | 12.2 | 2.5% |

(``model``: 150 steps in 141 s; greedy validation 35.0% -> 32.5%.)

``timing`` with ``chunk_tokens=8`` (2 repetitions of each mode; defaults otherwise: num_warmup_batches 1,
max_off_policy_threshold 8, strategy drop):

| mode | gen s/step median | gen s/step mean | trained tokens (20 steps) | gen s / 1k trained tokens | step s, median |
|---|---|---|---|---|---|
| sync | 1.62 | 1.47 | 20,530 | 1.452 | 2.35 |
| colocate_async | 0.84 | 0.92 | 20,942 | 0.869 | 1.56 |
| colocate_async / sync | 0.520 | 0.622 | 1.020 | 0.598 | 0.662 |

Per repetition, gen s/step (median) 0.543 and 0.497, gen s per trained token 0.612 and 0.585. Every step after the
first carried 32 groups and admitted 32, in one chunk, with no eviction; the steps by their largest trajectory span,
both repetitions: 1: 6, 3: 2, 4: 2, 5: 2, 6: 4, 7: 2, 8: 22 -- never above max_off_policy_threshold 8 (a response
of 64 tokens takes 8 chunks of 8). Spans mean 1.00-1.20 a step: most trained responses span one version.

Other settings, colocate_async / sync (ratios of the medians: gen s/step median, mean, per trained token; step s):

| chunk_tokens | repetitions | gen median | gen mean | gen per trained token | step | largest span |
|---|---|---|---|---|---|---|
| 32 (default) | 3 | 0.970 | 0.970 | 0.946 | 0.947 | 2 |
| 16 | 2 | 0.726 | 0.792 | 0.777 | 0.858 | 4 |
| 8 | 2 | 0.520 | 0.622 | 0.598 | 0.662 | 8 |
| 32, rollout.micro_batch_size=512 | 3 | 1.171 | 1.211 | 1.173 | 1.082 | 2 |

Why the default chunk gains nothing on this engine: a transformers ``generate`` call runs until its longest row
ends, and ``generate_until`` splits the running responses into calls of ``rollout.micro_batch_size`` (64) rows,
each response its own prompt (sync's call holds 32 prompts x 8 = 256 rows). With 2.5% of responses long, a call of
64 new rows holds one with probability ~0.8 and runs the whole chunk; the carried rows (prompt + the tokens so far)
come first and the first call's new rows are left-padded to their width (one 32-token call of 256 rows: 1.1-1.6 s
at width 25, 2.2-2.3 s at width 57). So with chunk 32 every step pays ~32 tokens in 5 calls, sync 45-64 tokens in
one call on most steps and 0.2 s on the steps without a long response. One call of all the rows (micro-batch 512)
pads every new row to the carried ones: slower still. Shorter chunks bound what every step pays.

``learning`` (dsrl-compare ``--quick``: 100 steps, seeds 1 and 2, two runs at a time; both colocate_async arms with
``chunk_tokens=8``, the setting timed above; greedy validation on the 200 problems, 0.325 before training in every
run):

| arm | seed 1 | seed 2 | mean ± 95% half-width | each run's wall time |
|---|---|---|---|---|
| sync | 0.620 | 0.605 | 0.613 ± 0.095 | 16.6, 13.3 min |
| colocate_async | 0.340 | 0.285 | 0.312 ± 0.35 | 16.7, 12.7 min |
| colocate_async, algorithm.rollout_correction.rollout_is=token | 0.595 | 0.435 | 0.515 ± 1.0 | 6.6, 6.6 min |

colocate_async with the defaults learns less: its mean is 0.30 below sync's, under sync's interval (0.517-0.708);
only its own interval (two seeds: t(0.975, 1) = 12.7) is wide enough to overlap sync's. The training score agrees
(critic/score/mean over the last 25 steps 0.122 against 0.283). Almost every trained group is one policy version
old (trajectory_staleness mean ~1.0: with one warm-up batch the pool holds 64 groups, ~50 complete after the
first chunk and the step trains the 32 oldest, so each short group waits one step), and nothing corrects for it: the
PPO ratio is taken against old log-probs recomputed under the current policy (pg_clipfrac 0), while
rollout_corr/is_ratio spans 0.2-7 at the quickstart's learning rate. With token-level importance sampling the gap
shrinks to 0.10 (seed 1 0.595 against 0.620), the mean just under sync's lower end (0.515 < 0.517), the intervals
overlapping: not shown no worse; two seeds cannot tell. The runs of the first table shared the machine with the
other engineer's tests; the rollout_is pair ran on a quieter machine.

Fewer groups in flight beyond the batch fix it (the same day, the same machine, run as ``dsrl-compare`` with an arm
of ``trainer.v1.colocate_async.num_warmup_batches: 0.25`` and the flags above, which is what
``learning trainer.v1.colocate_async.chunk_tokens=8 trainer.v1.colocate_async.num_warmup_batches=0.25`` runs):
validation 0.560 and 0.605 (mean 0.583, within sync's interval), trajectory_staleness mean 0.23; and
``timing --reps 2 trainer.v1.colocate_async.chunk_tokens=8 trainer.v1.colocate_async.num_warmup_batches=0.25``:
gen s/step 0.610x sync's at the median (per repetition 0.638, 0.589), 0.695x in the mean, 0.698x per trained token,
trained tokens 0.985x, step 0.762x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dsrl before an installed one (the imports below, in functions)

from recipe_runs import make_tiny_model  # noqa: E402  (bench/, the script's own folder)

MODES = ("sync", "colocate_async")
RECIPE = ["grpo", "cpu", "quickstart"]  # the quickstart's configs (scripts/quickstart.sh)
BASE_MODEL = "outputs/tiny_model"  # python scripts/make_tiny_model.py
MODEL = "outputs/tiny_long_tail_model"  # python bench/partial_rollout.py model
TRAIN_FILE = "outputs/data/arithmetic/train.parquet"  # python scripts/prepare_data.py --task arithmetic
MAX_RESPONSE = 64  # data.max_response_length (the quickstart's 8 would cut the tail)
TAIL_SHARE = 0.05  # share of the fine-tune's responses that start with a run of spaces
TAIL_SPACES = (24, 56)  # the run's length, uniform
TUNE_STEPS, TUNE_BATCH, TUNE_LR = 150, 64, 3e-4
EXPERIMENT = "partial-rollout-bench"
OFF_POLICY = "training/off_policy"


# ---- the long-tail model --------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> int:
    """The quickstart's warm start fine-tuned on its own samples, 5% of them behind a run of 24-56 spaces."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrl.data import arithmetic

    mtm = make_tiny_model()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / args.base)
    teacher = AutoModelForCausalLM.from_pretrained(ROOT / args.base).eval()
    model = AutoModelForCausalLM.from_pretrained(ROOT / args.base)
    pool = arithmetic.problems("train", arithmetic.TRAIN_POOL_SIZE, args.seed)
    rng = random.Random(args.seed)
    [space] = tokenizer(" ", add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def step_loss():
        """Soft targets: the warm start's next-token distributions at the answer's positions (after the spaces,
        those it gives without them), so the answers keep its distribution; the run of spaces as hard targets."""
        prompts = [mtm.prompt_ids(tokenizer, a, b) for a, b in rng.sample(pool, TUNE_BATCH)]
        encoded = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        with torch.no_grad():  # the warm start's own answers at the rollout's temperature
            sampled = teacher.generate(
                **encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                eos_token_id=eos, pad_token_id=pad,
            )[:, encoded["input_ids"].shape[1] :].tolist()  # fmt: skip
        answers = [r[: r.index(eos) + 1] if eos in r else r for r in sampled]
        spaces = [rng.randint(*TAIL_SPACES) if rng.random() < TAIL_SHARE else 0 for _ in prompts]
        plain = [p + a for p, a in zip(prompts, answers, strict=True)]
        padded = [p + [space] * k + a for p, k, a in zip(prompts, spaces, answers, strict=True)]
        with torch.no_grad():
            soft = teacher(**right_padded(plain, pad)).logits.softmax(-1)
        log_probs = model(**right_padded(padded, pad)).logits.log_softmax(-1)
        losses = []
        for row, (prompt, k, answer) in enumerate(zip(prompts, spaces, answers, strict=True)):
            first = len(prompt) - 1  # the position that predicts the response's first token
            losses += [-log_probs[row, first + i, space] for i in range(k)]
            for j in range(len(answer)):
                losses.append(-(soft[row, first + j] * log_probs[row, first + k + j]).sum())
        return torch.stack(losses).mean()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    for _ in range(args.steps):
        model.train()
        loss = step_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    out = ROOT / args.out
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    val = arithmetic.problems("test", arithmetic.DEFAULT_TEST_SIZE, arithmetic.DEFAULT_SEED)
    before, after = (mtm.greedy_accuracy(m, tokenizer, val) for m in (teacher, model))
    print(
        f"{args.out}: {args.steps} steps at lr {args.lr:g} (last loss {loss:.3f}) in "
        f"{time.perf_counter() - start:.0f} s; greedy exact match on the {len(val)} validation problems "
        f"{before:.1%} ({args.base}) -> {after:.1%}"
    )
    return 0


def right_padded(sequences: list[list[int]], pad: int) -> dict:
    import torch

    width = max(map(len, sequences))
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in sequences]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]),
    }


def quantile(values: list[int], q: float) -> float:
    """The ``q`` quantile of sorted ``values``, nearest rank."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def lengths(args: argparse.Namespace) -> int:
    """The response lengths (tokens, the end token counted, as ``response_length``) the model samples at temperature
    1 for the first ``--prompts`` training prompts, ``n`` each: the rollout's distribution, plain ``generate``."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    print("| model | responses | median | p90 | p99 | max | mean | p99 / median | > 8 x median | at the cap |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        tokenizer = AutoTokenizer.from_pretrained(ROOT / name)
        model = AutoModelForCausalLM.from_pretrained(ROOT / name).eval()
        rows = pq.read_table(ROOT / TRAIN_FILE).to_pylist()[: args.prompts]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
        found = []
        for start in range(0, len(texts), 32):
            encoded = tokenizer(texts[start : start + 32], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(
                    **encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.cap,
                    num_return_sequences=args.n, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
            for response in out[:, encoded["input_ids"].shape[1] :].tolist():
                end = response.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in response else args.cap
                found.append(min(end, args.cap))
        found.sort()
        median = statistics.median(found)
        print(
            f"| {name} | {len(found)} | {median:g} | {quantile(found, 0.9):g} | {quantile(found, 0.99):g} | "
            f"{found[-1]} | {statistics.fmean(found):.2f} | {quantile(found, 0.99) / median:.1f} | "
            f"{sum(x > 8 * median for x in found) / len(found):.1%} | "
            f"{sum(x == args.cap for x in found) / len(found):.1%} |"
        )
    return 0


# ---- the runs -------------------------------------------------------------------------------------------------


def run_env(store: Path) -> dict[str, str]:
    """The runs' environment: MLflow store, this checkout's dsrl, the quickstart's threads."""
    # scripts/train.py would import an installed dsrl before this checkout's: the checkout first on the path
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")  # scripts/quickstart.sh's defaults
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def train_command(mode: str, name: str, args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable, "scripts/train.py", *(f"configs/{c}.yaml" for c in RECIPE),
        f"actor_rollout_ref.model.path={args.model}",
        f"data.max_response_length={MAX_RESPONSE}",
        f"trainer.v1.trainer_mode={mode}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.seed={args.seed}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.log_val_generations=0",
        "trainer.log_samples_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "trainer.logger=[console,mlflow]", f"trainer.project_name={EXPERIMENT}", f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={out / 'runs' / name}",
        *args.overrides,
    ]  # fmt: skip


def history(client, run_id: str, key: str) -> dict[int, float]:
    from dsrl.tracking import sanitize_metric_name

    return {m.step: m.value for m in client.get_metric_history(run_id, sanitize_metric_name(key))}


def run_figures(client, run_id: str, steps: int) -> dict:
    """One run's per-step metrics and its summary over steps 2..steps (the first includes one-off warm-up)."""
    keys = ["timing_s/gen", "timing_s/step", "timing_per_token_ms/gen", "response_length/mean", "response_length/max"]
    keys += [f"{OFF_POLICY}/{k}" for k in ("chunks", "groups_carried", "groups_admitted", "evicted_samples")]
    keys += [
        f"{OFF_POLICY}/{name}/{stat}"
        for name in ("trajectory_spans", "trajectory_staleness_worst")
        for stat in ("mean", "max", "min")
    ]
    per_step = {key: history(client, run_id, key) for key in keys}
    gen, ms = per_step["timing_s/gen"], per_step["timing_per_token_ms/gen"]
    tokens = {s: gen[s] * 1000 / ms[s] for s in gen if ms.get(s)}  # the step's response tokens, all trained
    later = [s for s in sorted(gen) if 2 <= s <= steps]
    return {
        "per_step": per_step,
        "tokens": tokens,
        "gen_median": statistics.median(gen[s] for s in later),
        "gen_mean": statistics.fmean(gen[s] for s in later),
        "step_median": statistics.median(per_step["timing_s/step"][s] for s in later),
        "trained_tokens": sum(tokens.values()),
        "gen_per_1k": 1000 * sum(gen[s] for s in later) / sum(tokens[s] for s in later),
        "length_mean": statistics.fmean(per_step["response_length/mean"].values()),
    }


def span_histogram(per_step: dict, rows: int) -> dict[int, int] | None:
    """Trained responses by the policy versions they span, summed over the steps; exact from each step's mean, min
    and max where they differ by at most 1 (the mean then gives the count at the max); None where one does not."""
    counts: dict[int, int] = {}
    means, lows, highs = (per_step[f"{OFF_POLICY}/trajectory_spans/{s}"] for s in ("mean", "min", "max"))
    for step, mean in means.items():
        low, high = int(lows[step]), int(highs[step])
        if high - low > 1:
            return None
        at_high = round((mean - low) * rows) if high > low else rows
        counts[high] = counts.get(high, 0) + at_high
        if high > low:
            counts[low] = counts.get(low, 0) + rows - at_high
    return dict(sorted(counts.items()))


def timing(args: argparse.Namespace) -> int:
    """Alternate the modes (sync, colocate_async, sync, ...) ``--reps`` times, then the tables."""
    from mlflow import MlflowClient

    out = (ROOT / args.out).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    store = out / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    if client.get_experiment_by_name(EXPERIMENT) is None:
        client.create_experiment(EXPERIMENT)
    walls: dict[str, float] = {}
    if not args.report_only:
        for rep in range(1, args.reps + 1):
            for mode in MODES:
                name = f"{mode}-rep{rep}"
                command = train_command(mode, name, args, out)
                print(f"$ {' '.join(command)}", flush=True)
                begin = time.perf_counter()
                with open(out / "runs" / f"{name}.log", "w") as log:
                    run = subprocess.run(command, cwd=ROOT, env=run_env(store), stdout=log, stderr=subprocess.STDOUT)
                code = run.returncode
                walls[name] = time.perf_counter() - begin
                print(f"{name}: exit {code} in {walls[name]:.0f} s (log {out / 'runs' / name}.log)", flush=True)
                if code != 0:
                    return code
        (out / "walls.json").write_text(json.dumps(walls, indent=1))
    elif (out / "walls.json").exists():
        walls = json.loads((out / "walls.json").read_text())
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    runs: dict[str, dict[int, dict]] = {mode: {} for mode in MODES}
    for rep in range(1, args.reps + 1):
        for mode in MODES:
            [run] = client.search_runs(
                [experiment], f"tags.mlflow.runName = '{mode}-rep{rep}'", order_by=["attributes.start_time DESC"],
                max_results=1,
            )  # fmt: skip
            runs[mode][rep] = run_figures(client, run.info.run_id, args.steps)
            runs[mode][rep]["wall"] = walls.get(f"{mode}-rep{rep}", math.nan)
    report(runs, args)
    return 0


def report(runs: dict[str, dict[int, dict]], args: argparse.Namespace) -> None:
    """The table per mode and run, the ratios, then per step the tail, the pool and the versions."""
    later = f"steps 2..{args.steps}"
    print(f"\noverrides: {' '.join(args.overrides) or 'none'}\n")
    print(
        f"| mode | run | gen s/step, median ({later}) | gen s/step, mean | trained response tokens ({args.steps} "
        f"steps) | gen s per 1k trained tokens ({later}) | step s, median | response length, mean | process wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fields = ("gen_median", "gen_mean", "trained_tokens", "gen_per_1k", "step_median", "length_mean", "wall")
    formats = ("{:.2f}", "{:.2f}", "{:,.0f}", "{:.3f}", "{:.2f}", "{:.2f}", "{:.0f}")

    def cells(values: dict) -> str:
        return " | ".join(f.format(values[k]) for f, k in zip(formats, fields, strict=True))

    medians = {}
    for mode, by_rep in runs.items():
        for rep, fig in by_rep.items():
            print(f"| {mode} | rep {rep} | {cells(fig)} |")
        medians[mode] = {k: statistics.median(fig[k] for fig in by_rep.values()) for k in fields}
        print(f"| **{mode}** | median | {cells(medians[mode])} |")
    sync, part = (runs[m] for m in MODES)
    print()
    for key, what in (
        ("gen_median", "gen s/step (median)"),
        ("gen_mean", "gen s/step (mean)"),
        ("gen_per_1k", "gen s per trained token"),
        ("step_median", "step s (median)"),
        ("trained_tokens", "trained tokens"),
    ):
        pairs = [part[rep][key] / sync[rep][key] for rep in sync if rep in part]
        print(
            f"- colocate_async / sync, {what}: {medians['colocate_async'][key] / medians['sync'][key]:.3f} (ratio "
            f"of the medians); per repetition {', '.join(f'{r:.3f}' for r in pairs)}"
        )
    first = part[min(part)]["per_step"]
    off = {key: values for key, values in first.items() if key.startswith(OFF_POLICY)}
    same = all({k: v for k, v in fig["per_step"].items() if k.startswith(OFF_POLICY)} == off for fig in part.values())
    print(
        f"\nper step (gen s of each repetition; the rest is the first repetition's, "
        f"{'the same in every one' if same else 'NOT the same in every one'}):\n"
    )
    print(
        "| step | sync gen s | sync response length mean / max | colocate_async gen s | response length mean / max | "
        "chunks | groups carried | admitted | evicted samples | spans mean / max | staleness (worst) max |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    head = sync[min(sync)]["per_step"]

    def at(key: str, step: int) -> float:
        return first[f"{OFF_POLICY}/{key}"].get(step, math.nan)

    for step in sorted(first["timing_s/gen"]):
        gens = [", ".join(f"{fig['per_step']['timing_s/gen'][step]:.2f}" for fig in r.values()) for r in (sync, part)]
        print(
            f"| {step} | {gens[0]} | {head['response_length/mean'][step]:.2f} / "
            f"{head['response_length/max'][step]:.0f} "
            f"| {gens[1]} | {first['response_length/mean'][step]:.2f} / {first['response_length/max'][step]:.0f} | "
            f"{at('chunks', step):.0f} | {at('groups_carried', step):.0f} | {at('groups_admitted', step):.0f} | "
            f"{at('evicted_samples', step):.0f} | {at('trajectory_spans/mean', step):.3f} / "
            f"{at('trajectory_spans/max', step):.0f} | {at('trajectory_staleness_worst/max', step):.0f} |"
        )
    spans = [v for fig in part.values() for v in fig["per_step"][f"{OFF_POLICY}/trajectory_spans/max"].values()]
    by_max = {int(v): spans.count(v) for v in sorted(set(spans))}
    print(
        f"\nsteps by their largest span (all repetitions): {', '.join(f'{v}: {c}' for v, c in by_max.items())}; "
        f"largest {max(spans):.0f}, max_off_policy_threshold {args.threshold}: "
        f"{'never exceeded' if max(spans) <= args.threshold else 'EXCEEDED'}"
    )
    hist = span_histogram(first, 32 * 8)  # data.train_batch_size x rollout.n of the quickstart
    if hist is not None:
        print(f"trained responses by span (first repetition): {', '.join(f'{v}: {c}' for v, c in hist.items())}")


# ---- the learning check ---------------------------------------------------------------------------------------


def learning(args: argparse.Namespace) -> int:
    """dsrl-compare, one arm per mode (a one-key YAML each, merged before the quickstart's configs)."""
    out = (ROOT / args.out).resolve()
    arms = out / "arms"
    arms.mkdir(parents=True, exist_ok=True)
    files = []
    variants = {mode: {"trainer": {"v1": {"trainer_mode": mode}}} for mode in MODES}
    if args.rollout_is:
        variants[f"colocate_async_is_{args.rollout_is}"] = {
            **variants["colocate_async"], "algorithm": {"rollout_correction": {"rollout_is": args.rollout_is}},
        }  # fmt: skip
    for label, content in variants.items():
        if args.arms and label not in args.arms:
            continue
        path = arms / f"{label}.yaml"
        path.write_text(json.dumps(content) + "\n")  # JSON is YAML
        files.append(str(path))
    command = [
        sys.executable, "-m", "dsrl.commands.compare", *files, "--quick", "--task", *RECIPE,
        "--steps", str(args.steps), "--val-every", str(args.steps), "--seeds", args.seeds,
        "--experiment", f"{EXPERIMENT}-learning", "--out", str(out / "compare"),
        f"actor_rollout_ref.model.path={args.model}", f"data.max_response_length={MAX_RESPONSE}",
        "data.val_max_samples=-1", *args.overrides,
    ]  # fmt: skip
    if not args.report_only:
        print(f"$ {' '.join(command)}", flush=True)
        begin = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
        print(f"dsrl-compare: exit {code} in {time.perf_counter() - begin:.0f} s", flush=True)
        if code != 0:
            return code
    chosen = [label for label in variants if label != "sync" and (not args.arms or label in args.arms)]
    verdict(out / "compare", ["sync", *chosen], args)  # sync's runs from an earlier call when not chosen here
    return 0


def verdict(folder: Path, labels: list[str], args: argparse.Namespace) -> None:
    """Each arm's final validation, mean ± the 95% Student-t half-width over the seeds (dsrl-compare's own
    functions, on the runs in its MLflow store: seeds run in separate calls count together), against sync's."""
    from mlflow import MlflowClient

    from dsrl.commands import compare

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(f"{EXPERIMENT}-learning").experiment_id
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {
        label: {seed: compare.read_run(client, experiment, f"{label}-seed{seed}") for seed in seeds} for label in labels
    }
    report = compare.build_report([compare.Arm(label, []) for label in labels], runs, args.steps)
    sync = report["sync"]["summary"]["final_score"]
    low = sync["mean"] - (sync["ci95_half_width"] if math.isfinite(sync["ci95_half_width"]) else 0.0)
    print(f"\nfinal validation (val-core mean@1, greedy) at step {args.steps}, seeds {args.seeds}:")
    for label, arm in report.items():
        score = arm["summary"]["final_score"]
        starts = ", ".join(f"{runs[label][seed]['validation'].get(0, math.nan):.3f}" for seed in seeds)
        each = ", ".join(f"seed {seed}: {r['final_score']:.3f}" for seed, r in arm["runs"].items())
        line = f"- {label}: {compare.cell(score['mean'], score['ci95_half_width'])} ({each}; before training {starts})"
        if label != "sync":
            half = score["ci95_half_width"] if math.isfinite(score["ci95_half_width"]) else 0.0
            overlap = score["mean"] + half >= low
            line += (
                f"; minus sync {score['mean'] - sync['mean']:+.3f}: "
                f"{'no worse' if score['mean'] >= low else 'WORSE'} than sync within its interval (mean >= {low:.3f}, "
                f"sync's lower end); the two intervals {'overlap' if overlap else 'do not overlap'}"
            )
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("model", help="build the long-tail model from the quickstart's warm start")
    p.add_argument("--base", default=BASE_MODEL)
    p.add_argument("--out", default=MODEL)
    p.add_argument("--steps", type=int, default=TUNE_STEPS)
    p.add_argument("--lr", type=float, default=TUNE_LR)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("lengths", help="the sampled response lengths: median, p90, p99, max")
    p.add_argument("models", nargs="*", default=[BASE_MODEL, MODEL])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--cap", type=int, default=MAX_RESPONSE)
    p.add_argument("--seed", type=int, default=0)
    for name, steps, out in (
        ("timing", 20, "outputs/partial_rollout/timing"),
        ("learning", 100, "outputs/partial_rollout/learning"),
    ):
        p = sub.add_parser(name)
        p.add_argument("overrides", nargs="*", help="key=value for every run")
        p.add_argument("--model", default=MODEL)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--out", default=out)
        p.add_argument("--report-only", action="store_true", help="read the runs already in --out")
    timing_parser, learning_parser = sub.choices["timing"], sub.choices["learning"]
    timing_parser.add_argument("--reps", type=int, default=2)
    timing_parser.add_argument("--seed", type=int, default=1)
    timing_parser.add_argument("--threshold", type=int, default=8, help="max_off_policy_threshold of the runs")
    learning_parser.add_argument("--seeds", default="1,2")
    learning_parser.add_argument(
        "--rollout-is", help="add an arm: colocate_async with algorithm.rollout_correction.rollout_is=THIS"
    )
    learning_parser.add_argument(
        "--arms",
        type=lambda text: text.split(","),
        help="only these arms, comma-separated (sync's runs then come "
        "from an earlier call): sync, colocate_async, colocate_async_is_<rollout_is>",
    )
    args = parser.parse_args(argv)
    return {"model": build_model, "lengths": lengths, "timing": timing, "learning": learning}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
