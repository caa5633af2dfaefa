"""Time every advantage estimator and policy loss on one large batch; compare with elementary references
and, optionally, with verl 0.9.1's own functions on the same inputs.

    OMP_NUM_THREADS=1 python scripts/bench_estimators.py                   # B=8192, T=2048, groups of 8
    OMP_NUM_THREADS=1 python scripts/bench_estimators.py --batch 256 --length 128 --repeats 2
    bash .ci/verl_tier.sh --co -q >/dev/null  # builds ~/.cache/dsrl/verl-venv (verl 0.9.1) once
    OMP_NUM_THREADS=1 ~/.cache/dsrl/verl-venv/bin/python scripts/bench_estimators.py --against-verl

For each estimator: the median wall time of `compute_advantages` (fp32, one thread) and its ratio
to one `torch.cumsum` over a [B, T] tensor measured in the same run. GAE and REINFORCE++ scan
over time, so they are also compared with the cheapest possible scan: a T-step Python loop of one
[B]-sized vector op over the columns of a [B, T] tensor (`acc = x[:, t] + γ acc`).
Targets (meaningful at the full size; small runs are dominated by per-call overhead): outcome
estimators <= 10x cumsum, OTB / TIR-OTB <= 30x cumsum, the scans <= 3x the loop.
For each policy loss: the median time of its forward and backward (`policy_loss` with token-mean, then
`backward()`), and its ratio to the vanilla PPO loss's. `--against-verl` adds verl's time for every
name verl registers and dsrl's time as a multiple of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from dsrl.algorithms import EstimatorInputs, compute_advantages, estimator_names, policy_loss, policy_loss_names

CUMSUM_TARGETS = {
    "grpo": 10.0,
    "rloo": 10.0,
    "opo": 10.0,
    "reinforce_plus_plus_baseline": 10.0,
    "remax": 10.0,
    "gpg": 10.0,
    "grpo_passk": 10.0,
    "gdpo": 10.0,
    "rloo_vectorized": 10.0,
    "optimal_token_baseline": 30.0,
    "tir_optimal_token_baseline": 30.0,
}
LOOP_TARGETS = {"gae": 3.0, "reinforce_plus_plus": 3.0}
ALIASES = {"grpo_vectorized"}  # the same function as grpo
LOSS_PARAMS = {"dro": {"dro_beta": 0.1}}  # losses without a usable default


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch allocations, lazy initialisation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def make_inputs(batch: int, length: int, group: int) -> EstimatorInputs:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = (torch.rand(batch, generator=gen) > 0.5).float()
    # arbitrary int64 prompt ids, rows of a group not adjacent
    group_ids = (torch.arange(batch) // group * 1_000_003 + 17)[torch.randperm(batch, generator=gen)]
    return EstimatorInputs(
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=group_ids,
        values=torch.randn(batch, length, generator=gen),
        old_log_probs=-torch.rand(batch, length, generator=gen) * 2,
        sum_pi_squared=torch.rand(batch, length, generator=gen) * 0.5 + 0.1,
        reward_baselines=torch.rand(batch, generator=gen),
        reward_components={
            "acc": (torch.rand(batch, generator=gen) > 0.5).float(),
            "format": (torch.rand(batch, generator=gen) > 0.2).float(),
        },
    )


def verl_calls() -> ModuleType:
    """The parity tier's calls into verl 0.9.1 (tests/verl/verl_calls.py), or exit saying how to get verl."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from tests.verl import verl_calls as calls
    except ImportError as err:
        raise SystemExit(
            f"--against-verl needs verl 0.9.1 ({err}): build the verl tier's environment with "
            "`bash .ci/verl_tier.sh --co -q` and run this script with ~/.cache/dsrl/verl-venv/bin/python"
        ) from err
    return calls


