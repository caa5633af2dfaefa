#!/usr/bin/env bash
# One sitting on one GPU with torch installed and no network: the GPU-only checks of reviews gpu_path_2 §4 and
# gpu_path_3 (2), under 6 minutes, one table. Each step runs under its own timeout; a failed step is recorded
# (exit code, log) and the next one still runs.
#
#   WHEELS=wheels bash bench/gpu_measure.sh      # the GPU machine; wheels/ from bench/gpu_wheels.sh (< 64 MiB)
#   bash bench/gpu_measure.sh --smoke            # the same steps at tiny sizes on CPU, in about two minutes
#
# Writes to $OUT (default outputs/gpu_measure): gpu_measure.md (the table), gpu_measure.json (every
# number, and each step's exit code and seconds), <step>.log, and each step's own JSON.
#
# Steps, their timeouts (s) and their rows:
#   toolchain         90  versions (python, torch, CUDA, driver, deepspeed), nvcc and CUDA_HOME, the wheel
#                         install, ds_report's op lines, and whether the recipes' optimizer op builds
#                         (FusedAdam; the smoke's offload config: CPUAdam). If FusedAdam cannot build, no
#                         shipped recipe can start on this image, and the later steps measure with torch's
#                         AdamW (--optimizer adamw; the table says so). Generous: a build killed half-way
#                         leaves torch's extension lock behind, on which every later step would wait.
#   gpu_check         75  scripts/gpu_check.py: ZeRO-3 update tokens/s and MFU, trainer memory release, the
#                         actor's offload and reload, weight push, wake/sleep, generation tokens/s,
#                         rollout-vs-actor prob diff, peak memory (Qwen2.5-0.5B shape, transformers rollout:
#                         vLLM cannot be carried, its wheel is over 300 MB).
#   gpu_check_lora    60  scripts/gpu_check.py --lora 32 (review gpu_path_3 G1, G2): LoRA on zero3 in bf16,
#                         the actor's states offloaded and reloaded around each generation, two rounds each
#                         of merged and of adapter pushes: release seconds, prob diff mean/max per mode, the
#                         updates with the KL loss to the adapter-off reference.
#   grad_accum_dtype_zero3          30  bench/grad_accum_dtype.py --config zero3, and
#   grad_accum_dtype_zero3_offload  60  --config zero3_offload (G5; its CPUAdam builds here on first use):
#                         one step over 32 micro-batches of 2 rows x (256 + 512) tokens with grad_accum_dtype
#                         bf16 and fp32: gradient rel L2 error and 1 - cosine, seconds, memory.
#
# BUDGET_S (default 330): the whole script's seconds, so that a failed sitting can be run again inside a
# lent GPU's 15 minutes with a machine start of 1-2 minutes each (2 x (330 + 120) = 900). The timeouts add
# up to 90 + 75 + 60 + 30 + 60 = 315, and 15 s are kept for the table. They are estimates: no step has run
# on a GPU yet, so read each step's seconds in the table and re-size them after the first sitting. Each
# step's timeout is also cut to what is left, so the table is written before a device limit ends the
# command. The smoke has no device limit: its steps get 6x the time (BUDGET_S default 1980), so a loaded
# CI machine slows it down without failing it.
# FusedAdam's first build (nvcc) falls in the toolchain step; later steps load it from ~/.cache/torch_extensions.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"  # the device image's interpreter with torch
OUT="${OUT:-outputs/gpu_measure}"
SMOKE=""
case "${1:-}" in
    --smoke) SMOKE=1 ;;
    "") ;;
    *) echo "usage: [WHEELS=dir] [OUT=dir] bash bench/gpu_measure.sh [--smoke]" >&2; exit 2 ;;
esac
SLACK=$([ -n "$SMOKE" ] && echo 6 || echo 1)  # the smoke's timeouts guard against hangs, not a device limit
BUDGET_S="${BUDGET_S:-$((330 * SLACK))}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # dsrl from this checkout
if [ -n "$SMOKE" ]; then
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
: >"$OUT/steps.tsv"

step() {  # step NAME TIMEOUT_S COMMAND...: its output to $OUT/NAME.log; NAME, exit code, seconds to steps.tsv
    local name=$1 limit=$(($2 * SLACK)) begin=$SECONDS rc
    shift 2
    local left=$((BUDGET_S - 15 - SECONDS))  # 15 s kept for the table
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (timeout ${limit}s)"
    if [ "$limit" -le 0 ]; then
        rc=124
        echo "no time left in BUDGET_S=$BUDGET_S" >"$OUT/$name.log"
    else
        timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
        rc=$?
    fi
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - begin))" >>"$OUT/steps.tsv"
    grep -v -e "Warning" -e "warn(" -e "return func" "$OUT/$name.log" | tail -n 20
}

