#!/usr/bin/env bash
# fedlb against the newest flwr-nightly, in one command: ./scripts/check-flower-nightly.sh
#
# Builds a separate virtual environment (.venv-nightly, gitignored) with torch 2.13.0 (the
# CPU build; installed first, so that nothing pulls a CUDA build), fedlb's other
# dependencies, fedlb itself with --no-deps (its `flwr<1.43` pin is bypassed there, and
# only there) and the newest `flwr-nightly` in place of `flwr` (pre-releases admitted for
# it alone); then runs, one file at a time, what a new Flower must pass:
#   tests/test_flower_internals_*.py one test per Flower private detail fedlb relies on
#                                    (the package fedlb/_flower_internals/), quick
#   tests/test_flower_deploy_*.py    deployed runs on real SuperLink/SuperNode processes
#   tests/test_warm_silo.py          the warm path on real processes
# and prints a summary: the nightly's version, each test's outcome and time.
#
#   FLWR_NIGHTLY=1.43.0.dev20261026  a given nightly instead of the newest
#   FEDLB_NIGHTLY_VENV=DIR           where the environment goes (default .venv-nightly)
#   PYTHON=python3.11                the interpreter it is built from (>= 3.11)
#   FEDLB_TORCH=torch==2.13.0        the torch requirement, installed first
#   ./scripts/check-flower-nightly.sh -k lost   other arguments go to each pytest run
#
#   ./scripts/check-flower-nightly.sh --install-only   the environment, no tests
#
# Takes ~15-25 minutes on 2 cores (most of it the deployed tests); a second install is
# quick (pip finds it all there). Exit code: 0 when every selected test passed, 1 when
# one did not, 2 when the environment could not be built.
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${FEDLB_NIGHTLY_VENV:-.venv-nightly}"
python="${PYTHON:-python3}"
torch_spec="${FEDLB_TORCH:-torch==2.13.0}"
install_only=0
[ "${1:-}" = "--install-only" ] && { install_only=1; shift; }
files=(tests/test_flower_internals_*.py tests/test_flower_deploy_*.py tests/test_warm_silo.py)

quiet() {  # pip, without this machine's index-location chatter; fails when pip fails
  "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  return "${PIPESTATUS[0]}"
}
die() { echo "check-flower-nightly: $*" >&2; exit 2; }

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "needs Python >= 3.11 (as Flower does); set PYTHON"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || die "cannot create $venv"
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check)

# a pre-release in the specifier admits pre-releases for this package only (pip's --pre
# would take them for its dependencies too: a grpcio-health-checking rc needing protobuf 7)
wanted="flwr-nightly${FLWR_NIGHTLY:+==$FLWR_NIGHTLY}"
[ -n "${FLWR_NIGHTLY:-}" ] || wanted="flwr-nightly>=0.0.0.dev0"
installed="$("$py" -c 'from importlib.metadata import version; print(version("flwr-nightly"))' 2>/dev/null || true)"
if [ -z "$installed" ] || [ "${FLWR_NIGHTLY:-}" != "$installed" ]; then  # unset: the newest
  echo "== installing into $venv: $torch_spec, fedlb's dependencies, $wanted, fedlb (no deps)"
  "$py" -c 'import torch' 2>/dev/null || quiet "${pip[@]}" install -q "$torch_spec" \
    || die "could not install $torch_spec"
  # fedlb's dependencies and its dev extra (pytest, hypothesis, tensorboard, ...), less Flower
  mapfile -t deps < <("$py" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
    if re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0] not in ("flwr", "torch"):
        print(requirement)
EOF
  )
  quiet "${pip[@]}" install -q "${deps[@]}" || die "could not install fedlb's dependencies"
  # the stable Flower must not shadow the nightly (both install the package `flwr`)
  "$py" -c 'from importlib.metadata import version; version("flwr")' 2>/dev/null \
    && { quiet "${pip[@]}" uninstall -q -y flwr || die "could not remove flwr"; }
  quiet "${pip[@]}" install -q --upgrade --upgrade-strategy only-if-needed "$wanted" \
    || die "could not install $wanted"
  quiet "${pip[@]}" install -q --no-deps -e . || die "could not install fedlb"
fi
# everything consistent but fedlb's own pin (flwr, which flwr-nightly stands in for)
broken="$("${pip[@]}" check 2>&1 | grep -v "^fedlb .* requires flwr, which is not installed" || true)"
[ -z "$broken" ] || [ "$broken" = "No broken requirements found." ] \
  || die "$venv is inconsistent (pip check): $broken"
version="$("$py" -c 'from importlib.metadata import version; print(version("flwr-nightly"))')" \
  || die "flwr-nightly is not installed in $venv"
"$py" -c 'import flwr, fedlb' || die "flwr or fedlb does not import in $venv"
echo "== flwr-nightly $version ($("$py" -c 'import flwr, os; print(os.path.dirname(flwr.__file__))'))"

[ "$install_only" = 1 ] && exit 0

reports="$venv/reports"
rm -rf "$reports" && mkdir -p "$reports"
status=0
for file in "${files[@]}"; do  # one at a time: the deployed tests start many processes
  echo "== $file"
  "$py" -m pytest "$file" -q -p no:cacheprovider --durations=0 \
    --junitxml="$reports/$(basename "$file" .py).xml" "$@" || status=1
done

echo
echo "== summary: fedlb on flwr-nightly $version (Python $("$py" -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d))"
"$py" - "$reports" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

totals: dict[str, int] = {}
for report in sorted(Path(sys.argv[1]).glob("*.xml")):
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                why = (found.get("message") or "").splitlines()[0:1]
                break
        totals[outcome] = totals.get(outcome, 0) + 1
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        line = f"  {outcome:8} {float(case.get('time', 0)):7.1f} s  {name}"
        if outcome != "passed" and why:
            line += f"\n{'':21}{why[0][:160]}"
        print(line)
print("  " + ", ".join(f"{n} {k}" for k, n in sorted(totals.items())))
EOF
exit "$status"
