#!/usr/bin/env bash
# dsrl on the TRL baseline's exact task and geometry (research/trl_baseline.md): same SFT model, same
# 256 validation problems, 32 prompts x 8, <= 8 new tokens, temperature 1, beta 0, lr 5e-4 constant,
# group-normalised advantages, token-mean loss, one optimizer step per batch.
# Usage: bash run_dsrl.sh RUN_NAME STEPS [NPROC=1] [DS_CONFIG=zero3_offload] [extra overrides...]
# Env: WORK (default the bench work folder), PY (project venv python), ROOT (project checkout, default $PWD).
set -euo pipefail
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${WORK:-$HOME/.cache/dsrl-bench}"; ROOT="${ROOT:-$PWD}"
PY="${PY:-$(command -v python)}"
RUN="$1"; STEPS="$2"; NPROC="${3:-1}"; DS="${4:-zero3_offload}"; shift $(( $# < 4 ? $# : 4 ))
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
[ -f "$WORK/model_sft/model.safetensors" ] || { echo "build the SFT model first: bash run_trl.sh"; exit 1; }
mkdir -p "$WORK/dsrl_data"
[ -f "$WORK/dsrl_data/train.parquet" ] || "$PY" - "$WORK" <<'PY'
import sys, pyarrow as pa, pyarrow.parquet as pq
w = sys.argv[1]
for name in ("train", "val"):
    t = pq.read_table(f"{w}/data/{name}.parquet").to_pylist()
    rows = {"data_source": ["arithmetic"] * len(t), "prompt": [r["prompt"] for r in t], "ability": ["math"] * len(t),
            "reward_model": [{"style": "rule", "ground_truth": r["answer"]} for r in t],
            "extra_info": [{"split": name, "index": i} for i in range(len(t))]}
    pq.write_table(pa.table(rows), f"{w}/dsrl_data/{name}.parquet")
PY
cat > "$WORK/dsrl_kit.yaml" <<YAML
data:
  train_files: $WORK/dsrl_data/train.parquet
  val_files: $WORK/dsrl_data/val.parquet
  train_batch_size: 32
  max_prompt_length: 32
  max_response_length: 8
  seed: 0
actor_rollout_ref:
  model: {path: $WORK/model_sft, dtype: float32, enable_gradient_checkpointing: false, shared_prompt_forward: true}  # the CPU overlay's prompt sharing when docs/performance.md's figures were taken
  actor:
    deepspeed_config: $DS
    ppo_mini_batch_size: 32
    ppo_micro_batch_size_per_gpu: $((256 / NPROC))
    loss_agg_mode: token-mean
    entropy_coeff: 0.0
    use_kl_loss: false
    grad_clip: 1.0
    optim: {lr: 5.0e-4}
  rollout: {n: 8, temperature: 1.0, log_prob_micro_batch_size_per_gpu: $((256 / NPROC))}
algorithm: {adv_estimator: grpo, norm_adv_by_std_in_grpo: true}
trainer: {experiment_name: $RUN, total_training_steps: $STEPS, test_freq: 10, val_before_train: true, seed: 0}
YAML
cd "$ROOT"
echo "== dsrl $RUN: $STEPS steps, $NPROC rank(s), $DS  load: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$NPROC" = 1 ]; then
  "$PY" scripts/train.py "$WORK/dsrl_kit.yaml" "$@" > "$WORK/$RUN.log" 2>&1
else
  PATH="$(dirname "$PY"):$PATH" deepspeed --num_gpus "$NPROC" scripts/train.py "$WORK/dsrl_kit.yaml" "$@" > "$WORK/$RUN.log" 2>&1
fi
"$PY" "$KIT/summarize_dsrl.py" "$WORK/$RUN.log"
