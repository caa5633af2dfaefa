"""Time and peak memory of the actor's log-prob head: forward and backward of the per-token log-probs of
bf16 logits, as the GRPO update runs it (no entropy in the loss, temperature 1).

    python bench/logits_head.py B T V [--device cpu|cuda] [--impl old|new|both] [--json PATH]

Input: random bf16 logits [B, T + 1, V] (a leaf standing in for the model's output) sliced [:, :-1] as
``response_logits`` does, and random labels; the loss weights each log-prob by a random coefficient.
``new`` is ``dsrl.engines.forward.response_stats``; ``old`` is the implementation it replaced (below),
which slices the flattened logits per chunk so that backward adds one zero-padded full-size gradient per
chunk. Each implementation runs once to warm up, then REPEATS times; the line printed gives medians.

seconds: wall time of forward + backward (CUDA synchronised); cpu_seconds: the process's CPU time
(user + system, all threads) over the same span, which on a shared CPU machine other jobs disturb less
than the wall time (on CUDA it is the host's time, launches and waits). peak_gib: the most memory the call held
beyond what was held before it (the input logits and labels): on CUDA ``torch.cuda.max_memory_allocated``
(live tensors, not the allocator's cache); on CPU the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) minus its resident set before the call, which counts every page
touched, large tensors being mapped and unmapped as they are allocated and freed. Both include the
input's gradient [B, T + 1, V], which the slice's backward creates.

With ``--impl both`` it also prints the largest difference between the two implementations' log-probs
and gradients (same inputs), which must be float rounding at most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsrl.algorithms import logprobs_from_logits  # noqa: E402
from dsrl.engines.forward import CHUNK_ELEMENTS, response_stats  # noqa: E402

REPEATS = 3
TEMPERATURE = 1.0  # still divided by, as the actor does
GIB = 2**30


def slicing_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The replaced implementation (log-probs only): a reshape (a copy of a non-contiguous view), then a
    checkpointed slice of ``CHUNK_ELEMENTS`` logits at a time."""
    b, t, v = logits.shape
    flat, flat_labels = logits.reshape(b * t, v), labels.reshape(b * t)
    rows = max(1, CHUNK_ELEMENTS // v)
    pieces = [
        checkpoint(
            lambda z, y: logprobs_from_logits(z.float() / TEMPERATURE, y),
            flat[start : start + rows],
            flat_labels[start : start + rows],
            use_reentrant=False,
        )
        for start in range(0, b * t, rows)
    ]
    return torch.cat(pieces).reshape(b, t)


IMPLEMENTATIONS = {
    "old": slicing_log_probs,
    "new": lambda logits, labels: response_stats(logits, labels, temperature=TEMPERATURE)["log_probs"],
}


class PeakMemory:
    """Peak bytes held during a ``with`` block beyond those held at its start (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
            self.start = self._status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = self._status_bytes("VmHWM") - self.start

    @staticmethod
    def _status_bytes(field: str) -> int:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
        return int(line.split()[1]) * 1024  # in kB


def run_once(name: str, B: int, T: int, V: int, device: torch.device) -> tuple[float, int, torch.Tensor, torch.Tensor]:
    """(seconds, CPU seconds, peak bytes, log-probs, gradient of the logits) of one forward + backward."""
    g = torch.Generator(device).manual_seed(0)
    logits = torch.randn(B, T + 1, V, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(V, (B, T), generator=g, device=device)
    weights = torch.randn(B, T, generator=g, device=device)
    with PeakMemory(device) as memory:
        start, cpu_start = time.perf_counter(), time.process_time()
        log_probs = IMPLEMENTATIONS[name](logits[:, :-1], labels)
        (weights * log_probs).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return seconds, cpu_seconds, memory.peak, log_probs.detach(), logits.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("B", type=int, help="sequences in the micro-batch")
    parser.add_argument("T", type=int, help="response tokens per sequence")
    parser.add_argument("V", type=int, help="vocabulary size")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--impl", choices=["old", "new", "both"], default="both")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    names = ["old", "new"] if args.impl == "both" else [args.impl]
    results, outputs = {}, {}
    for name in names:
        run_once(name, args.B, args.T, args.V, device)  # warm-up
        seconds, cpu_seconds, peaks = [], [], []
        for _ in range(REPEATS):
            outputs.pop(name, None)  # frees the last run's gradient before the next run
            outputs[name] = run_once(name, args.B, args.T, args.V, device)
            seconds.append(outputs[name][0])
            cpu_seconds.append(outputs[name][1])
            peaks.append(outputs[name][2] / GIB)
        results[name] = {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "peak_gib": peaks,
            "median_seconds": statistics.median(seconds),
            "median_cpu_seconds": statistics.median(cpu_seconds),
            "median_peak_gib": statistics.median(peaks),
        }
        print(
            f"{name}: B={args.B} T={args.T} V={args.V} {args.device}: "
            f"{results[name]['median_seconds']:.3f} s (CPU {results[name]['median_cpu_seconds']:.3f} s), "
            f"peak {results[name]['median_peak_gib']:.2f} GiB "
            f"(median of {REPEATS})",
            flush=True,
        )
    report = {"B": args.B, "T": args.T, "V": args.V, "device": args.device, "dtype": "bfloat16"}
    report["results"] = results
    if len(outputs) == 2:
        (*_, old_log_probs, old_grad), (*_, new_log_probs, new_grad) = outputs["old"], outputs["new"]
        diff = {
            "log_probs": (old_log_probs - new_log_probs).abs().max().item(),
            "grad": (old_grad.float() - new_grad.float()).abs().max().item(),
        }
        report["max_abs_diff"] = diff
        print(f"max |old - new|: log_probs {diff['log_probs']:.3g}, grad {diff['grad']:.3g}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
