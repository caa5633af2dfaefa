"""Time and peak memory of the actor's log-prob head: forward and backward of the per-token log-probs of a
micro-batch's final hidden states through the output layer, as the GRPO update runs it (no entropy in the loss).

    python bench/logits_head.py B T V [--hidden H] [--dtype bfloat16|float32] [--device cpu|cuda]
        [--impl full|fused|both] [--repeats N] [--json PATH]

Input: random hidden states [B, T + 1, H] (a leaf standing in for the model's last layer) and an output layer
Linear(H, V) without bias, as Qwen's, in ``--dtype``, random labels; the loss weights each log-prob by a random
coefficient. ``full`` is the head ``use_fused_kernels=false`` runs: the output layer computes the logits of every
position (``logits_to_keep``), ``[:, :-1]`` of them go through ``dsrl.engines.forward.response_stats``. ``fused``
is ``dsrl.engines.forward.head_stats`` (``use_fused_kernels=true``) on ``[:, :-1]`` of the hidden states: each
chunk's logits computed and dropped. Each implementation runs once to warm up, then ``--repeats`` times (3); the
line printed gives medians.

seconds: wall time of forward + backward (CUDA synchronised); cpu_seconds: the process's CPU time
(user + system, all threads) over the same span, which on a shared CPU machine other jobs disturb less
than the wall time (on CUDA it is the host's time, launches and waits). peak_gib: the most memory the call held
beyond what was held before it (the inputs and the output layer); on CUDA ``torch.cuda.max_memory_allocated``
(live tensors, not the allocator's cache); on CPU the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) minus its resident set before the call, which counts every page
touched, large tensors being mapped and unmapped as they are allocated and freed. Both include the
gradients of the hidden states [B, T + 1, H] and of the output layer [V, H].

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsrl.engines.forward import head_stats, response_stats  # noqa: E402

TEMPERATURE = 1.0  # still divided by, as the actor does
GIB = 2**30


def full_log_probs(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return response_stats(head(hidden)[:, :-1], labels, temperature=TEMPERATURE)["log_probs"]


def fused_log_probs(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return head_stats(head, hidden[:, :-1], labels, temperature=TEMPERATURE)["log_probs"]


IMPLEMENTATIONS = {"full": full_log_probs, "fused": fused_log_probs}


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


def run_once(
    name: str, B: int, T: int, V: int, H: int, dtype: torch.dtype, device: torch.device
) -> tuple[float, float, int, torch.Tensor, torch.Tensor]:
    """(seconds, CPU seconds, peak bytes, log-probs, gradient of the hidden states) of one forward + backward."""
    g = torch.Generator(device).manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, device=device) / H**0.5)
    hidden = torch.randn(B, T + 1, H, generator=g, device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(V, (B, T), generator=g, device=device)
    weights = torch.randn(B, T, generator=g, device=device)
    with PeakMemory(device) as memory:
        start, cpu_start = time.perf_counter(), time.process_time()
        log_probs = IMPLEMENTATIONS[name](head, hidden, labels)
        (weights * log_probs).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return seconds, cpu_seconds, memory.peak, log_probs.detach(), hidden.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("B", type=int, help="sequences in the micro-batch")
    parser.add_argument("T", type=int, help="response tokens per sequence")
    parser.add_argument("V", type=int, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=896, help="hidden size (Qwen2.5-0.5B's: 896)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--impl", choices=["full", "fused", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    names = list(IMPLEMENTATIONS) if args.impl == "both" else [args.impl]
    results, outputs = {}, {}
    for name in names:
        run_once(name, args.B, args.T, args.V, args.hidden, dtype, device)  # warm-up
        seconds, cpu_seconds, peaks = [], [], []
        for _ in range(args.repeats):
            outputs.pop(name, None)  # frees the last run's gradient before the next run
            outputs[name] = run_once(name, args.B, args.T, args.V, args.hidden, dtype, device)
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
            f"{name}: B={args.B} T={args.T} V={args.V} H={args.hidden} {args.dtype} {args.device}: "
            f"{results[name]['median_seconds']:.3f} s (CPU {results[name]['median_cpu_seconds']:.3f} s), "
            f"peak {results[name]['median_peak_gib']:.2f} GiB "
            f"(median of {args.repeats})",
            flush=True,
        )
    report = {"B": args.B, "T": args.T, "V": args.V, "H": args.hidden, "device": args.device, "dtype": args.dtype}
    report["results"] = results
    if len(outputs) == 2:
        (*_, full_log_probs, full_grad), (*_, fused_log_probs, fused_grad) = outputs["full"], outputs["fused"]
        diff = {
            "log_probs": (full_log_probs - fused_log_probs).abs().max().item(),
            "grad": (full_grad.float() - fused_grad.float()).abs().max().item(),
        }
        report["max_abs_diff"] = diff
        print(f"max |full - fused|: log_probs {diff['log_probs']:.3g}, grad {diff['grad']:.3g}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
