"""Load a model directory in vLLM (its own process: one engine per process) and print
``MAXDIFF <x>``: the largest gap between vLLM's sampled-token log-probs and a transformers forward
of the same directory. ``--perturb-head`` first pushes a changed output head (an untied model's
``lm_head`` must be pushed too); without it vLLM scores the weights it read from disk."""

import argparse

import torch
from transformers import AutoModelForCausalLM

from dsrl.engines import init_distributed
from dsrl.rollout import SamplingParams
from dsrl.rollout.vllm import VLLMRollout

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("--perturb-head", action="store_true")
args = parser.parse_args()

init_distributed()
rollout = VLLMRollout(args.path, dtype="float32", max_model_len=64, enforce_eager=True, gpu_memory_utilization=0.1)
model = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32).eval()
if args.perturb_head:
    with torch.no_grad():
        noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight.add_(noise * 0.5)
    rollout.update_weights([(n, p.detach().clone()) for n, p in model.named_parameters()])
prompt = torch.tensor([[5, 6, 7, 8]])
out = rollout.generate(prompt, torch.ones_like(prompt), SamplingParams(n=4, max_tokens=8, seed=0))
diffs = []
for ids, lp, mask in zip(out.response_ids, out.log_probs, out.response_mask):
    full = torch.cat([prompt[0], ids[mask.bool()]])[None]
    with torch.no_grad():
        logits = model(full).logits[0, 3:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, full[0, 4:, None])[:, 0]
    diffs.append((expected - lp[mask.bool()]).abs().max().item())
print("MAXDIFF", max(diffs))