def ratio_columns(ms: float, verl_ms: float | None) -> str:
    return f"{verl_ms:9.1f} {ms / verl_ms:7.2f}" if verl_ms is not None else f"{'-':>9} {'-':>7}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8192, help="B, sequences")
    parser.add_argument("--length", type=int, default=2048, help="T, response tokens")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--against-verl", action="store_true", help="also time verl 0.9.1's functions (see above)")
    args = parser.parse_args()
    verl = verl_calls() if args.against_verl else None
    torch.set_num_threads(1)

    inputs = make_inputs(args.batch, args.length, args.group)
    x = inputs.values

    def scan_reference() -> None:
        acc = torch.zeros(args.batch)
        for t in range(args.length - 1, -1, -1):
            acc = torch.add(x[:, t], acc, alpha=0.99)

    cumsum_ms = median_ms(lambda: torch.cumsum(x, dim=-1), args.repeats)
    loop_ms = median_ms(scan_reference, args.repeats)
    print(f"B={args.batch} T={args.length} group={args.group} fp32, 1 thread, median of {args.repeats}")
    print(f"reference cumsum [B,T]: {cumsum_ms:.1f} ms;  T-step loop of one [B] op: {loop_ms:.1f} ms\n")
    print(f"{'estimator':<30} {'ms':>9} {'x cumsum':>9} {'x loop':>8} {'verl ms':>9} {'x verl':>7}  target")

    for name in estimator_names():
        if name in ALIASES:
            continue
        options = {"gamma": 0.99, "lam": 0.95}
        ms = median_ms(lambda: compute_advantages(name, inputs, **options), args.repeats)  # noqa: B023
        verl_ms = None
        if verl is not None and name in verl.ESTIMATORS:
            verl_ms = median_ms(lambda: verl.verl_advantages(name, inputs, options), args.repeats)  # noqa: B023
        ratio_cumsum = ms / cumsum_ms
        if name in LOOP_TARGETS:
            ratio_loop = ms / loop_ms
            target, ok = f"<= {LOOP_TARGETS[name]:g}x loop", ratio_loop <= LOOP_TARGETS[name]
            loop_col = f"{ratio_loop:8.2f}"
        else:
            target = f"<= {CUMSUM_TARGETS[name]:g}x cumsum" if name in CUMSUM_TARGETS else "-"
            ok = name not in CUMSUM_TARGETS or ratio_cumsum <= CUMSUM_TARGETS[name]
            loop_col = f"{'':8}"
        print(
            f"{name:<30} {ms:9.1f} {ratio_cumsum:9.2f} {loop_col} {ratio_columns(ms, verl_ms)}  "
            f"{target} {'ok' if ok else 'MISSED'}"
        )
    bench_losses(inputs, args.repeats, verl)


def bench_losses(inputs: EstimatorInputs, repeats: int, verl: ModuleType | None) -> None:
    """Forward and backward of every policy loss on the estimators' batch (token-mean, no IS weights)."""
    gen = torch.Generator().manual_seed(1)
    mask = inputs.response_mask
    old_log_probs = inputs.old_log_probs
    log_probs = old_log_probs + 0.1 * torch.randn(mask.shape, generator=gen)
    advantages = torch.randn(mask.shape[0], 1, generator=gen) * mask

    def forward_backward(loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict]]) -> float:
        def run() -> None:
            loss, _ = loss_fn(log_probs.detach().requires_grad_())
            loss.backward()

        return median_ms(run, repeats)

    print(
        f"\n{'policy loss':<30} {'ms':>9} {'x vanilla':>9} {'':8} {'verl ms':>9} {'x verl':>7}   (forward + backward)"
    )
    vanilla_ms = None
    for name in ["vanilla", *(n for n in policy_loss_names() if n != "vanilla")]:
        params = LOSS_PARAMS.get(name, {})
        ms = forward_backward(
            lambda lp, name=name, params=params: policy_loss(
                name,
                old_log_probs=old_log_probs,
                log_probs=lp,
                advantages=advantages,
                response_mask=mask,
                **params,
            )
        )
        vanilla_ms = vanilla_ms or ms
        verl_ms = None
        if verl is not None and name in verl.POLICY_LOSSES:
            config = verl.verl_actor_config(params, {})
            verl_ms = forward_backward(
                lambda lp, name=name, config=config: verl.verl_policy_loss(
                    name,
                    old_log_probs=old_log_probs,
                    log_probs=lp,
                    advantages=advantages,
                    response_mask=mask,
                    loss_agg_mode="token-mean",
                    rollout_is_weights=None,
                    config=config,
                )
            )
        print(f"{name:<30} {ms:9.1f} {ms / vanilla_ms:9.2f} {'':8} {ratio_columns(ms, verl_ms)}")


if __name__ == "__main__":
    main()
