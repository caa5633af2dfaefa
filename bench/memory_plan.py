"""The memory plan (``dsrl.plan``, ``dsrl-train --plan``) against measured memory, against DeepSpeed's own
estimators, and every shipped recipe's plan on 8 x 141 GiB.

    python bench/memory_plan.py measure [--cases quickstart,wide-z3-offload,wide-z3,wide-z2,moe-z3] [--json PATH]
    python bench/memory_plan.py estimators      # model states vs DeepSpeed's estimators (meta-device models)
    python bench/memory_plan.py recipes         # every recipe at 8 x 141 GiB (the README's table)

``measure`` runs two training steps of each case in a fresh process on the CPU (``DS_ACCELERATOR=cpu``, one rank,
no validation, console logging only) and records, per phase of the step (``dsrl.trainer.loop``'s ``in_phase`` names:
gen, old_log_prob, ref, values, update_critic, update_actor; the larger of the two steps' peaks, as the optimizer
allocates its states in the first update), the process's peak resident memory: the kernel's
high-water mark ``VmHWM``, reset when the phase starts (``/proc/self/clear_refs``) and read when it ends, minus
the resident memory just before the actor engine is built (libraries, tokenizer, prompts: what the plan does not
count). glibc is told to return every block above 64 KiB to the kernel when freed (``MALLOC_MMAP_THRESHOLD_``),
so that the resident set follows the live tensors. The plan's figure for a phase is what a CPU rank needs
(``Plan.need``): its device and host terms together, as on a CPU they are one memory. The error is
``(plan - measured) / measured``.

Cases: the quickstart (``scripts/quickstart.sh``'s config: tiny model, ZeRO-3 with CPU offload); the 97 M
``make_tiny_model.py --wide`` model (``outputs/wide_model``, vocabulary 100) on the quickstart's config with a
smaller batch (8 prompts x 4 responses, micro-batches of 16) under ZeRO-3 with offload, ZeRO-3 and ZeRO-2; and
SmolLM2-135M-Instruct (``scripts/import_gguf.py``, vocabulary 49,152: the log-prob head counts) the same way under
ZeRO-3 with offload and ZeRO-2; and the 93 M mixture of experts ``make_tiny_model.py --moe --wide``
(``outputs/wide_moe_model``: 8 experts a layer, top 2) the wide model's way under ZeRO-3 with and without offload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsrl.config import load_and_validate
from dsrl.plan.inputs import Device, ZeroSetup, detect_device
from dsrl.plan.plan import plan_for_config
from dsrl.plan.shape import GIB, read_shape
from dsrl.plan.terms import model_states, update_gradients

MIB = 2**20
QUICKSTART = ["configs/grpo.yaml", "configs/cpu.yaml", "configs/quickstart.yaml"]
# Two steps: the optimizer allocates its states in the first update, so only the second step holds them all; each
# phase's peak is the larger of its two.
TWO_STEPS = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.logger=[console]", "trainer.save_freq=-1", "trainer.resume_mode=disable"]  # fmt: skip
WIDE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"]  # fmt: skip
SETUPS = {"z3-offload": "zero3_offload", "z3": "zero3", "z2": "zero2"}
CASE_NAMES = ("quickstart", *(f"wide-{setup}" for setup in SETUPS), "smollm2-z3-offload", "smollm2-z2",
              "moe-z3-offload", "moe-z3")  # fmt: skip


def case_args(case: str, models: dict[str, str], data: str) -> list[str]:
    """The config of ``case`` (``<model>-<setup>``, or the quickstart): files, then overrides, with the models
    (``tiny``, ``wide``, ``smollm2``, ``moe``) and the arithmetic data at the given paths."""
    files = [f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet"]
    if case == "quickstart":
        return [*QUICKSTART, *files, f"actor_rollout_ref.model.path={models['tiny']}"]
    model, setup = case.split("-", 1)
    longer = ["data.max_prompt_length=64"] if model == "smollm2" else []  # its chat template (README's SmolLM2 run)
    return [*QUICKSTART, *files, f"actor_rollout_ref.model.path={models[model]}", *WIDE, *longer,
            f"actor_rollout_ref.actor.deepspeed_config={SETUPS[setup]}"]  # fmt: skip


# The trainer's phase names and the plan's.
PHASES = {"gen": "rollout", "old_log_prob": "old_log_prob", "ref": "ref", "values": "values",
          "update_critic": "update_critic", "update_actor": "update_actor"}  # fmt: skip
# Variables a launcher sets: left out of a worker's environment, so it runs as one process.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
                      "CROSS_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")  # fmt: skip
# Recipes on 8 x 141 GiB: the recipe, its model's shape, and overrides (the 8B line is grpo.yaml's header command).
RECIPE_DATA = [
    "data.train_files=outputs/data/arithmetic/train.parquet",
    "data.val_files=outputs/data/arithmetic/test.parquet",
]
QWEN_05B = "bench/model_shapes/Qwen2.5-0.5B-Instruct.json"
QWEN3_8B = "bench/model_shapes/Qwen3-8B.json"
RECIPES = {
    **{name: (name, QWEN_05B, [])
       for name in ("grpo", "dapo", "grpo_lora", "opo", "otb", "ppo", "reinforce_pp", "rloo", "tir_otb")},
    "grpo, Qwen3-8B": ("grpo", QWEN3_8B, [
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "data.max_response_length=4096", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.85"]),
}  # fmt: skip


def status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)[1])


def reset_peak() -> None:
    """Start the resident high-water mark (VmHWM) again from the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(out: Path, args: list[str]) -> int:
    """One run of ``dsrl.commands.train.main(args)`` with the per-phase peaks written to ``out`` (JSON, bytes)."""
    from dsrl.commands.train import main
    from dsrl.runtime import phases
    from dsrl.trainer import loop as trainer
    from dsrl.trainer import setup

    record: dict = {"phases": {}}
    in_phase, actor_engine = phases.in_phase, setup.ActorEngine

    @contextlib.contextmanager
    def measured_phase(name: str):
        if name not in PHASES:
            with in_phase(name):
                yield
            return
        reset_peak()
        with in_phase(name):
            yield
        peak = status_kib("VmHWM") * 1024
        record["phases"][name] = max(peak, record["phases"].get(name, 0))

    class MeasuredActor(actor_engine):
        def __init__(self, cfg, *a, **k):
            # The model's code (transformers' modeling module, ~100 MiB here) is imported by the first model load:
            # imported before the baseline, the peaks count what the plan models, not library code.
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path))]
            record["baseline"] = status_kib("VmRSS") * 1024
            super().__init__(cfg, *a, **k)

    # the loop's own phases (gen) and its PhaseTimer's (the passes and updates)
    trainer.in_phase = phases.in_phase = measured_phase
    setup.ActorEngine = MeasuredActor
    code = main(args)
    out.write_text(json.dumps(record))
    return code


