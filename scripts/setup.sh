#!/usr/bin/env bash
# Create .venv and install fp8scope with its test dependencies. Idempotent: a second run that finds
# the same pyproject.toml, setup.py and script installed does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.fp8scope-installed
want=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        .venv/bin/python -m pip install -q "torch>=2.11"
    else
        # an unpinned torch pulls a several-GB CUDA build; on a CPU machine take the CPU one
        .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
fi
.venv/bin/python -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
