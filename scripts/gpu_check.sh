#!/usr/bin/env bash
# One GPU, under 8 minutes, one table: ZeRO-3 actor update tokens/s and MFU, weight push, sleep and
# wake seconds, memory freed by the rollout's sleep, generation tokens/s, rollout-vs-actor probability
# difference, peak and least free device memory; Qwen2.5-0.5B's shape with random weights, vLLM
# rollout when it imports, else transformers (the header says which). Details: scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh                  # one CUDA device (without one it says so and exits 0)
#   WHEELS=dir bash scripts/gpu_check.sh       # first installs from dir what the check needs and lacks
#   bash scripts/gpu_check.sh --optimizer adamw   # torch's AdamW where FusedAdam cannot build (no nvcc)
#   bash scripts/gpu_check.sh --lora 32        # the LoRA case: offload/reload, merged and adapter pushes
#   bash scripts/gpu_check.sh --smoke          # tiny shape: the same code on CPU, in seconds (--lora too)
#
# WHEELS: a folder of wheels (bench/gpu_wheels.sh builds one) for a machine with torch and no network.
# Whatever is still missing afterwards stops the check with exit 2 and one line naming it. vLLM cannot
# come this way (its wheel is over 300 MB); without it the rollout is transformers'.
# The table is also written to $OUT/gpu_check.json, or gpu_check_lora.json (default OUT: outputs/gpu_check).
# PYTHON (default python3, the interpreter that holds torch on the device image) runs the check.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [ -n "${WHEELS:-}" ]; then
    # The pip names gpu_check.py would report missing (its REQUIRED), one per line.
    mapfile -t missing < <("$PYTHON" -c "import sys; sys.path.insert(0, 'scripts'); import gpu_check
print(*(name.split()[0] for name in gpu_check.missing_packages()), sep='\n')" 2>/dev/null | grep .)
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "[gpu_check] installing ${missing[*]} from $WHEELS" >&2
        log="$(mktemp)"
        # A failed install is reported by the check itself below (exit 2, naming what is still missing).
        "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}" >"$log" 2>&1 \
            || echo "[gpu_check] pip could not install all of it from $WHEELS: $(grep -m1 ERROR "$log" || tail -1 "$log")" >&2
        rm -f "$log"
    fi
fi

exec "$PYTHON" scripts/gpu_check.py "$@"