def measure(case: str, args: list[str]) -> dict:
    """Run ``args`` for two steps in a fresh process; the phases' peaks above the baseline, in bytes."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
                "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"})  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peaks.json"
        overrides = [*TWO_STEPS, f"trainer.default_local_dir={tmp}/run"]
        result = subprocess.run([sys.executable, __file__, "worker", str(out), "--", *args, *overrides],
                                cwd=REPO, env=env, capture_output=True, text=True, check=False)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"{case}: exit code {result.returncode}\n{result.stderr[-3000:]}")
        record = json.loads(out.read_text())
    return {PHASES[name]: peak - record["baseline"] for name, peak in record["phases"].items()}


def cpu_plan(args: list[str]):
    """The plan of ``args`` for one rank on this machine's memory (``DS_ACCELERATOR=cpu``, as ``measure`` sets)."""
    files = [a for a in args if "=" not in a]
    cfg, _ = load_and_validate(files, [a for a in args if "=" in a], 1)
    return plan_for_config(cfg, 1, detect_device())


def measure_table(cases: list[str], models: dict[str, str], data: str, earlier: list[dict] | None) -> list[dict]:
    """The table's rows; ``earlier``: the rows of a previous ``--json``, whose measurements are planned again
    instead of measured."""
    rows = []
    for case in cases:
        args = case_args(case, models, data)
        plan = cpu_plan(args)
        if earlier is None:
            measured = measure(case, args)
        else:
            measured = {row["phase"]: row["measured_mib"] * MIB for row in earlier if row["case"] == case}
        for phase in plan.phases:
            if phase.name not in measured:
                continue
            predicted, actual = plan.need(phase), measured[phase.name]
            rows.append({"case": case, "phase": phase.name, "plan_mib": predicted / MIB, "measured_mib": actual / MIB,
                         "error": (predicted - actual) / actual})  # fmt: skip
            print(
                f"{case:16} {phase.name:14} {predicted / MIB:10.1f} {actual / MIB:12.1f} {rows[-1]['error']:+8.0%}",
                flush=True,
            )
    return rows


