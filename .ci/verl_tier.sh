#!/usr/bin/env bash
# CI, verl tier: dsrl's RL math against verl 0.9.1 itself (tests/verl), in a virtual environment of its own.
#
# The environment reuses this Python's packages (--system-site-packages: torch, numpy, omegaconf, pytest)
# and adds verl with --no-deps (its requirements pin transformers<5.11 and pull ray[default], wandb, vLLM-era
# extras) plus what `import verl.trainer.ppo.core_algos` needs, found by trying: ray (verl/__init__ imports
# DataProto, which imports ray), tensordict and codetiming. Those install with their own requirements, which
# pip takes from this Python where it has them. It lives in $DSRL_VERL_VENV (default ~/.cache/dsrl/verl-venv,
# ~200 MB, ~30 s to build); a run that finds it complete installs nothing.
# The tests import dsrl from this checkout (PYTHONPATH), not from an installed copy.
set -euo pipefail
cd "$(dirname "$0")/.."

VERL_VERSION=0.9.1
# name==version: what `import verl.trainer.ppo.core_algos` needs beyond this Python's packages.
IMPORT_NEEDS=("ray==2.55.1" "tensordict==0.10.0" "codetiming==1.4.0")
VENV="${DSRL_VERL_VENV:-$HOME/.cache/dsrl/verl-venv}"
PY="$VENV/bin/python"

ready() {
    "$PY" - "verl==$VERL_VERSION" "${IMPORT_NEEDS[@]}" <<'PYCHECK' 2>/dev/null
import importlib.metadata as md, sys
for requirement in sys.argv[1:]:
    name, version = requirement.split("==")
    assert md.version(name) == version, requirement
PYCHECK
}

if ! ready; then
    echo "[verl tier] building $VENV (verl==$VERL_VERSION)"
    "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
    "$PY" -m pip install --quiet --no-deps "verl==$VERL_VERSION"
    "$PY" -m pip install --quiet "${IMPORT_NEEDS[@]}"
    ready || { echo "[verl tier] $VENV is incomplete after installing" >&2; exit 1; }
fi

export DSRL_VERL_TIER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
"$PY" -m pytest tests/verl "$@"
