#!/usr/bin/env bash
# The main job, set up if needed: the monitor service on its embedded SQLite default (./fp8scope.db) and a
# real FP8 training run of the tiny GPT streaming into it, with injected instabilities (a saturating weight,
# then a learning-rate spike) so the dashboard has something to show. Prints the dashboard address, and
# keeps the monitor running after training until Ctrl-C (FP8SCOPE_DEMO_KEEP=0: stop it at the end).
# Extra arguments go to fp8-train. FP8SCOPE_PORT picks the port (default 8000); a monitor already
# answering there is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
# the runtime and the monitor service: the test tools (scripts/test.sh installs them) are not needed here
scripts/setup.sh server

PORT=${FP8SCOPE_PORT:-8000}
URL="http://127.0.0.1:${PORT}"
healthy() { .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" \
    "${URL}/healthz" >/dev/null 2>&1; }

server=""
if healthy; then
    echo "demo: reusing the monitor already running at ${URL}"
else
    .venv/bin/fp8-monitor serve --port "${PORT}" --log-level warning &
    server=$!
    trap '[ -n "${server}" ] && kill "${server}" 2>/dev/null; wait 2>/dev/null || true' EXIT
    for _ in $(seq 100); do healthy && break; kill -0 "${server}" 2>/dev/null || exit 1; sleep 0.2; done
    healthy || { echo "demo: the monitor did not come up at ${URL}" >&2; exit 1; }
fi
echo "demo: dashboard at ${URL}/ (open it now: the run appears live)"

.venv/bin/fp8-train --preset tiny --steps 300 --recipe delayed --eval-interval 100 \
    --monitor-url "${URL}" --run-name "demo-$(date +%Y%m%d-%H%M%S)" \
    --inject overflow:blocks.2.mlp.fc@120 --inject lr-spike@220 "$@"

echo "demo: training finished; the run is at ${URL}/"
if [ -n "${server}" ] && [ "${FP8SCOPE_DEMO_KEEP:-1}" != "0" ]; then
    echo "demo: the monitor keeps running for the dashboard; Ctrl-C stops it"
    wait "${server}"
fi
