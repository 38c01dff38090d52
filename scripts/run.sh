#!/usr/bin/env bash
# One entry point for a fresh machine: makes .venv, installs MetaDist with what
# the command needs, then runs it.
#   bash scripts/run.sh demo [ARGS...]   the main job: `metadist demo`
#   bash scripts/run.sh check            ruff (lint and format) over the repository, mypy over metadist_core
#   bash scripts/run.sh test [ARGS...]   what CI runs: the checks above, then the lean suite: every test not
#                                        marked slow, plus the slow ones marked ci
#   bash scripts/run.sh test-all [ARGS...]  everything, slow multi-process cases included
#   bash scripts/run.sh typecheck [ARGS...] mypy over metadist_core ([tool.mypy] in pyproject.toml)
# torch comes pinned as torch==2.13.0 (a CPU build on these machines); never an
# unpinned torch, which would pull gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd="${1:-test}"; shift || true

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No wheel cache: the installed set is ~2.2 GB and a cache would hold a second
# copy of every download; CI machines have run out of disk with it.
export PIP_NO_CACHE_DIR=1
need_mb=2600
if [ ! -d .venv/lib ] || ! .venv/bin/python -c "import torch, jax, tvm" >/dev/null 2>&1; then
    free_mb=$(df -Pm . | awk 'NR==2 {print $4}')
    if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
        echo "scripts/run.sh: only ${free_mb} MB free on $(df -P . | awk 'NR==2 {print $6}');" \
             "installing torch, JAX, TVM and the test tools takes about ${need_mb} MB." \
             "Free some disk (or point PIP's TMPDIR elsewhere) and run again." >&2
        exit 1
    fi
fi
pipq() {  # quiet pip that still fails loudly; hides this machine's notes about absent local indexes
    local log; log="$(mktemp)"
    if ! pip install -q "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither" "$log" >&2 || true; rm -f "$log"; return 1
    fi
    grep -v "is ignored: it is neither" "$log" || true; rm -f "$log"
}
# torch first and pinned, so nothing later can ask for a newer one
pipq "torch==2.13.0"
pipq -e ".[all,dev]"
python -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '2.13.0' else 'torch ' + torch.__version__ + ' installed; expected 2.13.0')"

checks() {   # configured in pyproject.toml: [tool.ruff] and [tool.mypy]
    ruff check --quiet . || { echo "ruff check failed: fix the findings above (many: ruff check --fix)" >&2; return 1; }
    ruff format --check --quiet . || { echo "ruff format: the files above are not formatted; run ruff format" >&2; return 1; }
    mypy || { echo "mypy found type errors in metadist_core (above)" >&2; return 1; }
}

case "$cmd" in
    demo) exec metadist demo "$@" ;;
    check) checks ;;
    test) checks; exec python -m pytest -q -m "not slow or ci" --durations=15 "$@" ;;
    test-all) exec python -m pytest -q "$@" ;;
    typecheck) exec mypy "$@" ;;
    *) echo "usage: bash scripts/run.sh demo|check|test|test-all|typecheck [ARGS...]" >&2; exit 2 ;;
esac
