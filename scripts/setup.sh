#!/usr/bin/env bash
# Create .venv and install fp8scope into it. Idempotent: a second run that finds the same pyproject.toml,
# setup.py and script installed does nothing.
#
#   scripts/setup.sh          the runtime, the monitor service and the test tools (the "dev" extra)
#   scripts/setup.sh server   the runtime and the monitor service only: what the demo runs
#
# Each step says what it installs and, when done, how long it took; pip shows its own progress.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LEVEL=${1:-dev}
case "$LEVEL" in
dev | server) ;;
*)
    echo "setup: unknown level '$LEVEL' (dev or server)" >&2
    exit 2
    ;;
esac

want=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
done_with() { [ -f ".venv/.fp8scope-$1" ] && [ "$(cat ".venv/.fp8scope-$1")" = "$want" ]; }
# the dev extra holds the server extra: either stamp will do for the demo
if done_with dev || { [ "$LEVEL" = server ] && done_with server; }; then
    exit 0
fi

start=$SECONDS
step() { echo "setup: $* ($((SECONDS - start)) s so far)"; }
if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    "$PY" -m venv .venv
fi
step "updating pip"
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        step "installing PyTorch (a CUDA build, about 3 GB: several minutes)"
        .venv/bin/python -m pip install --progress-bar on "torch>=2.11"
    else
        # an unpinned torch pulls a several-GB CUDA build; on a CPU machine take the CPU one
        step "installing PyTorch (the CPU build)"
        .venv/bin/python -m pip install --progress-bar on "torch==2.13.0"
    fi
fi
if [ "$LEVEL" = server ]; then
    step "installing fp8scope with the monitor service (FastAPI, SQLAlchemy, plotly.js, pyarrow)"
else
    step "installing fp8scope with the monitor service and the test tools (pytest, Playwright, transformers, Lightning, torchao, Triton)"
fi
.venv/bin/python -m pip install --progress-bar on -e ".[$LEVEL]"
echo "$want" >".venv/.fp8scope-$LEVEL"
step "done"
