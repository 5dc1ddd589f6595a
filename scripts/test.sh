#!/usr/bin/env bash
# Sets fedlb up (./scripts/setup.sh) and runs lint, type checks, the docs build
# (./scripts/docs.sh: warnings are errors) and the test suite.
#   ./scripts/test.sh            everything (what CI runs: ~25 minutes on 2 cores)
#   ./scripts/test.sh --quick    the quick tier: unit, model-clock and in-process tests,
#                                without those marked slow (real Flower processes,
#                                torchrun jobs, trained models): ~4 minutes on 2 cores
# Other arguments go to pytest, e.g. ./scripts/test.sh --quick -k balance
set -euo pipefail
cd "$(dirname "$0")/.."
selection=()
if [[ "${1:-}" == "--quick" ]]; then
    shift
    selection=(-m "not slow")
fi
./scripts/setup.sh dev,simulation  # the test tools too (and a browser: setup.sh says)
venv="${FEDLB_VENV:-.venv}"
echo "== ruff"
"$venv/bin/ruff" check fedlb tests benchmarks examples
"$venv/bin/ruff" format --check fedlb tests benchmarks examples
echo "== mypy"
"$venv/bin/mypy"
echo "== docs"
./scripts/docs.sh
echo "== pytest${selection:+ (quick tier: not slow)}"
exec "$venv/bin/pytest" "${selection[@]}" "$@"
