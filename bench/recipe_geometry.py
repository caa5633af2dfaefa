"""The actor's update and log-prob pass at the shipped recipes' micro-batch geometry, on one device.

    python bench/recipe_geometry.py --shape qwen2.5-0.5b --cases grpo,opo,otb --json PATH   # one GPU, ~2 min
    python bench/recipe_geometry.py --smoke --json PATH                                     # tiny shape, CPU, seconds

What runs: ``scripts/gpu_check.py``'s actor (random weights of the shape, ``zero3`` with its FusedAdam
or ``--optimizer adamw``, world 1, gradient checkpointing, bf16) on full-length rows of random tokens
(prompt 512 + response 1024, the recipes' caps: the most memory a micro-batch can take) with random
advantages. Cases (``CASES``): GRPO micro-batches of 40 rows, OPO of 32, OTB cut by the token budget
24576 (``use_dynamic_bsz``: 16 such rows). Each case builds its own engine, warms up with one update,
then times one ``compute_log_probs`` and one ``update`` (one optimizer step over ``MICRO_BATCHES``
micro-batches).

Rows of the table, per case and pass: seconds per micro-batch, tokens/s (prompt + response tokens of
the batch over the pass's seconds) and peak memory (``torch.cuda.max_memory_allocated`` during the
pass; n/a on CPU). ``bench/grad_accum_dtype.py`` reuses ``random_batch`` and ``build_actor``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
import gpu_check  # noqa: E402
from make_tiny_model import CHARACTERS, SPECIAL_TOKENS  # noqa: E402

SHAPES = {"qwen2.5-0.5b": dataclasses.replace(gpu_check.QWEN25_05B, prompt_length=512, max_tokens=1024)}
# (rollout.n, ppo_micro_batch_size_per_gpu, ppo_max_token_len_per_gpu or None) as configs/<case>.yaml set them.
CASES = {"grpo": (5, 40, None), "opo": (8, 32, None), "otb": (8, 32, 24576)}
MICRO_BATCHES = 2  # per timed pass: steady state without the cost of a full mini-batch
# Smoke: the same three cases at a tiny shape, micro-batches and budget scaled down to match.
SMOKE = dataclasses.replace(gpu_check.SMOKE, dtype="bfloat16", prompt_length=8, max_tokens=16)
SMOKE_CASES = {"grpo": (2, 4, None), "opo": (2, 2, None), "otb": (2, 2, 72)}


def random_batch(size: gpu_check.CheckSize, rows: int, seed: int):
    """``rows`` full-length rows of random ordinary tokens (prompt ``size.prompt_length``, response
    ``size.max_tokens``) in groups of ``size.n``, with random per-row advantages."""
    from dsrl.data.batch import Batch

    generator = torch.Generator().manual_seed(seed)
    first = len(SPECIAL_TOKENS)  # make_tiny_model's tokenizer: special tokens, then one per character
    response_ids = torch.randint(first, first + len(CHARACTERS), (rows, size.max_tokens), generator=generator)
    response_mask = torch.ones_like(response_ids)
    prompt_ids = torch.randint(first, first + len(CHARACTERS), (rows, size.prompt_length), generator=generator)
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=torch.arange(rows) // size.n,
        advantages=torch.randn(rows, 1, generator=generator) * response_mask,  # [B, T]
    )


def build_actor(size: gpu_check.CheckSize, model_dir: Path, deepspeed_config: str | Path, *overrides: str):
    """An ActorEngine of the random model in ``model_dir``, one optimizer step per ``size.prompts * size.n`` rows."""
    from dsrl.engines import ActorEngine

    return ActorEngine(gpu_check.run_config(size, model_dir, "hf", deepspeed_config, *overrides))


def timed(call) -> tuple[float, float | None]:
    """(seconds, peak GiB allocated on CUDA or None) of ``call()``."""
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    call()
    if on_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - begin, torch.cuda.max_memory_allocated() / gpu_check.GIB if on_cuda else None


def write_report(path: Path | None, header: str, table: list[tuple[str, float | None, str]]) -> None:
    """Print the table, and write it as gpu_check's JSON does (``header``, ``metrics``) when ``path`` is given."""
    print(header)
    width = max(len(name) for name, _, _ in table)
    for name, value, unit in table:
        print(f"{name:<{width}}  {gpu_check.format_value(value):>12}  {unit}")
    if path:
        metrics = [{"name": name, "value": value, "unit": unit} for name, value, unit in table]
        path.write_text(json.dumps({"header": header, "metrics": metrics}, indent=2) + "\n")


def measure(size: gpu_check.CheckSize, model_dir: Path, deepspeed_config, case: str, geometry) -> list[tuple]:
    """The table rows of one case: a fresh engine, one warm-up update, then the timed passes."""
    from dsrl.engines.forward import micro_batch_indices

    n, micro, budget = geometry
    rows = MICRO_BATCHES * (micro if budget is None else budget // (size.prompt_length + size.max_tokens))
    size = dataclasses.replace(size, prompts=rows // n, n=n, micro_batch=micro)  # one mini-batch: one optimizer step
    overrides = []
    if budget is not None:
        overrides = [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        ]
    actor = build_actor(size, model_dir, deepspeed_config, *overrides)
    batch = random_batch(size, rows, seed=0)
    parts = len(micro_batch_indices(batch, micro_batch_size=micro, max_token_len=budget))
    tokens = batch.attention_mask.sum().item()
    actor.update(batch, temperature=1.0)  # warm-up: allocator, kernels, optimizer states
    table = []
    for name, call in (
        ("log-probs", lambda: actor.compute_log_probs(batch, temperature=1.0)),
        ("update", lambda: actor.update(batch, temperature=1.0)),
    ):
        seconds, peak = timed(call)
        table += [
            (f"{case} {name} s per micro-batch", seconds / parts, f"s ({parts} micro-batches of {rows // parts} rows)"),
            (f"{case} {name} throughput", tokens / seconds, "tokens/s"),
            (f"{case} {name} peak memory", peak, "GiB"),
        ]
    actor.engine.destroy()
    actor = None  # freed before the next case (the lambdas above are done with it)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--optimizer", choices=("recipe", "adamw"), default="recipe", help="as scripts/gpu_check.py's")
    parser.add_argument("--smoke", action="store_true", help="tiny shape and micro-batches, on CPU, in seconds")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    size, cases = (SMOKE, SMOKE_CASES) if args.smoke else (SHAPES[args.shape], CASES)
    unknown = sorted(set(args.cases.split(",")) - set(cases))
    if unknown:
        parser.error(f"--cases {args.cases}: unknown {unknown}; choose from {sorted(cases)}")
    problem = gpu_check.optimizer_problem(size, args.optimizer)
    if problem:
        print(f"[recipe_geometry] {problem}", file=sys.stderr)
        return 2
    table = []
    with tempfile.TemporaryDirectory(prefix="recipe_geometry-") as tmp:
        model_dir = Path(tmp)
        n_params = gpu_check.save_random_model(size, model_dir)
        deepspeed_config, note = gpu_check.actor_deepspeed_config(size, args.optimizer, model_dir)
        for case in args.cases.split(","):
            table += measure(size, model_dir, deepspeed_config, case, cases[case])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    header = (
        f"[recipe_geometry] {device}; actor {size.deepspeed_config}{note}; {size.dtype}, {n_params / 1e6:.1f}M "
        f"parameters (random weights); rows of {size.prompt_length} prompt + {size.max_tokens} response tokens"
    )
    write_report(args.json, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
