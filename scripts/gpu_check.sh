#!/usr/bin/env bash
# One GPU, under 8 minutes, one table: ZeRO-3 actor update tokens/s and MFU, weight push, sleep and
# wake seconds, memory freed by the rollout's sleep, generation tokens/s, rollout-vs-actor probability
# difference, peak and least free device memory; Qwen2.5-0.5B's shape with random weights, vLLM
# rollout when it imports, else transformers (the header says which). Details: scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh                  # one CUDA device (without one it says so and exits 0)
#   WHEELS=dir bash scripts/gpu_check.sh       # first installs deepspeed, omegaconf, pyyaml, accelerate from dir
#   bash scripts/gpu_check.sh --smoke          # tiny shape: the same code on CPU, in seconds
#
# The table is also written to $OUT/gpu_check.json (default outputs/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

if [ -n "${WHEELS:-}" ]; then
    missing=()
    for pair in deepspeed:deepspeed omegaconf:omegaconf yaml:pyyaml accelerate:accelerate; do
        "$PYTHON" -c "import ${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        "$PYTHON" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}"
    fi
fi

exec "$PYTHON" scripts/gpu_check.py "$@"
