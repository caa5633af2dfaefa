"""bf16 versus fp32 gradient accumulation in ZeRO-3 over many micro-batches (review gpu_path_2 N3).

    python bench/grad_accum_dtype.py --micro 32 --rows 1024 --lengths 512,1024 --json PATH   # one GPU, ~1.5 min
    python bench/grad_accum_dtype.py --smoke --json PATH     # tiny shape on CPU: 32 micro-batches in seconds

One optimizer step (the OPO-like on-policy update: one mini-batch of ``--rows`` rows in micro-batches of
``--micro``, random full-length rows and advantages, fixed seeds) from identical random weights, twice:
with ``--config`` (default ``zero3``, its FusedAdam or ``--optimizer adamw``) and
``"data_types": {"grad_accum_dtype": "bf16"}``, then with ``"fp32"``. Both variants are written out
explicitly, whatever the shipped JSON says. In a bf16 model each micro-batch's gradient is bf16 either
way; the variants differ in the dtype of ZeRO-3's gradient partition buffer, into which every
micro-batch after the first is added (``DeepSpeedZeroOptimizer_Stage3.partition_grads``). With one rank
there is no reduce-scatter, so this isolates the accumulation (``communication_data_type`` needs ranks).

Rows: the accumulated gradient (that buffer, read just before the optimizer step, before clipping) of
the bf16 run against the fp32 run's: relative L2 error ``|g_bf16 - g_fp32| / |g_fp32|`` and 1 - cosine;
the same for the step's change of the fp32 master weights (Adam's first step divides by the gradient's
magnitude, so this mostly shows sign flips); per variant the seconds of the update (the snapshot's copy
excluded), its peak memory allocated (CUDA; n/a on CPU) and the buffer's size. With an offloaded optimizer
(``zero3_offload``) the buffer is on the host, and each micro-batch after the first copies every gradient
partition to the device, adds there and copies it back (review gpu_path_3 G5): the rows count those bytes from
the buffers ``partition_grads`` touched (on CPU nothing crosses, the count is what a GPU moves). The header names the
buffer dtype each variant really got, which shows whether DeepSpeed honoured the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_geometry  # noqa: E402
from recipe_geometry import gpu_check  # noqa: E402

VARIANTS = ("bf16", "fp32")
OPO_N = 8  # responses per prompt in configs/opo.yaml; groups do not change the update's arithmetic


def variant_config(base: str, grad_accum_dtype: str, optimizer: str, out: Path) -> Path:
    """A copy of ds_configs/<base>.json (or the path ``base``) with ``data_types.grad_accum_dtype`` set,
    and torch's AdamW with ``optimizer == "adamw"``; ``stage3_param_persistence_threshold: 0`` so that
    ZeRO-3 partitions every tensor, small ones included, as the tests do."""
    from dsrl.config import deepspeed_config_path

    ds = json.loads(deepspeed_config_path(base).read_text())
    ds["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if optimizer == "adamw":
        ds["optimizer"]["params"]["torch_adam"] = True
    path = out / f"{Path(base).stem}_grad_accum_{grad_accum_dtype}.json"
    path.write_text(json.dumps(ds, indent=2))
    return path


def one_step(size, model_dir: Path, config: Path, batch) -> dict:
    """The update's accumulated gradient and master-weight change (float32, on CPU), seconds, peak memory."""
    actor = recipe_geometry.build_actor(size, model_dir, config)
    zero = actor.engine.optimizer  # DeepSpeedZeroOptimizer_Stage3

    def masters() -> torch.Tensor:
        return torch.cat([flat.detach().cpu().float().flatten() for flat in zero.fp32_partitioned_groups_flat])

    before = masters()
    result = {"snapshot_s": 0.0}
    step = zero.step

    def snapshot_then_step(*args, **kwargs):
        begin = time.perf_counter()
        # To CPU first (no float copy on the device); clone: on CPU, in fp32, .cpu().float() is the buffer itself.
        result["grad"] = zero.grad_partitions_flat_buffer.cpu().float().clone()
        result["snapshot_s"] = time.perf_counter() - begin
        return step(*args, **kwargs)

    zero.step = snapshot_then_step
    result["crossing_bytes"] = []  # per micro-batch
    partition_grads = zero.partition_grads

    def counted_partition_grads(params, grad_partitions):
        first = zero.micro_step_id == 0
        buffers = partition_grads(params, grad_partitions)
        if zero.offload_optimizer:  # the buffer is on the host: copied in once, then out, added, back per micro-batch
            result["crossing_bytes"].append(sum(b.numel() * b.element_size() for b in buffers) * (1 if first else 2))
        return buffers

    zero.partition_grads = counted_partition_grads
    seconds, peak = recipe_geometry.timed(lambda: actor.update(batch, temperature=1.0))
    buffer = zero.grad_partitions_flat_buffer
    result.update(
        delta=masters() - before,
        seconds=seconds - result["snapshot_s"],
        peak_gib=peak,
        buffer_dtype=str(buffer.dtype).removeprefix("torch."),
        buffer_mib=buffer.numel() * buffer.element_size() / 2**20,
        crossing_mib=[n / 2**20 for n in result.pop("crossing_bytes")],
        communication_dtype=str(zero.communication_data_type).removeprefix("torch."),
        optimizer=type(actor.engine.basic_optimizer).__name__,
    )
    actor.engine.destroy()
    actor = zero = step = None  # freed before the next variant (the closures above are done with them)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def compare(x: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, cosine) of ``x`` against ``reference``, in float64."""
    x, reference = x.double(), reference.double()
    error = ((x - reference).norm() / reference.norm()).item()
    return error, torch.nn.functional.cosine_similarity(x, reference, dim=0).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, help="rows per micro-batch (default: OPO's 32; --smoke 2)")
    parser.add_argument(
        "--rows", type=int, help="rows of the one mini-batch (default: OPO's 1024 per rank; --smoke 64)"
    )
    parser.add_argument("--lengths", help="prompt,response tokens per row (default 512,1024; --smoke 8,16)")
    parser.add_argument(
        "--config", help="ds_configs name or JSON path the variants copy (default zero3; --smoke zero3_offload)"
    )
    parser.add_argument("--optimizer", choices=("recipe", "adamw"), default="recipe", help="as scripts/gpu_check.py's")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, 32 micro-batches by default")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    size = recipe_geometry.SMOKE if args.smoke else recipe_geometry.SHAPES["qwen2.5-0.5b"]
    defaults = (2, 64, "8,16", size.deepspeed_config) if args.smoke else (32, 1024, "512,1024", "zero3")
    micro, rows, lengths, config = (
        given or default
        for given, default in zip((args.micro, args.rows, args.lengths, args.config), defaults, strict=True)
    )
    prompt_length, response_length = map(int, lengths.split(","))
    if rows % micro or rows % OPO_N:
        parser.error(f"--rows {rows}: must be a multiple of --micro {micro} and of {OPO_N} (rollout.n)")
    size = dataclasses.replace(
        size,
        prompts=rows // OPO_N,
        n=OPO_N,
        micro_batch=micro,
        prompt_length=prompt_length,
        max_tokens=response_length,
        deepspeed_config=Path(config).stem,
    )
    problem = gpu_check.optimizer_problem(size, args.optimizer)
    if problem:
        print(f"[grad_accum_dtype] {problem}", file=sys.stderr)
        return 2
    batch = recipe_geometry.random_batch(size, rows, seed=0)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="grad_accum_dtype-") as tmp:
        model_dir = Path(tmp)
        n_params = gpu_check.save_random_model(size, model_dir)
        for dtype in VARIANTS:
            runs[dtype] = one_step(size, model_dir, variant_config(config, dtype, args.optimizer, model_dir), batch)
    grad_error, grad_cosine = compare(runs["bf16"]["grad"], runs["fp32"]["grad"])
    delta_error, delta_cosine = compare(runs["bf16"]["delta"], runs["fp32"]["delta"])
    table = [  # 1 - cosine: the cosines themselves print as 1 at the table's precision
        ("gradient rel L2 error", grad_error, "|g_bf16 - g_fp32| / |g_fp32|"),
        ("gradient 1 - cosine", 1 - grad_cosine, "1 - cos(g_bf16, g_fp32)"),
        ("master delta rel L2 error", delta_error, "of the fp32 master weights' change"),
        ("master delta 1 - cosine", 1 - delta_cosine, "of the fp32 master weights' change"),
    ]
    for dtype in VARIANTS:
        run = runs[dtype]
        table += [
            (f"{dtype} accumulation update", run["seconds"], "s"),
            (f"{dtype} accumulation peak memory", run["peak_gib"], "GiB"),
            (f"{dtype} accumulation buffer", run["buffer_mib"], f"MiB ({run['buffer_dtype']})"),
        ]
        if run["crossing_mib"]:  # an offloaded optimizer: the gradient partitions' round trips to the host
            crossing = run["crossing_mib"]
            table += [
                (f"{dtype} host<->device, first micro-batch", crossing[0], "MiB (to the host)"),
                (
                    f"{dtype} host<->device, each later micro-batch",
                    sum(crossing[1:]) / max(len(crossing) - 1, 1),
                    "MiB",
                ),
                (f"{dtype} host<->device, the step", sum(crossing), f"MiB over {len(crossing)} micro-batches"),
            ]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    got = ", ".join(
        f"{d} -> buffer {runs[d]['buffer_dtype']}, communication {runs[d]['communication_dtype']}" for d in VARIANTS
    )
    header = (
        f"[grad_accum_dtype] {device}; {Path(config).stem} ({runs['fp32']['optimizer']}) grad_accum_dtype {got}; "
        f"{size.dtype}, {n_params / 1e6:.1f}M parameters (random weights); one step over {rows // micro} micro-batches "
        f"of {micro} rows x ({prompt_length} + {response_length}) tokens"
    )
    recipe_geometry.write_report(args.json, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
