#!/usr/bin/env bash
# Builds wheels/ (gitignored): everything scripts/gpu_check.sh and bench/gpu_measure.sh import beyond torch
# and numpy, for a GPU machine without network that gets this checkout plus at most 64 MiB carried.
#
#   bash bench/gpu_wheels.sh                 # wheels/ for CPython 3.10-3.12 on x86_64 Linux; prints its size
#   PY_VERSIONS=3.11 WITH_NUMPY=1 bash bench/gpu_wheels.sh   # one Python; keep numpy (~16 MB a version)
#
# deepspeed (and omegaconf where it has no wheel) are sdist-only on PyPI: built here with `pip wheel`
# (deepspeed's ops compile on the device when first used, so its wheel is pure Python). The rest is
# `pip download` with dependencies resolved for each target Python; torch and its own dependencies are
# the device's, so deepspeed's, accelerate's and peft's requirements are resolved without torch. vLLM cannot be
# carried: its wheel alone is over 300 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST="${DEST:-wheels}"
LIMIT_MIB=64
mkdir -p "$DEST"

"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed>=0.19" omegaconf
"$PYTHON" -m pip download -q --no-deps -d "$DEST" --only-binary=:all: "accelerate>=1.1" "peft>=0.14"
# The requirements of the no-deps wheels above, torch's excepted (it is on the device).
mapfile -t requirements < <("$PYTHON" - "$DEST" <<'PY'
import sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
NO_DEPS = ("deepspeed", "omegaconf", "accelerate", "peft")  # here already; with their dependencies, torch would come
for wheel in Path(sys.argv[1]).glob("*.whl"):
    if not wheel.name.split("-")[0].lower() in NO_DEPS:
        continue
    with zipfile.ZipFile(wheel) as archive:
        meta = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        for line in archive.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                wanted = req.marker is None or req.marker.evaluate({"extra": ""})
                if req.name.lower() not in ("torch", *NO_DEPS) and wanted:
                    print(str(req).split(";")[0])
PY
)
for version in ${PY_VERSIONS:-3.10 3.11 3.12}; do
    "$PYTHON" -m pip download -q -d "$DEST" --only-binary=:all: --python-version "$version" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        "transformers>=4.56" tokenizers safetensors huggingface_hub pyyaml "pebble>=5.1" psutil "${requirements[@]}"
done
if [ -z "${WITH_NUMPY:-}" ]; then
    rm -f "$DEST"/numpy-*.whl  # torch images ship it; 16 MB per Python version would not fit
fi
size_kib=$(du -sk "$DEST" | cut -f1)
echo "[gpu_wheels] $DEST: $(ls "$DEST"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB (carry limit ${LIMIT_MIB} MiB)"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "[gpu_wheels] over the ${LIMIT_MIB} MiB carry limit: set PY_VERSIONS to the device's Python only" >&2
    exit 1
fi
