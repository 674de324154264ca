"""The runs list as experiment trackers have it: a click on a column's header sorts the list (by the service;
again: the other way round), the address keeps the sort; created and duration columns; runs grouped by a
config value drawn as each group's mean loss with its min–max band; notes written on the run page, shown in
the list."""

from __future__ import annotations

import re
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from monitor_server.storage.models import Run, utcnow
from tests.support.http import loopback
from tests.support.server import API, ServerProcess, make_tensors
from tests.web.browser import no_page_errors, open_run, wait_stream
from tests.web.dashboard_data import create_run, post_steps, smooth_stats
from tests.web.test_dashboard_auth import enter_token
from tests.web.test_dashboard_runs import names_shown, wait_names

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each


def _ran_for(server, seconds: dict[int, float]) -> None:
    """Move each run's registration back, its last telemetry `seconds` after it: durations without waiting
    (written in the server's own database, as its ingest would)."""
    engine = create_engine(server.db_url)
    try:
        with Session(engine) as session, session.begin():
            now = utcnow()
            for run_id, s in seconds.items():
                run = session.get(Run, run_id)
                run.created_at = now - timedelta(seconds=s + 60)
                run.last_telemetry_at = run.created_at + timedelta(seconds=s)
    finally:
        engine.dispose()


def _sort_by(page, key: str) -> None:
    page.click(f"#runs-table th[data-sort='{key}']")


def test_a_header_click_sorts_the_list_by_the_service_and_a_link_keeps_it(server, page):
    tag = "sorting"
    spec = [("s-bravo", 2.0, 7200), ("s-alpha", 3.0, 90), ("s-charlie", 1.0, 5)]  # name, loss, seconds run
    ids = {}
    for name, loss, _ in spec:
        ids[name] = create_run(server.url, name, 1, tags=[tag])["id"]
        post_steps(server.url, ids[name], f"k-{name}", 0, smooth_stats(3, 3), losses=np.full(3, loss))
    _ran_for(server, {ids[name]: s for name, _, s in spec})
    page.goto(f"{server.url}/#/?tag={tag}")
    wait_names(page, ["s-charlie", "s-alpha", "s-bravo"])  # newest first
    wait_stream(page, "/stream")
    _sort_by(page, "name")
    wait_names(page, ["s-alpha", "s-bravo", "s-charlie"])
    assert "sort=name" in page.evaluate("location.hash")
    _sort_by(page, "name")  # again: descending
    wait_names(page, ["s-charlie", "s-bravo", "s-alpha"])
    assert page.get_attribute("th[data-sort='name']", "aria-sort") == "descending"
    _sort_by(page, "last_loss")
    wait_names(page, ["s-charlie", "s-bravo", "s-alpha"])  # 1.0, 2.0, 3.0
    _sort_by(page, "duration")
    wait_names(page, ["s-charlie", "s-alpha", "s-bravo"])  # 5 s, 90 s, 2 h

    # the created and duration columns
    durations = {n: page.text_content(f"tr[data-run-id='{ids[n]}'] td.duration") for n in ids}
    assert durations == {"s-bravo": "2 h 00 min", "s-alpha": "1 min 30 s", "s-charlie": "5 s"}
    for name, rid in ids.items():
        created = page.locator(f"tr[data-run-id='{rid}'] td.created")
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", created.text_content()), name
        stored = loopback.get(f"{server.url}{API}/runs/{rid}").json()["created_at"]
        assert created.get_attribute("title") == stored
    heads = page.eval_on_selector_all("#runs-table thead th", "ths => ths.map(th => th.textContent)")
    assert heads[4:7] == ["Created", "Duration ▲", "Last step"]

    # the address reproduces the list: filters and sort
    _sort_by(page, "duration")
    wait_names(page, ["s-bravo", "s-alpha", "s-charlie"])
    page.reload()
    wait_names(page, ["s-bravo", "s-alpha", "s-charlie"])
    assert page.get_attribute("th[data-sort='duration']", "aria-sort") == "descending"
    assert page.input_value("#runs-tag") == tag
    no_page_errors(page)


