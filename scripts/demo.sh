#!/usr/bin/env bash
# Sets fedlb up (./scripts/setup.sh) and runs the main job. Extra arguments go to it.
#
# Until the Flower deployment lands (issue 3), the main job is the balancing core's what-if
# on a heterogeneous 5-silo federation (speeds 4:3:2:1.5:1 samples/s ratio, a fixed
# encryption-like cost per round that is larger on the slow silos, τ = 50): each tuner's
# batch sizes round by round, the round time against the ideal T*, and E. Clock: model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
venv="${FEDLB_VENV:-.venv}"
exec "$venv/bin/fedlb" tune --speeds 400,300,200,150,100 --overheads 0.8,0.8,0.8,1.2,1.2 \
  --iterations 50 --batch 32 --rounds 6 --noise 0.03 --tuners proportional,deadband "$@"
