"""The runs list sorted by any column it shows (by the server, with keyset paging that visits every run once),
and a run's notes: written with PATCH, returned with the run and in the list, bounded, and only by a caller
allowed to rename the run."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from monitor_server.storage.models import Incident, Run, utcnow
from monitor_server.storage.run_sort import SORTS
from tests.support.server import API, create_run

NO_LOSS = math.inf
#: name, status, created (minutes after a base), seconds to the last telemetry (None: none yet), last step,
#: last loss (as the wire spells it), open incidents (and one closed for each run, which must not count)
RUNS = [
    ("delta", "running", 5, 10, 100, 2.5, 0),
    ("Alpha", "finished", 1, None, None, None, 2),
    ("charlie", "crashed", 3, 300, 50, "NaN", 1),
    ("bravo", "finished", 3, 60, 7, 1.0, 0),
    ("echo", "running", 0, 10, 100, 0.5, 0),
    ("alpha", "halted", 2, 5, 3, "Infinity", 1),
]


def _key(sort: str, run: tuple, created, seen) -> object:
    """What the list is documented to order by."""
    name, status, _, after, step, loss, incidents = run
    return {
        "name": name.lower(),
        "status": status,
        "created": created,
        "duration": 0 if after is None else after,
        "last_step": -1 if step is None else step,
        "last_loss": loss if isinstance(loss, float) else NO_LOSS,
        "open_incidents": incidents,
        "last_telemetry": seen,
    }[sort]


@pytest.fixture
def population(client):
    """The runs of `RUNS`, their columns set in the database; returns {sort: [names, ascending]}."""
    base = utcnow() - timedelta(hours=2)
    ids = [create_run(client, name=run[0])["id"] for run in RUNS]
    keyed = {sort: [] for sort in SORTS}
    with client.app.state.ctx.db.write() as session:
        for rid, run in zip(ids, RUNS, strict=True):
            name, status, minutes, after, step, loss, incidents = run
            row = session.get(Run, rid)
            row.status, row.last_step, row.last_loss = status, step, loss
            row.created_at = base + timedelta(minutes=minutes)
            row.last_telemetry_at = None if after is None else row.created_at + timedelta(seconds=after)
            for k in range(incidents + 1):
                state = "open" if k < incidents else "acknowledged"
                session.add(Incident(run_id=rid, state=state, severity="warning", first_step=1, last_step=1,
                                     alert_count=1, created_at=base, updated_at=base))  # fmt: skip
            seen = row.last_telemetry_at or row.created_at
            for sort in SORTS:
                keyed[sort].append((_key(sort, run, row.created_at, seen), rid, name))
    return {sort: [name for _, _, name in sorted(rows)] for sort, rows in keyed.items()}


def _pages(client, limit: int, **params) -> tuple[list[str], int]:
    """Every page of the list: (the names in order, the number of pages)."""
    names, cursor, pages = [], None, 0
    while True:
        r = client.get(
            f"{API}/runs", params={**params, "limit": limit, **({"cursor": cursor} if cursor else {})}
        )
        assert r.status_code == 200, r.text
        names += [run["name"] for run in r.json()]
        pages += 1
        cursor = r.headers.get("X-Next-Cursor")
        if cursor is None:
            return names, pages


@pytest.mark.parametrize("sort", SORTS)
def test_each_column_sorts_both_ways_and_pages_visit_every_run_once(client, population, sort):
    ascending = population[sort]
    for text, want in ((sort, ascending), (f"-{sort}", _descending(population, sort))):
        assert _pages(client, 100, sort=text) == (want, 1), text
        assert _pages(client, 2, sort=text) == (want, 3), text  # keyset pages: each run once, in order
        # with a config filter (scanned in the service in the list's order)
        assert _pages(client, 1, sort=text, config="lr=0.0003")[0] == want, text


def _descending(population, sort: str) -> list[str]:
    """The descending order: the ascending one reversed, ties (same value) by id descending too."""
    return list(reversed(population[sort]))


def test_the_default_order_is_newest_first_and_before_still_pages_it(client):
    ids = [create_run(client, name=f"r{i}")["id"] for i in range(5)]
    r = client.get(f"{API}/runs", params={"limit": 2})
    assert [run["id"] for run in r.json()] == ids[:-3:-1] and r.headers["X-Next-Cursor"] == str(ids[3])
    by_before = client.get(f"{API}/runs", params={"limit": 2, "before": ids[3]}).json()
    by_cursor = client.get(f"{API}/runs", params={"limit": 2, "cursor": str(ids[3])}).json()
    assert [run["id"] for run in by_before] == [run["id"] for run in by_cursor] == [ids[2], ids[1]]


def test_a_config_value_sorts_numbers_then_strings_then_runs_without_it(client):
    for name, config in [
        ("a", {"lr": 0.001}),
        ("b", {"lr": 0.0003}),
        ("c", {}),
        ("d", {"lr": "warmup"}),
        ("e", {"lr": 0.001}),
        ("f", {"opt": {"lr": 0.1}}),
    ]:
        create_run(client, name=name, config=config)
    assert _pages(client, 100, sort="config:lr")[0] == ["b", "a", "e", "d", "c", "f"]
    assert _pages(client, 2, sort="config:lr") == (["b", "a", "e", "d", "c", "f"], 3)
    # descending: the values the other way round, the runs without the key still last
    assert _pages(client, 4, sort="-config:lr") == (["d", "e", "a", "b", "f", "c"], 2)
    assert _pages(client, 1, sort="-config:opt.lr")[0] == ["f", "e", "d", "c", "b", "a"]
    assert _pages(client, 1, sort="config:lr", q="a")[0] == ["a"]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"sort": "loss"}, "sort: expected name, status, created, duration, last_step, last_loss"),
        ({"sort": "-"}, "config:KEY"),
        ({"sort": "config:"}, "with a leading - for descending"),
        ({"sort": "name", "before": 5}, "before: only for the newest-first list"),
        ({"sort": "name", "cursor": "nonsense"}, "cursor: not a cursor of the runs list sorted by 'name'"),
        ({"cursor": "abc"}, "cursor: not a cursor of the runs list newest first"),
    ],
)
def test_an_unknown_sort_or_a_foreign_cursor_is_422_saying_what_is_allowed(client, params, needle):
    r = client.get(f"{API}/runs", params=params)
    assert r.status_code == 422 and needle in r.json()["detail"], r.text


def test_a_cursor_of_one_sort_is_refused_by_another(client):
    for i in range(3):
        create_run(client, name=f"r{i}")
    cursor = client.get(f"{API}/runs", params={"sort": "name", "limit": 1}).headers["X-Next-Cursor"]
    assert client.get(f"{API}/runs", params={"sort": "name", "cursor": cursor}).status_code == 200
    r = client.get(f"{API}/runs", params={"sort": "-name", "cursor": cursor})
    assert r.status_code == 422 and "sorted by '-name'" in r.text


def test_notes_round_trip_through_the_run_and_the_list(client):
    run = create_run(client, name="noted")
    assert run["notes"] == ""
    text = "lr too high?\nsee <b>step 1200</b> — rerun with margin 1 ✓"
    r = client.patch(f"{API}/runs/{run['id']}", json={"notes": text})
    assert r.status_code == 200 and r.json()["notes"] == text, r.text
    assert client.get(f"{API}/runs/{run['id']}").json()["notes"] == text
    assert client.get(f"{API}/runs").json()[0]["notes"] == text
    longest = "x" * 10_000
    assert client.patch(f"{API}/runs/{run['id']}", json={"notes": longest}).json()["notes"] == longest
    r = client.patch(f"{API}/runs/{run['id']}", json={"notes": longest + "y"})
    assert r.status_code == 422 and '"loc":["body","notes"]' in r.text and "10000" in r.text
    assert client.get(f"{API}/runs/{run['id']}").json()["notes"] == longest  # unchanged
    cleared = client.patch(f"{API}/runs/{run['id']}", json={"notes": ""}).json()
    assert cleared["notes"] == "" and cleared["name"] == "noted"


AUTH = {
    "tokens": [
        "job:ingest:ingest-secret",
        "other-job:ingest:other-secret",
        "dash:read:read-secret",
        "ops:read+control:control-secret",
    ]
}


def test_notes_are_written_by_whoever_may_rename_the_run(make_client):
    client = make_client(**AUTH)
    rid = create_run(client, headers={"Authorization": "Bearer ingest-secret"})["id"]
    url, body = f"{API}/runs/{rid}", {"notes": "mine"}
    assert client.patch(url, json=body).status_code == 401
    for secret, code in [("read-secret", 403), ("other-secret", 403), ("control-secret", 200)]:
        r = client.patch(url, json=body, headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == code, (secret, r.text)
    # the job that registered the run, as for its name and tags
    r = client.patch(url, json={"notes": "by the job"}, headers={"Authorization": "Bearer ingest-secret"})
    assert r.status_code == 200
    got = client.get(url, headers={"Authorization": "Bearer read-secret"}).json()
    assert got["notes"] == "by the job"
