"""Routing replay against a perturbed router: how far the trainer's log-probs are from the rollout's with and without
replaying the rollout's experts.

    python bench/route_replay.py MODEL_DIR [--scales 0,0.1,1] [--rows 2] [--n 4] [--tokens 16]

A mixture of experts (``make_tiny_model.py --moe``) samples with the transformers rollout in float32, recording each
token's experts (R3's recording). The trainer's copy gets its routers perturbed by Gaussian noise of ``scale`` times
each router weight's standard deviation (0: the same weights), as a GPU's other kernels or a stale push would make
it route otherwise. For each scale and layout (padded rows, packed rows) the table gives the share of the recorded
experts the trainer's routers choose by themselves (``moe/route_agreement``) and the mean and largest
``|log p_trainer - log p_rollout|`` over the response tokens, without replay and replaying the rollout's routes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrl.data.batch import Batch
from dsrl.engines.forward import PassTally, policy_stats
from dsrl.engines.packing import Packing
from dsrl.engines.routers import RouteReplay, moe_routers
from dsrl.rollout.base import SamplingParams
from dsrl.rollout.hf import HFRollout
from dsrl.trainer.batches import with_responses

CPU = torch.device("cpu")


def sampled(model_dir: str, args: argparse.Namespace) -> Batch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 10, (args.rows,), generator=g)
    mask = (torch.arange(10) >= 10 - lengths[:, None]).long()
    ids = torch.randint(3, 100, (args.rows, 10), generator=g) * mask
    empty = torch.zeros(args.rows, 0, dtype=torch.long)
    rollout = HFRollout(model_dir, dtype="float32", record_routes=True)
    out = rollout.generate(ids, mask, SamplingParams(n=args.n, max_tokens=args.tokens, seed=1))
    return with_responses(Batch(ids, mask, empty, empty, torch.arange(args.rows)), out, args.n)


def gap(batch: Batch, log_probs: torch.Tensor, width: int) -> tuple[float, float]:
    valid = batch.response_mask[:, :width].bool()
    diff = (log_probs - batch.rollout_log_probs[:, :width])[valid].abs()
    return float(diff.mean()), float(diff.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--scales", default="0,0.1,1")
    parser.add_argument("--rows", type=int, default=2, help="prompts")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--tokens", type=int, default=16, help="response tokens at most")
    args = parser.parse_args()
    batch = sampled(args.model_dir, args)
    columns = ("scale", "layout", "agreement", "own mean", "own max", "replay mean", "replay max")
    print(" ".join(f"{name:>11}" for name in columns))
    for scale in (float(s) for s in args.scales.split(",")):
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        noise = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for router in moe_routers(model):
                router.weight.add_(torch.randn(router.weight.shape, generator=noise) * scale * router.weight.std())
        replay = RouteReplay(model, "--model")
        for layout, packing in (("padded", None), ("packed", Packing())):
            tally = PassTally()
            with torch.no_grad():
                own, width = policy_stats(model, batch, CPU, temperature=1.0, packing=packing)
                replayed, _ = policy_stats(
                    model, batch, CPU, temperature=1.0, packing=packing, tally=tally, replay=replay
                )
            replay.release()
            agreement = tally.routes_agreed / tally.routes_compared
            (own_mean, own_max), (rep_mean, rep_max) = (
                gap(batch, own["log_probs"], width),
                gap(batch, replayed["log_probs"], width),
            )
            numbers = (f"{agreement:.3f}", *(f"{x:.2e}" for x in (own_mean, own_max, rep_mean, rep_max)))
            print(" ".join(f"{cell:>11}" for cell in (f"{scale:g}", layout, *numbers)))


if __name__ == "__main__":
    main()
