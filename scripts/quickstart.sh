#!/usr/bin/env bash
# CPU quickstart: build what is missing (tiny model, arithmetic data), then train with GRPO.
# Extra arguments are dotted config overrides, e.g. `bash scripts/quickstart.sh trainer.total_training_steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
# The data is written while the model builds (the build uses at most two threads, writing the data one).
data=0
[ -f outputs/data/arithmetic/train.parquet ] || { python scripts/prepare_data.py --task arithmetic --out outputs/data/arithmetic & data=$!; }
[ -f outputs/tiny_model/config.json ] || python scripts/make_tiny_model.py --out outputs/tiny_model
[ "$data" = 0 ] || wait "$data"
python scripts/train.py configs/grpo.yaml configs/cpu.yaml configs/quickstart.yaml "$@"
