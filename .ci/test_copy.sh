#!/usr/bin/env bash
# A generated copy's whole suite, both tiers (make test and make test-long), as its owner will run it: the copy is
# made in a temporary folder under another package name (zebra_net), with the template-only files left behind, and
# its tests run there with this checkout's .venv, the copy first on PYTHONPATH (its package has another name, so
# the template's installed `project` can't stand in for it). Arguments go to pytest, e.g. `-m "not long"`;
# COPY_FLAGS go to scripts/new_project.py, e.g. COPY_FLAGS=--no-example.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON_BIN:-$PWD/.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GIT_AUTHOR_NAME=${GIT_AUTHOR_NAME:-test-copy} GIT_AUTHOR_EMAIL=${GIT_AUTHOR_EMAIL:-test-copy@localhost}
export GIT_COMMITTER_NAME=${GIT_COMMITTER_NAME:-test-copy} GIT_COMMITTER_EMAIL=${GIT_COMMITTER_EMAIL:-test-copy@localhost}
# shellcheck disable=SC2086  # COPY_FLAGS is a list of flags
"$python" scripts/new_project.py "$tmp/zebra_net" --name zebra_net ${COPY_FLAGS:-}
cd "$tmp/zebra_net"
PYTHONPATH="$PWD" "$python" -m pytest -n "${WORKERS:-2}" --dist loadfile -p no:cacheprovider "$@"
