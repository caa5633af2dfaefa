"""vLLM's prefix cache on a second turn, as dsrl's multi-turn rollout submits it: the prompt tokens of turn 2, and how
many the engine recomputed and how many its cache served, with ``enable_prefix_caching`` on (dsrl's setting) and off.

    python bench/prefix_cache.py MODEL_DIR [--prompts 8] [--prompt-len 160] [--turn-tokens 24] [--max-model-len 256]
    python bench/prefix_cache.py ~/.cache/dsrl/test_models/tiny_tool_model-*   # the vLLM tier's tool model

Run it with vLLM installed (the vllm tier's environment on CPU). Each setting runs in a process of its own (one vLLM
engine per process): dsrl's ``VLLMRollout`` (float32, eager, no sleep mode), built as dsrl builds it, the off
setting with that one argument overridden. PROMPTS chat-rendered questions of at least PROMPT_LEN tokens each
(distinct from their first tokens on, so prompts share no block); turn 1 samples at most TURN_TOKENS tokens per
prompt; then, as ``MultiTurnRollout`` does, each context gets its response and a tool message rendered by the chat
template (``tool_turn_ids``), and turn 2 generates on the whole context. ``reusable`` is what turn 1 computed of
turn 2's contexts (prompt + response); the cache serves it in whole KV blocks (``block``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from children import in_children, report  # noqa: E402

SETTINGS = ("on", "off")
FILLER = "Work it out step by step, and call the calculator for every product. "


def measure(args: argparse.Namespace) -> dict:
    """One setting's counts (in this process: it builds the vLLM engine)."""
    import vllm
    from transformers import AutoTokenizer

    from dsrl.data.batch import left_pad
    from dsrl.engines import init_distributed
    from dsrl.rollout import SamplingParams
    from dsrl.rollout.multi_turn import MultiTurnRollout
    from dsrl.rollout.vllm import VLLMRollout

    if args.setting == "off":  # dsrl's engine with this one argument changed
        build = vllm.LLM
        vllm.LLM = lambda *a, **kw: build(*a, **{**kw, "enable_prefix_caching": False})
    init_distributed()
    rollout = VLLMRollout(
        args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        enable_sleep_mode=False,
        per_prompt_seeds=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # Only for tool_turn_ids, which reads the tools' schemas alone.
    loop = MultiTurnRollout(cast(Any, rollout), tokenizer, cast(Any, SimpleNamespace(schemas=[])), cfg=None)
    prompts = []
    for i in range(args.prompts):
        words = [f"What is {101 + 7 * i}*{233 + 11 * i}?", *FILLER.split() * args.prompt_len]
        for count in range(1, len(words) + 1):  # the fewest words that reach prompt_len tokens
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": " ".join(words[:count])}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= args.prompt_len:
                break
        prompts.append(ids)
    ids, mask = left_pad(prompts, rollout.pad_token_id)
    first = rollout.generate(ids, mask, SamplingParams(n=1, max_tokens=args.turn_tokens, seed=1))
    piece = loop.tool_turn_ids([{"role": "tool", "content": "56088"}])
    responses = [first.response_ids[i, : int(first.response_mask[i].sum())].tolist() for i in range(len(prompts))]
    contexts = [p + r + piece for p, r in zip(prompts, responses, strict=True)]
    room = args.max_model_len - max(len(c) for c in contexts)
    if room < 1:
        sys.exit(f"turn 2's longest context is {max(len(c) for c in contexts)} tokens: raise --max-model-len")
    ids, mask = left_pad(contexts, rollout.pad_token_id)
    start = time.perf_counter()
    second = rollout.generate(ids, mask, SamplingParams(n=1, max_tokens=min(room, args.turn_tokens), seed=2))
    seconds = time.perf_counter() - start
    config = rollout.llm.llm_engine.vllm_config.cache_config
    return {
        "setting": args.setting,
        "enable_prefix_caching": config.enable_prefix_caching,
        "block": config.block_size,
        "turn1_prompt": sum(len(p) for p in prompts),
        "turn1_cached": first.prefix_cached_tokens,
        "turn2_prompt": sum(len(c) for c in contexts),
        "reusable": sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)),
        "turn2_cached": second.prefix_cached_tokens,
        "turn2_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--setting", choices=SETTINGS, help="measure one setting in this process (the parent's child)")
    args = parser.parse_args()
    if args.setting:
        report(measure(args))
        return
    rows = in_children("--setting", SETTINGS)
    print(
        f"{args.model}: {args.prompts} prompts of >= {args.prompt_len} tokens, <= {args.turn_tokens} tokens a turn, "
        f"KV block {rows[0]['block']} tokens; token counts summed over the prompts"
    )
    header = ("prefix_cache", "turn1_prompt", "turn1_cached", "turn2_prompt", "reusable", "cached", "recomputed")
    print("".join(f"{name:>14}" for name in header) + f"{'turn2_s':>10}")
    for row in rows:
        values = (
            f"{row['setting']} ({row['enable_prefix_caching']})",
            row["turn1_prompt"],
            row["turn1_cached"],
            row["turn2_prompt"],
            row["reusable"],
            row["turn2_cached"],
            row["turn2_prompt"] - row["turn2_cached"],
        )
        print("".join(f"{value:>14}" for value in values) + f"{row['turn2_s']:>10.3f}")


if __name__ == "__main__":
    main()
