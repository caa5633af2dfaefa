#!/usr/bin/env bash
# GPU check of the colocated vLLM rollout with sleep mode: a few GRPO steps of a small model on
# this machine's GPUs, then the numbers that matter per step:
#   device memory free before / after the rollout sleeps (and what sleep freed), wake time,
#   weight push time, generation tokens/s, vLLM-vs-actor log-prob difference.
#
#   bash scripts/gpu_check.sh                       # tiny model built here, 1 GPU
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct NUM_GPUS=2 TP=2 bash scripts/gpu_check.sh
#
# Needs CUDA and the `vllm` package (the CUDA wheel); without either it says so and exits 0.
# The actor runs ZeRO-3 on the device (ds_configs/zero3.json), so the DeepSpeed offload_states /
# reload_states path runs too; dtype bfloat16 (the log-prob difference is then ~1e-2, not ~1e-6).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[gpu_check] skipped: no CUDA device"; exit 0
fi
if ! "$PYTHON" -c "import vllm" 2>/dev/null; then
    echo "[gpu_check] skipped: the vllm package is not installed (pip install vllm)"; exit 0
fi

OUT="${OUT:-outputs/gpu_check}"
NUM_GPUS="${NUM_GPUS:-1}"
TP="${TP:-1}"
STEPS="${STEPS:-4}"
SLEEP_LEVEL="${SLEEP_LEVEL:-1}"
mkdir -p "$OUT"
MODEL="${MODEL:-$OUT/tiny_model}"
if [ ! -e "$MODEL/config.json" ] && [ "$MODEL" = "$OUT/tiny_model" ]; then
    "$PYTHON" scripts/make_tiny_model.py --out "$MODEL" --sft-steps 0
fi
[ -e "$OUT/data/train.parquet" ] || "$PYTHON" scripts/prepare_data.py --task arithmetic --out "$OUT/data"

"$PYTHON" -m deepspeed.launcher.runner --num_gpus "$NUM_GPUS" tests/vllm/train_worker.py --out "$OUT" \
    configs/quickstart.yaml \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.dtype=bfloat16 \
    actor_rollout_ref.actor.deepspeed_config=zero3 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.enable_sleep_mode=true \
    actor_rollout_ref.rollout.sleep_level="$SLEEP_LEVEL" \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$TP" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    data.train_files="$OUT/data/train.parquet" \
    data.val_files=null \
    data.max_response_length=64 \
    trainer.total_training_steps="$STEPS" \
    trainer.logger=[console]

"$PYTHON" - "$OUT/rank0.json" "$NUM_GPUS" <<'PY'
import json, sys

report = json.load(open(sys.argv[1]))
world = int(sys.argv[2])
print(f"[gpu_check] rollout {report['rollout']}, world {report['world']}, tensor parallel {report['tp']}")
print(f"{'step':>4} {'free before sleep':>18} {'after':>8} {'freed':>8} {'wake s':>8} {'push s':>8} {'gen tok/s':>10} {'lp diff mean':>13} {'max':>8}")
for entry in report["logged"]:
    m = entry["metrics"]
    if "timing_s/gen" not in m:
        continue
    rows = 32 * 8 / world  # quickstart: train_batch_size 32 x n 8, split over the ranks
    tokens_per_s = m["response_length/mean"] * rows / m["timing_s/gen"]
    print(f"{entry['step']:>4} {m['rollout/free_mem_before_sleep_gib']:>14.2f} GiB {m['rollout/free_mem_after_sleep_gib']:>8.2f}"
          f" {m['rollout/sleep_freed_gib']:>8.2f} {m['timing_s/wake']:>8.3f} {m['timing_s/update_weights']:>8.3f}"
          f" {tokens_per_s:>10.0f} {m['rollout/logprob_diff_mean']:>13.2e} {m['rollout/logprob_diff_max']:>8.2e}")
PY
