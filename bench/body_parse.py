"""What a telemetry body of many JSON values costs every other request: /healthz while it is parsed.

orjson parses a body in one C call that holds the GIL; `monitor_server.infra.body_json` parses a body of
more than ``YIELDING_VALUES`` values with a parser that lets other threads run between objects. This starts
two real servers (SQLite) that differ only in that: one as shipped, one with the yielding parser switched
off (``YIELDING_VALUES`` set past any body), and posts to each, alternately, the body of
``bench/abuse.py``'s wide-scalars attack (300 steps x 1,000 new scalar names, 4.4 MB, refused 422 by name)
while a client polls ``/healthz`` every 5 ms. Per round: the post's time and the worst ``/healthz``.

    .venv/bin/python bench/body_parse.py [--rounds 4]

Measured, two runs of 4 rounds on the 2-core machine with other work on it (load average 3-4), median / max
of the worst ``/healthz`` per round: orjson 132 / 179 ms and 97 / 157 ms, yielding 50 / 69 ms and 59 / 130
ms; the refused post took 173-430 ms with orjson, 399-1076 ms with the yielding parser. The yielding parser
halves the typical wait; under load a round can still pass 100 ms.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
API = "/api/v1"
STEPS, NAMES = 300, 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(db: Path, yielding: bool) -> tuple[subprocess.Popen, str]:
    """A server on `db`; without `yielding`, every body goes to orjson."""
    port = _free_port()
    switch = "" if yielding else "import monitor_server.infra.body_json as b; b.YIELDING_VALUES = 10**12\n"
    serve = f"main(['serve', '--db', 'sqlite:///{db}', '--port', '{port}'])"
    code = f"{switch}from monitor_server.cli import main\n{serve}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server on {db} did not start")


def body(round_: int) -> bytes:
    steps = [
        {"step": 1_000_000 + s, "scalars": {f"r{round_}.s{s}.n{j}": 1.0 for j in range(NAMES)}}
        for s in range(STEPS)
    ]
    return orjson.dumps({"idempotency_key": f"wide{round_}", "steps": steps})


def trial(url: str, run_id: int, data: bytes) -> tuple[int, float, float]:
    """(status, post ms, worst /healthz ms while it ran)."""
    worst, stop = [0.0], threading.Event()

    def probe() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                client.get(f"{url}/healthz")
                worst[0] = max(worst[0], time.perf_counter() - t0)
                stop.wait(0.005)

    thread = threading.Thread(target=probe)
    thread.start()
    stop.wait(0.2)
    worst[0] = 0.0
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{url}{API}/runs/{run_id}/telemetry", content=data, headers=headers, timeout=60)
    took = time.perf_counter() - t0
    stop.wait(0.2)
    stop.set()
    thread.join()
    return r.status_code, took * 1e3, worst[0] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    worst: dict[str, list[float]] = {"orjson": [], "yielding": []}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {name: start(Path(tmp) / f"{name}.db", name == "yielding") for name in worst}
        try:
            runs = {
                name: httpx.post(f"{url}{API}/runs", json={"name": "wide", "tensors": []}).json()["id"]
                for name, (_, url) in servers.items()
            }
            for k in range(args.rounds):
                data = body(k)
                for name in worst:
                    status, took, w = trial(servers[name][1], runs[name], data)
                    worst[name].append(w)
                    print(
                        f"{name:<9} status {status}  post {took:6.0f} ms  worst /healthz {w:6.1f} ms",
                        flush=True,
                    )
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    for name, values in worst.items():
        print(
            f"{name:<9} worst /healthz per round: median {statistics.median(values):.1f} ms, "
            f"max {max(values):.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
