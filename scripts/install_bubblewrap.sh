#!/usr/bin/env bash
# bubblewrap, which the dsrl:python tool's sandbox runs model-written code in (docs/tools.md), from the OS
# packages: nothing to do where bwrap is on PATH; else apt-get or dnf, as root. Elsewhere it says what to install.
set -euo pipefail
command -v bwrap >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && apt-get install -y -q bubblewrap
elif [ "$(id -u)" = 0 ] && command -v dnf >/dev/null; then
  dnf install -y bubblewrap
else
  echo "install bubblewrap >= 0.8 from your OS packages (apt-get install bubblewrap, dnf install bubblewrap):" \
    "the python tool's sandbox and its tests need it" >&2
  exit 1
fi