def test_group_by_draws_one_mean_and_band_per_group(server, page):
    tag = "grouping"
    spec = [
        ("g-a0", 0.001, 2.0),
        ("g-a1", 0.001, 3.0),
        ("g-b0", 0.01, 5.0),
        ("g-b1", 0.01, 6.0),
        ("g-b2", 0.01, 7.0),
    ]
    for seed, (name, lr, loss) in enumerate(spec):
        rid = create_run(server.url, name, 1, tags=[tag], config={"lr": lr, "seed": seed})["id"]
        post_steps(server.url, rid, f"k-{name}", 0, smooth_stats(10, 3), losses=np.full(10, loss))
    page.goto(f"{server.url}/#/?tag={tag}")
    wait_names(page, ["g-b2", "g-b1", "g-b0", "g-a1", "g-a0"])
    assert page.is_hidden("#groups")
    page.fill("#runs-group", "lr")
    page.wait_for_function("() => (document.getElementById('groups-plot').data || []).length === 4")
    traces = page.evaluate(
        "document.getElementById('groups-plot').data.map(t => [t.name, t.meta.kind, t.fill || null, t.y])"
    )
    # per group (in the list's order: the newest run's first) its band, then its mean
    (band_b, _, fill_b, y_band_b), (mean_b, kind_b, _, y_mean_b) = traces[0], traces[1]
    (_, _, fill_a, y_band_a), (mean_a, kind_a, _, y_mean_a) = traces[2], traces[3]
    assert (kind_b, kind_a, fill_b, fill_a) == ("mean", "mean", "toself", "toself")
    assert mean_b == "lr=0.01: mean of 3 runs (band: min–max)"
    assert mean_a == "lr=0.001: mean of 2 runs (band: min–max)"
    assert band_b == "lr=0.01: min–max"
    assert y_mean_b == [6.0] * 10 and y_mean_a == [2.5] * 10
    assert y_band_b == [7.0] * 10 + [5.0] * 10 and y_band_a == [3.0] * 10 + [2.0] * 10
    rows = page.eval_on_selector_all(
        "#groups-table tr", "trs => trs.map(tr => [...tr.cells].slice(1, 3).map(c => c.textContent))"
    )
    assert rows == [["lr=0.01", "3 runs"], ["lr=0.001", "2 runs"]]
    assert "group=lr" in page.evaluate("location.hash")
    # a key no run has: one group of all of them
    page.fill("#runs-group", "model.width")
    page.wait_for_function("() => (document.getElementById('groups-plot').data || []).length === 2")
    assert page.evaluate("document.getElementById('groups-plot').data[1].name") == (
        "model.width not set: mean of 5 runs (band: min–max)"
    )
    page.fill("#runs-group", "")
    page.wait_for_selector("#groups", state="hidden")
    no_page_errors(page)


def test_notes_written_on_the_run_page_show_in_the_runs_list(server, page):
    tag = "with-notes"
    run = create_run(server.url, "noted-run", 1, tags=[tag])
    rid = run["id"]
    post_steps(server.url, rid, "k-notes", 0, smooth_stats(5, 3))
    notes = (
        "Diverged after the warm-up: <b>margin 0</b> is too tight for the attention output.\n"
        "Rerun with margin 1 and amax_history_len 32."
    )
    open_run(page, server.url, rid)
    assert page.text_content("#run-notes-text") == "No notes."
    page.click("#run-notes-edit")
    page.fill("#run-notes-input", notes[:40])
    # the header redraws (here: a rename from elsewhere); what is being typed stays, with the focus
    assert loopback.patch(f"{server.url}{API}/runs/{rid}", json={"name": "noted-run-2"}).status_code == 200
    page.wait_for_function("() => document.getElementById('run-name').textContent === 'noted-run-2'")
    assert page.input_value("#run-notes-input") == notes[:40]
    assert page.evaluate("document.activeElement.id") == "run-notes-input"
    page.fill("#run-notes-input", notes)
    page.click("#run-notes-save")
    page.wait_for_selector("#run-notes-input", state="hidden")
    assert page.text_content("#run-notes-text") == notes  # as typed: text, never markup
    assert loopback.get(f"{server.url}{API}/runs/{rid}").json()["notes"] == notes

    page.goto(f"{server.url}/#/?tag={tag}")
    page.reload()
    wait_names(page, ["noted-run-2"])
    short = page.locator(f"tr[data-run-id='{rid}'] .run-notes-short")
    one_line = " ".join(notes.split())
    assert short.text_content() == one_line[:79] + "…"
    assert short.get_attribute("title") == notes
    assert names_shown(page) == ["noted-run-2"]  # the notes are not a link
    no_page_errors(page)


def test_notes_are_read_only_without_the_control_scope(page, tmp_path):
    tokens = "job:ingest:job-secret,viewer:read:view-secret"
    with ServerProcess(f"sqlite:///{tmp_path / 'ro.db'}", env={"FP8SCOPE_TOKENS": tokens}) as srv:
        job = {"Authorization": "Bearer job-secret"}
        body = {"name": "ro-run", "tensors": make_tensors(1)}
        rid = loopback.post(f"{srv.url}{API}/runs", json=body, headers=job).json()["id"]
        assert (
            loopback.patch(f"{srv.url}{API}/runs/{rid}", json={"notes": "kept"}, headers=job).status_code
            == 200
        )
        page.goto(f"{srv.url}/#/runs/{rid}")
        enter_token(page, "view-secret")
        page.wait_for_function("() => document.getElementById('run-notes-text')?.textContent === 'kept'")
        page.wait_for_function("() => document.getElementById('run-notes-edit').disabled")
        assert "lacks the control scope" in page.get_attribute("#run-notes-edit", "title")
