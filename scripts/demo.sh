#!/usr/bin/env bash
# Sets fedlb up (./scripts/setup.sh) and runs the main job. Extra arguments go to it.
#
# The main job: a heterogeneous federation on this machine. A Flower SuperLink and three
# SuperNodes (real processes on 127.0.0.1), silos emulating hardware 1x, 2x and 4x slower
# (sleep-padded compute, said in every output), 8 rounds of load-balanced FedAvg on the
# embedded digits dataset. The per-round tables show B converge to ~4:2:1 and the idle time
# vanish; the last line says where the results are.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh ""  # fedlb and torch only: no test tools, no system packages
venv="${FEDLB_VENV:-.venv}"
exec "$venv/bin/fedlb" demo --slowdowns 1,2,4 --num-rounds 8 --learning-rate 0.1 "$@"
