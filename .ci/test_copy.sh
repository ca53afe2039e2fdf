#!/usr/bin/env bash
# A generated copy's make test and make test-long, as its owner will run them: the copy is made in a temporary folder
# under another package name (zebra_net), with the template-only files left behind (the engine's own suite among
# them), and its tests run there with this checkout's .venv, the copy first on PYTHONPATH (its package has another
# name, so the template's installed `project` can't stand in for it) and the copy's own vendored engine there too,
# before the template's editable install of it (a copy must run on what it carries). Arguments go to pytest; COPY_FLAGS go to
# scripts/new_project.py, e.g. COPY_FLAGS=--no-example; arguments with a -m of their own run that selection alone
# (.ci/test_copy.sh -m "not long": the copy's make test).
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
# the copy's engine, not the template's: lightkeep from zebra_net/engine first on the path
export PYTHONPATH="$PWD/engine:$PWD"
start=$(date +%s)
"$python" -m pytest -n "${WORKERS:-2}" --dist loadfile -p no:cacheprovider -m "not long" "$@"
echo "the copy's make test: $(( $(date +%s) - start )) s"
# pytest takes the last -m: arguments with one of their own (e.g. -m "not long") chose the tests, run above
for arg in "$@"; do [[ $arg == -m* ]] && exit 0; done
"$python" -m pytest -n "${WORKERS:-2}" --dist loadfile -p no:cacheprovider -m long "$@" || [ $? = 5 ]
