"""What a LoRA merge into bfloat16 weights keeps, against what the bfloat16 actor computes (review gpu_path_3 G2).

    python scripts/make_tiny_model.py --sft-steps 0 --out outputs/tiny_model
    python bench/lora_merge_bf16.py outputs/tiny_model          # seconds on CPU

Rank-32 adapters (grpo_lora's) on every linear layer, their B moved by grpo_lora's lr 3e-5 a step for 1 ... 100 steps,
each element in a random direction (``tests/engines/test_lora.py``'s ``moved_adapters``). Per step count: the share of
the update ``s B A`` that survives the merge into bfloat16 weights; the logit distance of the merged bfloat16 model
(the rollout of a merged push) from the bfloat16 actor (PEFT's forward), of that actor from its float32 self, and
the size of the update in the same units; and the same three as mean absolute probability differences (verl's
``rollout_probs_diff_mean``). The test asserts the rows' relations; this prints them.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsrl.engines.lora import iter_merged_parameters  # noqa: E402
from tests.engines.test_lora import merged_share_of_the_update, moved_adapters  # noqa: E402

STEPS = (1, 3, 10, 30, 100)


def probs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.softmax(-1) - b.softmax(-1)).abs().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a local model directory (the tiny model)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    vocab = AutoModelForCausalLM.from_pretrained(args.model).config.vocab_size
    ids = torch.randint(0, vocab, (4, 48), generator=torch.Generator().manual_seed(0))
    print(f"{'steps':>5} {'kept':>6} {'|merged-actor|':>15} {'|actor-fp32|':>13} {'|update|':>9}"
          f" {'p merged-actor':>15} {'p actor-fp32':>13} {'p update':>9}")  # fmt: skip
    for steps in STEPS:
        model = moved_adapters(args.model, steps)
        with torch.no_grad():
            exact = model(ids).logits
            with model.disable_adapter():
                base = model(ids).logits
            actor = copy.deepcopy(model).to(torch.bfloat16)(ids).logits.float()
            merged = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
            merged.load_state_dict(dict(iter_merged_parameters(copy.deepcopy(model).to(torch.bfloat16))), strict=False)
            rollout = merged(ids).logits.float()
        print(
            f"{steps:>5} {merged_share_of_the_update(model):>6.2f} {float((rollout - actor).norm()):>15.4f} "
            f"{float((actor - exact).norm()):>13.4f} {float((exact - base).norm()):>9.4f} "
            f"{probs_diff(rollout, actor):>15.1e} {probs_diff(actor, exact):>13.1e} {probs_diff(exact, base):>9.1e}"
        )


if __name__ == "__main__":
    main()
