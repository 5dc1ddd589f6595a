#!/usr/bin/env bash
# Sets fedlb up (./scripts/setup.sh) and runs lint, type checks and the test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k balance
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
venv="${FEDLB_VENV:-.venv}"
echo "== ruff"
"$venv/bin/ruff" check fedlb tests benchmarks examples
"$venv/bin/ruff" format --check fedlb tests benchmarks examples
echo "== mypy"
"$venv/bin/mypy"
echo "== pytest"
exec "$venv/bin/pytest" "$@"
