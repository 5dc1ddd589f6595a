#!/usr/bin/env bash
# The README's install paths for a machine without the clone, tried for real, each in a
# fresh virtual environment (torch first: FEDLB_TORCH, default torch==2.13.0, as setup.sh
# does on machines without an NVIDIA GPU):
#  1. fedlb's wheel built from this repository: the CLI, the package data, and a 2-round
#     heterogeneous demo (real SuperLink and SuperNodes on 127.0.0.1) run from it;
#  2. `pip install git+URL` from this repository's committed HEAD (a file://
#     URL here): the CLI and the package data.
#   ./scripts/check-wheel.sh          # ~3-5 minutes with pip's cache warm
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

echo "== wheel"
quiet "$python" -m pip wheel -q --no-deps -w "$work/dist" .
wheel="$(ls "$work"/dist/fedlb-*.whl)"
echo "built $(basename "$wheel")"

echo "== a fresh virtual environment"
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check)
quiet "${pip[@]}" install -q "${FEDLB_TORCH:-torch==2.13.0}"
quiet "${pip[@]}" install -q "$wheel"

echo "== what a silo and a server run"
cd "$work"  # away from the clone: nothing may come from its source tree
"$work/venv/bin/fedlb" --help >/dev/null
"$work/venv/bin/python" - <<'PY'
import fedlb, fedlb.data, fedlb.training
assert "site-packages" in fedlb.__file__, fedlb.__file__
digits = fedlb.data.load_digits()
assert len(digits) > 1000, len(digits)
assert "h200/cnn" in fedlb.training.STEP_CURVES
print("installed at", fedlb.__file__, "with its package data: digits", len(digits),
      "samples,", len(fedlb.training.STEP_CURVES), "step-time curves")
PY
"$work/venv/bin/fedlb" demo --num-rounds 2 --local-steps 5 --out-dir "$work/run" >"$work/demo.log" 2>&1 \
  || { tail -30 "$work/demo.log"; echo "check-wheel: the demo failed from the wheel"; exit 1; }
grep -q "completed: rounds 1-2" "$work/demo.log" \
  || { tail -30 "$work/demo.log"; echo "check-wheel: the demo did not complete"; exit 1; }
echo "check-wheel: the wheel installs and runs a 2-round demo in a fresh environment"

echo "== pip install git+file://... in another fresh environment"
"$python" -m venv "$work/git-venv"
git_pip=("$work/git-venv/bin/python" -m pip --disable-pip-version-check)
quiet "${git_pip[@]}" install -q "${FEDLB_TORCH:-torch==2.13.0}"
quiet "${git_pip[@]}" install -q "git+file://$repo"
"$work/git-venv/bin/fedlb" --help >/dev/null
"$work/git-venv/bin/python" -c 'import fedlb.data, fedlb.training; assert len(fedlb.data.load_digits()) > 1000; assert fedlb.training.STEP_CURVES'
echo "check-wheel: the Git install works in a fresh environment"
