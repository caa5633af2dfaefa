"""LoRA pushes to the vLLM rollout, merged weights against adapters alone (``actor_rollout_ref.model.lora.merge``):
seconds per push and per generate call.

    python bench/lora_push.py MODEL_DIR [--rank 8] [--steps 5] [--prompts 8] [--n 4] [--max-tokens 32]
    python scripts/make_tiny_model.py --wide --sft-steps 0 --out outputs/wide_model   # a random 97M Qwen3 to measure

Run it with vLLM installed (the vllm tier's environment on CPU). Each mode runs in a process of its own (one vLLM
engine per process), float32, eager, no sleep mode: a PEFT model of MODEL_DIR (adapters on all linear layers),
and per step new random adapters (a training step's change), pushed as the trainer does
(``iter_merged_parameters`` or ``iter_adapter_parameters`` into ``VLLMRollout.update_weights``; the merged stream
includes computing ``W + s B A``), then one generate call (PROMPTS prompts, n samples each, at most MAX_TOKENS
tokens). Both modes draw the same adapters and seeds. The table gives medians over the steps after the first
(the first push loads the adapter code paths). ``push_s`` is what the trainer logs as ``timing_s/update_weights``
(without the gather of a ZeRO-3 actor), ``gen_s`` its ``timing_s/gen``; ``tokens`` the tokens the call generated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from children import in_children, report  # noqa: E402

MODES = ("merged", "adapters")


def measure(args: argparse.Namespace) -> dict:
    """One mode's medians (in this process: it builds the vLLM engine)."""
    import torch
    from omegaconf import OmegaConf
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from dsrl.engines import init_distributed
    from dsrl.engines.lora import iter_adapter_parameters, iter_merged_parameters, lora_config
    from dsrl.rollout import SamplingParams
    from dsrl.rollout.vllm import VLLMRollout

    init_distributed()
    settings = lora_config(
        OmegaConf.create(
            {
                "lora_rank": args.rank,
                "lora_alpha": 2 * args.rank,
                "target_modules": "all-linear",
                "exclude_modules": None,
            }
        )
    )
    merged = args.mode == "merged"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), settings).eval()
    rollout = VLLMRollout(
        args.model,
        dtype="float32",
        max_model_len=args.prompt_len + args.max_tokens,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        enable_sleep_mode=False,
        lora=None if merged else settings,
    )
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=generator)
    push_s, gen_s, tokens = [], [], []
    for step in range(args.steps):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
        start = time.perf_counter()
        rollout.update_weights(iter_merged_parameters(model) if merged else iter_adapter_parameters(model))
        push_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = rollout.generate(
            prompts, torch.ones_like(prompts), SamplingParams(n=args.n, max_tokens=args.max_tokens, seed=step)
        )
        gen_s.append(time.perf_counter() - start)
        tokens.append(int(out.response_mask.sum()))
    later = slice(1, None)
    return {
        "mode": args.mode,
        "push_s": statistics.median(push_s[later]),
        "gen_s": statistics.median(gen_s[later]),
        "tokens": statistics.median(tokens[later]),
        "first_push_s": push_s[0],
        "params_m": sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mode", choices=MODES, help="measure one mode in this process (the parent's child runs)")
    args = parser.parse_args()
    if args.mode:
        report(measure(args))
        return
    rows = in_children("--mode", MODES)
    print(
        f"{args.model}: {rows[0]['params_m']:.1f}M parameters, LoRA rank {args.rank} on all linear layers, "
        f"{args.prompts} prompts x n={args.n}, <= {args.max_tokens} tokens; medians of steps 2..{args.steps}"
    )
    print(f"{'mode':<10}{'push_s':>10}{'first_push_s':>14}{'gen_s':>10}{'tokens':>8}")
    for row in rows:
        print(
            f"{row['mode']:<10}{row['push_s']:>10.4f}{row['first_push_s']:>14.4f}{row['gen_s']:>10.3f}{row['tokens']:>8.0f}"
        )


if __name__ == "__main__":
    main()
