"""What the web dashboard needs from the service: the page and its files (plotly.js from the installed
package), `GET /whoami` for the caller's scopes, and `GET /stream` with every run's events."""

from __future__ import annotations

import json
import threading
import time
import tomllib
from fnmatch import fnmatch

import numpy as np

from monitor_server.infra.web import plotly_js, web_root
from tests.support import ROOT
from tests.support.http import loopback
from tests.support.server import API, batch_body, random_stats, run_body, running_server

TOKENS = ["dash:read:dash-secret-1", "ops:read+control:ops-secret-1"]


def test_whoami_with_and_without_tokens(make_client):
    open_client = make_client()
    assert open_client.get(f"{API}/whoami").json() == {
        "name": "anonymous",
        "scopes": ["ingest", "read", "control"],
        "auth": False,
    }
    client = make_client(tokens=TOKENS)
    r = client.get(f"{API}/whoami")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get(f"{API}/whoami", headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
    dash = client.get(f"{API}/whoami", headers={"Authorization": "Bearer dash-secret-1"}).json()
    assert dash == {"name": "dash", "scopes": ["read"], "auth": True}
    ops = client.get(f"{API}/whoami", headers={"Authorization": "Bearer ops-secret-1"}).json()
    assert ops == {"name": "ops", "scopes": ["read", "control"], "auth": True}
    # the all-runs stream needs the read scope like every other read
    assert client.get(f"{API}/stream").status_code == 401


def test_page_static_files_and_plotly(make_client):
    client = make_client(tokens=TOKENS)  # the page itself is open; its data is not
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-eval" not in csp and "object-src 'none'" in csp
    assert '<script type="module" src="/static/js/app.js">' in page.text
    # the same page reached as a static file carries the same policy
    assert client.get("/static/index.html").headers["content-security-policy"] == csp
    # every module the page is made of is served, as JavaScript
    for path in sorted((web_root() / "js").glob("*.js")):
        r = client.get(f"/static/js/{path.name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript"), path.name
        assert r.content == path.read_bytes()
    # plotly.js comes from the installed plotly package, never a CDN
    r = client.get("/static/vendor/plotly.min.js")
    assert r.status_code == 200 and r.content == plotly_js().read_bytes()
    assert r.headers["content-encoding"] == "gzip" and int(r.headers["content-length"]) < len(r.content) / 2
    plain = client.get("/static/vendor/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.content == r.content
    again = client.get("/static/vendor/plotly.min.js", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert "cdn" not in page.text.lower()
    # nothing outside web/ is reachable
    for probe in ("/static/../monitor_server/app.py", "/static/%2e%2e/pyproject.toml", "/static/nope.js"):
        assert client.get(probe).status_code == 404, probe


def test_package_data_ships_every_dashboard_file():
    """pyproject's package-data patterns match every file of web/ (the installed service needs them all)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["monitor_server.web_assets"] == "web"
    data = config["package-data"]
    for path in (ROOT / "web").rglob("*"):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT / "web")
        package = ".".join(["monitor_server.web_assets", *rel.parts[:-1]])
        assert any(fnmatch(rel.name, p) for p in data.get(package, [])), f"{rel} is not in package-data"
    assert "COPY web web" in (ROOT / "Dockerfile").read_text()


def _collect(url: str, events: list, stop: threading.Event) -> None:
    """Read `GET /stream` into `events` as (name, data) until `stop` is set."""
    with loopback.stream("GET", url, timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: ") and name:
                events.append((name, json.loads(line[len("data: ") :])))
            if stop.is_set():
                return


def _wait_for(events: list, predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in events if predicate(e)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no matching event in {events}")


def test_all_runs_stream(tmp_path):
    env = {"FP8SCOPE_SSE_KEEPALIVE_SECONDS": "0.5"}
    with running_server(f"sqlite:///{tmp_path / 'all.db'}", log_path=tmp_path / "s.log", env=env) as server:
        old = loopback.post(f"{server.url}{API}/runs", json=run_body(1, name="old")).json()["id"]
        events: list = []
        stop = threading.Event()
        reader = threading.Thread(
            target=_collect, args=(f"{server.url}{API}/stream", events, stop), daemon=True
        )
        reader.start()
        _wait_for(events, lambda e: e[0] == "subscribed")  # the stream's first event: nothing is missed now
        t0 = time.monotonic()
        new = loopback.post(f"{server.url}{API}/runs", json=run_body(1, name="new")).json()["id"]
        created = _wait_for(events, lambda e: e[0] == "run" and e[1]["run_id"] == new)
        assert created[1]["status"] == "running" and created[1]["created"] is True
        assert time.monotonic() - t0 < 10.0  # at once, not at the next poll (generous for a loaded machine)
        # steps and alerts of any run arrive, tagged with the run
        stats = random_stats(np.random.default_rng(0), 2, 3)
        stats["nonfinite"][1, 0] = 2
        body = batch_body("k", [7, 8], stats, losses=[2.5, 2.25])
        assert loopback.post(f"{server.url}{API}/runs/{old}/telemetry", json=body).status_code == 200
        step = _wait_for(events, lambda e: e[0] == "step" and e[1]["step"] == 8)
        assert step[1]["run_id"] == old and step[1]["loss"] == 2.25
        alert = _wait_for(events, lambda e: e[0] == "alert")
        assert alert[1]["run_id"] == old and alert[1]["kind"] == "nonfinite"
        change = {"status": "finished", "tags": ["b", "a"]}
        assert loopback.patch(f"{server.url}{API}/runs/{new}", json=change).status_code == 200
        status = _wait_for(events, lambda e: e[0] == "run" and e[1].get("status") == "finished")
        # a change names what a page shows of the run: its name and tags as stored
        assert status[1]["run_id"] == new and status[1]["name"] == "new" and status[1]["tags"] == ["a", "b"]
        # the run pre-dating the connection was not announced as new; commands stay on the run stream
        assert not [e for e in events if e[0] == "run" and e[1]["run_id"] == old]
        loopback.post(f"{server.url}{API}/runs/{old}/commands", json={"changes": {"margin": 1}})
        # a later event that does reach this stream: one subscriber gets its events in order, so a command
        # event would have come before it
        assert loopback.patch(f"{server.url}{API}/runs/{old}", json={"status": "crashed"}).status_code == 200
        _wait_for(events, lambda e: e[0] == "run" and e[1].get("status") == "crashed")
        assert not [e for e in events if e[0] == "command"]
        stop.set()
    assert "Traceback" not in server.log_text()


def _unpack(body: bytes) -> tuple[dict, np.ndarray]:
    n = int.from_bytes(body[:4], "little")
    head = json.loads(body[4 : 4 + n])
    offset = 4 + n + (-(4 + n) % 8)
    return head, np.frombuffer(body, "<f8", offset=offset).reshape(head["rows"], head["cols"])


def test_packed_heatmap_matches_json(client):
    run = client.post(f"{API}/runs", json=run_body(2)).json()
    rid = run["id"]
    stats = random_stats(np.random.default_rng(1), 300, 6)
    stats["amax"][40, 1] = np.nan
    stats["amax"][41, 2] = np.inf
    steps = [s for s in range(300) if not 100 <= s < 164]  # a gap: empty buckets
    body = batch_body("k", steps, {k: v[: len(steps)] for k, v in stats.items()}, encoding="float64")
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    for params in (
        {"metric": "amax", "max_cols": 40},
        {"metric": "headroom", "from": 30, "to": 250, "max_cols": 7},
    ):
        js = client.get(f"{API}/runs/{rid}/heatmap", params=params).json()
        r = client.get(f"{API}/runs/{rid}/heatmap/packed", params=params)
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        head, matrix = _unpack(r.content)
        assert {k: v for k, v in head.items() if k not in ("rows", "cols", "dtype")} == {
            k: v for k, v in js.items() if k != "values"
        }
        assert matrix.shape == (6, len(js["bucket_start"])) and head["dtype"] == "float64"
        expected = np.array([[np.nan if v is None else v for v in row] for row in js["values"]], dtype=object)
        for got, want in zip(matrix.ravel(), expected.ravel(), strict=True):
            want = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}.get(want, want)
            assert got == want or (np.isnan(got) and np.isnan(want))
    assert 0 in head["bucket_steps"]  # the gap came back as empty buckets (NaN cells)
    assert client.get(f"{API}/runs/{rid}/heatmap/packed", params={"from": 9, "to": 3}).status_code == 422
    assert client.get(f"{API}/runs/987654/heatmap/packed").status_code == 404
    empty = client.post(f"{API}/runs", json=run_body(1)).json()["id"]
    head, matrix = _unpack(client.get(f"{API}/runs/{empty}/heatmap/packed").content)
    assert matrix.shape == (3, 0) and head["bucket_start"] == []


def test_series_multi_matches_single_series(client):
    rid = client.post(f"{API}/runs", json=run_body(1)).json()["id"]
    stats = random_stats(np.random.default_rng(2), 500, 3)
    losses = np.linspace(3.0, 1.0, 500)
    losses[77] = np.nan
    body = batch_body("k", range(500), stats, losses=losses)
    for i, step in enumerate(body["steps"]):
        if i % 2:
            step["scalars"]["grad_norm"] = float(i)
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    for params in ({"max_points": 100}, {"max_points": 2000, "from": 50, "to": 400}):
        multi = client.get(
            f"{API}/runs/{rid}/series/multi", params={**params, "name": ["loss", "lr", "grad_norm", "nope"]}
        ).json()
        for name in ("loss", "lr", "grad_norm", "nope"):
            single = client.get(f"{API}/runs/{rid}/series", params={**params, "name": name}).json()
            assert multi["series"][name] == {
                k: single[k] for k in ("bucket_width", "downsampled", "steps", "values")
            }
            assert (multi["from"], multi["to"]) == (single["from"], single["to"])
    assert "NaN" in multi["series"]["loss"]["values"]
    assert multi["series"]["nope"]["steps"] == []
    assert client.get(f"{API}/runs/{rid}/series/multi").status_code == 422  # no name
    assert (
        client.get(f"{API}/runs/{rid}/series/multi", params={"name": "loss", "from": 9, "to": 2}).status_code
        == 422
    )
    assert client.get(f"{API}/runs/987654/series/multi", params={"name": "loss"}).status_code == 404
