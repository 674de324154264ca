#!/usr/bin/env bash
# Set up (if needed) and run the main job: a short FP8 training run on the CPU that prints its loss
# and the per-tensor FP8 health. Extra arguments go to fp8-train.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/fp8-train --preset tiny --steps 200 --recipe delayed "$@"
