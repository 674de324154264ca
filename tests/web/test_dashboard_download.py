"""The run page's download menu: each table of the run as CSV or Parquet over a step range, the file the
same bytes as GET /runs/{id}/export answers; with a token (which a plain link cannot carry) too; a range
that ends before it starts is refused in the menu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run, wait_drawn
from tests.web.dashboard_data import create_run, post_steps, smooth_stats
from tests.web.test_dashboard_auth import VIEWER, auth_server, enter_token, make_run  # noqa: F401

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each


def fetch_download(page, table: int, fmt: str, first: str = "", last: str = "") -> tuple[str, bytes]:
    """Pick the menu's options, press Download; the saved file's name and bytes."""
    if not page.is_visible("#download-go"):
        page.click("#run-download summary")
    page.select_option("#download-table", str(table))
    page.select_option("#download-format", fmt)
    page.fill("#download-from", first)
    page.fill("#download-to", last)
    with page.expect_download() as got:
        page.click("#download-go")
    d = got.value
    with open(d.path(), "rb") as f:
        return d.suggested_filename, f.read()


def test_each_table_downloads_as_the_api_exports_it(server, page):
    run = create_run(server.url, "download-run", 2)
    rid = run["id"]
    post_steps(server.url, rid, "a", 0, smooth_stats(40, 6), losses=np.linspace(3.0, 2.0, 40))
    open_run(page, server.url, rid)

    name, body = fetch_download(page, 0, "csv", "10", "19")
    assert name == f"run-{rid}-stats.csv"
    query = {"table": "stats", "format": "csv", "layout": "long", "from": 10, "to": 19}
    assert body == loopback.get(f"{server.url}{API}/runs/{rid}/export", params=query).content
    assert len(body.decode().strip().splitlines()) == 1 + 10 * 6  # a header, then 10 steps x 6 tensors

    name, body = fetch_download(page, 1, "parquet")
    assert name == f"run-{rid}-stats.parquet" and body[:4] == b"PAR1"
    query = {"table": "stats", "format": "parquet", "layout": "wide"}
    assert body == loopback.get(f"{server.url}{API}/runs/{rid}/export", params=query).content

    name, body = fetch_download(page, 2, "csv")
    assert name == f"run-{rid}-scalars.csv"
    assert body == loopback.get(f"{server.url}{API}/runs/{rid}/export", params={"table": "scalars"}).content
    # a range that ends before it starts is said in the menu; nothing is requested
    requests = []
    page.on("request", lambda r: requests.append(r.url) if "/export" in r.url else None)
    page.fill("#download-from", "20")
    page.fill("#download-to", "5")
    page.click("#download-go")
    page.wait_for_selector("#download-error:not(:empty)")
    assert page.text_content("#download-error") == "The last step (5) comes before the first (20)."
    assert requests == []
    no_page_errors(page)


def test_with_a_token(auth_server, page):  # noqa: F811
    rid = make_run(auth_server.url)
    page.goto(f"{auth_server.url}/#/runs/{rid}")
    enter_token(page, VIEWER)
    wait_drawn(page, "heatmap", "curves")
    name, body = fetch_download(page, 0, "csv", "0", "9")
    assert name == f"run-{rid}-stats.csv"
    headers = {"Authorization": f"Bearer {VIEWER}"}
    query = {"table": "stats", "format": "csv", "layout": "long", "from": 0, "to": 9}
    expected = loopback.get(f"{auth_server.url}{API}/runs/{rid}/export", params=query, headers=headers)
    assert expected.status_code == 200 and body == expected.content
    assert len(body.decode().strip().splitlines()) == 1 + 10 * 6
    # the page's first requests were refused (401) until the token was entered: no error check here
