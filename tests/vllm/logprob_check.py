"""Load a model directory in vLLM (its own process: one engine per process) and print
``MAXDIFF <x>``: the largest gap between vLLM's sampled-token log-probs and a transformers forward
of the same directory. ``--perturb-head`` first pushes a changed output head (an untied model's
``lm_head`` must be pushed too); without it vLLM scores the weights it read from disk. ``--lora`` builds
the engine for LoRA adapter pushes and compares against a PEFT model after each of two pushes of different
random adapters (lora_B far from PEFT's zeros): an engine that kept the base weights, or the first push's
adapters, would be far off."""

import argparse

import torch
from transformers import AutoModelForCausalLM

from dsrl.engines import init_distributed
from dsrl.engines.lora import iter_adapter_parameters, lora_config
from dsrl.rollout import SamplingParams
from dsrl.rollout.vllm import VLLMRollout

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("--perturb-head", action="store_true")
parser.add_argument("--lora", action="store_true")
args = parser.parse_args()

init_distributed()
model = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32).eval()
adapters = None
if args.lora:
    from omegaconf import OmegaConf
    from peft import get_peft_model

    adapters = lora_config(
        OmegaConf.create({"lora_rank": 4, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None})
    )
    model = get_peft_model(model, adapters).eval()
rollout = VLLMRollout(
    args.path,
    dtype="float32",
    max_model_len=64,
    enforce_eager=True,
    gpu_memory_utilization=0.1,
    enable_sleep_mode=False,
    lora=adapters,
)
generator = torch.Generator().manual_seed(0)
if args.perturb_head:
    with torch.no_grad():
        noise = torch.randn(model.lm_head.weight.shape, generator=generator)
        model.lm_head.weight.add_(noise * 0.5)
    rollout.update_weights([(n, p.detach().clone()) for n, p in model.named_parameters()])
prompt = torch.tensor([[5, 6, 7, 8]])


def gap() -> float:
    out = rollout.generate(prompt, torch.ones_like(prompt), SamplingParams(n=4, max_tokens=8, seed=0))
    diffs = []
    for ids, lp, mask in zip(out.response_ids, out.log_probs, out.response_mask, strict=True):
        full = torch.cat([prompt[0], ids[mask.bool()]])[None]
        with torch.no_grad():
            logits = model(full).logits[0, 3:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, full[0, 4:, None])[:, 0]
        diffs.append((expected - lp[mask.bool()]).abs().max().item())
    return max(diffs)


gaps = []
for _ in range(2 if args.lora else 1):
    if args.lora:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        rollout.update_weights(iter_adapter_parameters(model))
    gaps.append(gap())
print("MAXDIFF", max(gaps))