def estimator_table() -> list[dict]:
    """Per-rank model states at 8 ranks against DeepSpeed's estimators, fed the parameter count and largest layer
    of the model built on the meta device (what ``estimate_zero3_model_states_mem_needs_all_live`` computes from
    a model before it prints; it returns nothing)."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    world, rows = 8, []
    for path in (QWEN_05B, QWEN3_8B):
        fields = json.loads((REPO / path).read_text())
        config = AutoConfig.for_model(**fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        planned = read_shape("", str(REPO / path)).parameters()
        for stage, offload in ((3, False), (3, True), (2, False), (2, True)):
            zero = ZeroSetup(stage, offload and stage == 3, offload, offload, 0, 0, 0, "fp32")
            terms = model_states("actor", zero, planned, planned, 2, world)
            if stage != 3:  # the update's gradients; ZeRO-3's partition is resident (its step's copy is not counted)
                terms += update_gradients("actor", zero, planned, 2, world)
            device, host = sum(t.device for t in terms), sum(t.host for t in terms)
            if stage == 3:
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total, largest, world, 1, offload, offload, True, 1.0
                )
                gpu -= 4 * largest  # the largest layer's gathered fp32 copy: the plan counts gathered parameters apart
            else:
                cpu, gpu = estimate_zero2_model_states_mem_needs(total, world, 1, offload, 1.0)
            row = {"model": Path(path).stem, "setup": f"ZeRO-{stage}" + (" offload" if offload else ""),
                   "params_meta": total, "params_plan": planned, "plan_device_gib": device / GIB,
                   "deepspeed_device_gib": gpu / GIB, "plan_host_node_gib": host * world / GIB,
                   "deepspeed_host_node_gib": cpu / GIB}  # fmt: skip
            rows.append(row)
            print(f"{row['model']:22} {row['setup']:15} params {total:,} (plan {planned:,})  device/rank plan "
                  f"{row['plan_device_gib']:.2f} DeepSpeed {row['deepspeed_device_gib']:.2f} GiB  host/node plan "
                  f"{row['plan_host_node_gib']:.2f} DeepSpeed {row['deepspeed_host_node_gib']:.2f} GiB",
                  flush=True)  # fmt: skip
    return rows


def recipe_table() -> list[dict]:
    device = Device("cuda", 141 * GIB, "8 x H200")
    rows = []
    for label, (name, shape, overrides) in RECIPES.items():
        cfg, _ = load_and_validate([name], [*RECIPE_DATA, "actor_rollout_ref.rollout.name=vllm", *overrides], 8)
        plan = plan_for_config(cfg, 8, device, str(REPO / shape))
        phases = {p.name: p for p in plan.phases}
        row = {"recipe": label, **{n: (p.device / GIB, p.host / GIB) for n, p in phases.items()},
               "kv": plan.kv.describe(), "over": [p.name for p in plan.over()]}  # fmt: skip
        rows.append(row)
        cells = "  ".join(f"{n} {p.device / GIB:.1f}/{p.host / GIB:.1f}" for n, p in phases.items())
        print(
            f"{label:16} {cells}  | {plan.kv.describe()} | "
            f"{'fits' if not row['over'] else 'EXCEEDS: ' + ', '.join(row['over'])}"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["measure", "estimators", "recipes", "worker"])
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASE_NAMES))
    parser.add_argument("--model", default="./outputs/tiny_model", help="the quickstart's model directory")
    parser.add_argument("--wide-model", default="./outputs/wide_model", help="make_tiny_model.py --wide's directory")
    parser.add_argument("--smollm2", default="./outputs/smollm2", help="scripts/import_gguf.py's directory")
    parser.add_argument("--moe-model", default="./outputs/wide_moe_model", help="make_tiny_model.py --moe --wide's")
    parser.add_argument("--data", default="./outputs/data/arithmetic", help="prepare_data.py --task arithmetic's")
    parser.add_argument("--json", type=Path, help="write the rows there")
    parser.add_argument("--replan", type=Path, help="measure: plan the measurements of this earlier --json again")
    args = parser.parse_args()
    if args.what == "worker":
        return worker(Path(args.rest[0]), args.rest[1:])
    if args.what == "measure":
        os.environ["DS_ACCELERATOR"] = "cpu"  # the plan's device: this machine's memory, as the runs'
        print(f"{'case':16} {'phase':14} {'plan MiB':>10} {'measured MiB':>12} {'error':>8}")
        models = {"tiny": args.model, "wide": args.wide_model, "smollm2": args.smollm2, "moe": args.moe_model}
        earlier = json.loads(args.replan.read_text()) if args.replan else None
        rows = measure_table(args.cases.split(","), models, args.data, earlier)
    elif args.what == "estimators":
        rows = estimator_table()
    else:
        rows = recipe_table()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
