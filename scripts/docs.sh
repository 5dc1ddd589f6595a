#!/usr/bin/env bash
# Builds the documentation site into site/ with MkDocs (mkdocs.yml), warnings as errors:
#   ./scripts/docs.sh          build (what ./scripts/test.sh and CI run)
#   ./scripts/docs.sh serve    build and serve with live reload on http://127.0.0.1:8000/
# Other arguments go to mkdocs. On a fresh clone it sets fedlb up with the docs tools
# (./scripts/setup.sh docs); where fedlb is set up already it adds the docs extra's
# packages to the same environment when they are missing (docs/contributing-docs.md).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FEDLB_VENV:-.venv}"
if ! "$venv/bin/python" -c 'import fedlb, torch' 2>/dev/null; then
  ./scripts/setup.sh docs
elif ! "$venv/bin/python" -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null; then
  echo "docs: installing the docs tools (pyproject's docs extra) into $venv"
  mapfile -t tools < <("$venv/bin/python" -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
  "$venv/bin/python" -m pip --disable-pip-version-check install -q "${tools[@]}" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored" || true; }
fi
export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, at every build
if [[ "${1:-}" == "serve" ]]; then
  shift
  exec "$venv/bin/mkdocs" serve --strict "$@"
fi
"$venv/bin/mkdocs" build --strict --quiet "$@"
# The site is pages, not data: results stay in the repository (docs/results, linked).
# (Checked on the default build; other arguments may build elsewhere.)
limit=$((10 * 1000 * 1000))
size=$(du -sb site | cut -f1)
if (( $# == 0 && size >= limit )); then
  echo "docs: the built site is $size bytes, over $limit: keep results and large files" \
    "out of docs/ pages (link them), or split what grew (du -sb site/* says where)" >&2
  exit 1
fi
