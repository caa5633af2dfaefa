"""Padded, packed (``use_remove_padding``) and packed with one copy of each prompt (``use_prefix_grouper``) micro-
batches of the actor, timed on two length distributions.

    python bench/packing.py MODEL_DIR [--distribution gsm8k long_prompt] [--budget 4096] [--json PATH]

MODEL_DIR: a transformers causal LM, e.g. ``python scripts/make_tiny_model.py --wide --sft-steps 0 --out DIR``
(97M parameters). Distributions (seeded, the same rows for every layout):

- ``gsm8k``: 3 prompts of 80-250 tokens, 5 responses each, lognormal lengths (median 220, sigma 0.6, at most 1,024);
- ``long_prompt``: 2 prompts of 512-768 tokens, 8 responses each, lognormal (median 96, at most 128): every
  prompt at least 4x its responses, as in GRPO on long documents.

For each layout, in a fresh process (so its peak resident set is its own), the actor's two passes as the engines run
them (``dsrl.engines.forward``: ``micro_batch_indices`` with ``use_dynamic_bsz`` and a ``--budget`` token budget,
``policy_logits``, ``response_stats``), float32, sdpa attention, gradient checkpointing on in the update:

- old-log-prob: the no-grad pass (``compute_response_stats``);
- update: each micro-batch's forward and backward of a token-mean loss of its log-probs (the update without the
  optimizer step, which is the same for every layout).

Printed per layout: seconds (wall and CPU) of each pass, the peak resident set the update added (VmHWM through
``/proc/self/clear_refs``), padding share (padding / forward positions), dedup share (prompt tokens not run / the
rows' own tokens) and micro-batches per pass; and the largest log-prob difference from the padded layout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from children import in_children, report  # noqa: E402
from logits_head import GIB, PeakMemory  # noqa: E402

from dsrl.data.batch import Batch  # noqa: E402
from dsrl.engines.forward import (  # noqa: E402
    PassTally,
    compute_response_stats,
    micro_batch_indices,
    policy_logits,
    response_stats,
)
from dsrl.engines.packing import packing_for  # noqa: E402

LAYOUTS = ("padded", "packed", "dedup")
DISTRIBUTIONS = {  # prompts, n, prompt length range, response median, response maximum
    "gsm8k": (3, 5, (80, 250), 220, 1024),
    "long_prompt": (2, 8, (512, 768), 96, 128),
}


def make_batch(distribution: str, vocab: int, seed: int = 0) -> Batch:
    """Left-padded prompts, each repeated for its n responses; right-padded responses (last token an EOS-like id)."""
    prompts, n, (low, high), median, longest = DISTRIBUTIONS[distribution]
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(low, high + 1, (prompts,), generator=g).repeat_interleave(n)
    normal = torch.randn(prompts * n, generator=g)
    response_len = (median * torch.exp(0.6 * normal)).round().long().clamp(1, longest)
    P, T = int(prompt_len.max()), int(response_len.max())
    prompt_ids = torch.randint(3, vocab, (prompts, P), generator=g).repeat_interleave(n, 0)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    response_mask = (torch.arange(T) < response_len[:, None]).long()
    return Batch(
        prompt_ids=prompt_ids * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, vocab, (prompts * n, T), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=torch.arange(prompts).repeat_interleave(n),
    )


def timed(fn):
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def measure(model_dir: str, distribution: str, layout: str, budget: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = make_batch(distribution, model.config.vocab_size)
    packing = None if layout == "padded" else packing_for(model, "--layout", dedup=layout == "dedup")
    options = {"packing": packing}
    model.eval()
    tallies = {"old_log_prob": PassTally(), "update": PassTally()}
    stats, old_seconds, old_cpu = timed(
        lambda: compute_response_stats(
            model,
            batch,
            temperature=1.0,
            micro_batch_size=len(batch),
            max_token_len=budget,
            budget_key="--budget",
            share_prompts=False,
            tally=tallies["old_log_prob"],
            **options,
        )
    )
    model.train()
    model.gradient_checkpointing_enable()
    tokens = batch.response_mask.sum()

    def update() -> None:
        for idx in micro_batch_indices(batch, micro_batch_size=len(batch), max_token_len=budget, **options):
            micro = batch.select(idx)
            logits, width = policy_logits(
                model, micro, torch.device("cpu"), share_prompts=False, tally=tallies["update"], **options
            )
            log_probs = response_stats(logits, micro.response_ids[:, :width], temperature=1.0)["log_probs"]
            (-(log_probs * micro.response_mask[:, :width]).sum() / tokens).backward()

    with PeakMemory(torch.device("cpu")) as memory:
        _, update_seconds, update_cpu = timed(update)
    result = {
        "distribution": distribution,
        "layout": layout,
        "rows": len(batch),
        "old_log_prob_seconds": old_seconds,
        "old_log_prob_cpu_seconds": old_cpu,
        "update_seconds": update_seconds,
        "update_cpu_seconds": update_cpu,
        "update_peak_gib": memory.peak / GIB,
        "log_probs": stats["old_log_probs"].tolist(),
    }
    for name, tally in tallies.items():
        result[f"{name}_micro_batches"] = tally.micro_batches
        result[f"{name}_padding_share"] = 1 - tally.tokens / tally.positions
        result[f"{name}_dedup_share"] = 1 - tally.tokens / tally.sequence_tokens
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--distribution", nargs="+", choices=sorted(DISTRIBUTIONS), default=sorted(DISTRIBUTIONS))
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (use_dynamic_bsz)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        distribution, layout = args.child.split(":")
        report(measure(args.model_dir, distribution, layout, args.budget))
        return
    results = in_children("--child", [f"{d}:{layout}" for d in args.distribution for layout in LAYOUTS])
    padded = {r["distribution"]: torch.tensor(r["log_probs"]) for r in results if r["layout"] == "padded"}
    for result in results:
        expected = padded[result["distribution"]]
        diff = (torch.tensor(result.pop("log_probs")) - expected)[expected != 0].abs().max()
        result["max_log_prob_diff"] = diff.item()
    for r in results:
        print(
            f"{r['distribution']:>11} {r['layout']:>6} ({r['rows']} rows, budget {args.budget}): "
            f"update {r['update_seconds']:.1f} s (CPU {r['update_cpu_seconds']:.1f} s, "
            f"+{r['update_peak_gib']:.2f} GiB peak, {r['update_micro_batches']} micro-batches), "
            f"old-log-prob {r['old_log_prob_seconds']:.1f} s ({r['old_log_prob_micro_batches']} micro-batches); "
            f"padding {r['update_padding_share']:.1%}, dedup {r['update_dedup_share']:.1%}; "
            f"max |log-prob - padded| {r['max_log_prob_diff']:.2g}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"budget": args.budget, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