toolchain() {
    local install="none (WHEELS unset)"
    if [ -n "${WHEELS:-}" ]; then
        # Everything scripts/gpu_check.py's REQUIRED names; pip skips what is installed.
        mapfile -t packages < <("$PYTHON" -c "import sys; sys.path.insert(0, 'scripts'); import gpu_check
print(*gpu_check.REQUIRED.values(), sep='\n')")
        "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "${packages[@]}"
        install="pip exit $? installing ${packages[*]} from $WHEELS"
    fi
    # The recipes' optimizer op: FusedAdam for zero3 on GPU; the smoke's zero3_offload runs CPUAdam.
    "$PYTHON" - "$OUT/toolchain.json" "$([ -n "$SMOKE" ] && echo CPUAdamBuilder || echo FusedAdamBuilder)" "$install" <<'PY'
import json, os, re, shutil, subprocess, sys
import torch
sys.path.insert(0, "scripts")
import gpu_check
path, builder, install = sys.argv[1:]
on_cuda = torch.cuda.is_available()
missing = gpu_check.missing_packages()
facts = {
    "nvidia-smi": subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip() if shutil.which("nvidia-smi") else None,
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "torch cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name() if on_cuda else "cpu",
    "device memory GiB (free, total)": [round(b / 2**30, 1) for b in torch.cuda.mem_get_info()] if on_cuda else None,
    "nvcc": shutil.which("nvcc"),
    "CUDA_HOME": os.environ.get("CUDA_HOME"),
    "wheel install": install,
    "missing packages": missing,
    "optimizer op": builder,
}
if not missing:
    import deepspeed
    facts["deepspeed"] = deepspeed.__version__
    report = subprocess.run([sys.executable, "-m", "deepspeed.env_report"], capture_output=True, text=True).stdout
    facts["ds_report"] = [
        " ".join(re.sub(r"\.{3,}", " ", line).split()) for line in re.sub(r"\x1b\[[0-9;]*m", "", report).splitlines()
        if re.match(r"(fused_adam|cpu_adam|ninja|torch cuda version|nvcc version) ", line)
    ]
    facts["optimizer op problem"] = gpu_check.op_problem(builder)
print(json.dumps(facts, indent=1))
with open(path, "w") as out:
    json.dump(facts, out, indent=1)
sys.exit(1 if missing else 0)
PY
}

export PYTHON OUT SMOKE
step toolchain 90 bash -c "$(declare -f toolchain); toolchain"  # a function: timeout runs programs only
OPTIMIZER=recipe
if "$PYTHON" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/toolchain.json')).get('optimizer op problem') else 1)" 2>/dev/null; then
    OPTIMIZER=adamw  # the recipes could not start here; measure the rest with torch's AdamW
fi

# The check itself, not scripts/gpu_check.sh: the toolchain step has installed the wheels, and the wrapper's
# look for missing packages would import them all again.
step gpu_check 75 env OUT="$OUT" "$PYTHON" scripts/gpu_check.py ${SMOKE:+--smoke} --optimizer "$OPTIMIZER"
step gpu_check_lora 60 env OUT="$OUT" "$PYTHON" scripts/gpu_check.py ${SMOKE:+--smoke} --lora 32 --optimizer "$OPTIMIZER"
# 32 micro-batches, as the OPO-like accumulation of review gpu_path_2 N3; short rows: what differs between the
# variants is the accumulation buffer and, under zero3_offload, its copy per micro-batch, not the model's FLOPs.
if [ -n "$SMOKE" ]; then shape=(--smoke); else shape=(--micro 2 --rows 64 --lengths 256,512); fi
step grad_accum_dtype_zero3 30 "$PYTHON" bench/grad_accum_dtype.py "${shape[@]}" --config zero3 \
    --optimizer "$OPTIMIZER" --json "$OUT/grad_accum_dtype_zero3.json"
step grad_accum_dtype_zero3_offload 60 "$PYTHON" bench/grad_accum_dtype.py "${shape[@]}" --config zero3_offload \
    --optimizer "$OPTIMIZER" --json "$OUT/grad_accum_dtype_zero3_offload.json"

# The table: the toolchain's facts, then each step's exit code and seconds and its JSON's numbers
# (gpu_check's format: "metrics" rows of name, value, unit; any other JSON: its numeric leaves by dotted path).
"$PYTHON" - "$OUT" "$OPTIMIZER" "${SMOKE:+smoke}" <<'PY'
import json, math, sys
from pathlib import Path

out, optimizer, smoke = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "smoke"


def leaves(value, path=""):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}" if path else key)


def cell(value):
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    step = {"name": name, "rc": int(rc), "seconds": float(seconds), "header": None, "metrics": []}
    report_path = out / f"{name}.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        if name == "toolchain":
            step["facts"] = report
        elif "metrics" in report:
            step["header"], step["metrics"] = report.get("header"), report["metrics"]
        else:
            step["raw"] = report
            step["metrics"] = [{"name": key, "value": value, "unit": ""} for key, value in leaves(report)]
    steps.append(step)

toolchain = next((s.get("facts", {}) for s in steps if s["name"] == "toolchain"), {})
note = "the recipes' optimizer" if optimizer == "recipe" else (
    f"torch AdamW: the recipes' optimizer was NOT measured ({toolchain.get('optimizer op problem')})")
lines = [f"# gpu_measure{' --smoke' if smoke else ''}", "", f"optimizer: {note}", ""]
lines += [f"- {key}: {value}" for key, value in toolchain.items()]
lines += ["", "| step | row | value | unit |", "|---|---|---|---|"]
for step in steps:
    status = "ok" if step["rc"] == 0 else f"FAILED (exit {step['rc']}, see {step['name']}.log)"
    lines.append(f"| {step['name']} | exit code, seconds | {step['rc']}, {step['seconds']:.0f} | {status} |")
    for row in step["metrics"]:
        lines.append(f"| {step['name']} | {row['name']} | {cell(row['value'])} | {row['unit']} |")
for step in steps:
    if step["header"]:
        lines.append(f"\n{step['header']}")
(out / "gpu_measure.md").write_text("\n".join(lines) + "\n")
(out / "gpu_measure.json").write_text(json.dumps({"smoke": smoke, "optimizer": optimizer, "steps": steps}, indent=1) + "\n")
print("\n".join(lines))
sys.exit(0 if all(s["rc"] == 0 for s in steps) else 1)
PY
