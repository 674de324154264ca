"""Replay requests (the incident page's Replay button, the replay worker's queue): asked for one of the
incident's bundles, one open per incident, claimed by one worker only, ended done or failed, the control
scope, the live stream. Real app, both database backends."""

from __future__ import annotations

from tests.server.test_incident_replay import incident_with_bundles
from tests.support.server import API, create_run

TOKENS = ["ops:read+control:ops-secret-1", "dash:read:dash-secret-1", "trainer:ingest+read:trainer-secret-1"]
OPS = {"Authorization": "Bearer ops-secret-1"}
TRAINER = {"Authorization": "Bearer trainer-secret-1"}


def test_a_request_is_made_claimed_once_and_finished(client):
    rid, iid = incident_with_bundles(client, bundle_steps=(2, 4))
    url = f"{API}/runs/{rid}/incidents/{iid}/replay-requests"
    r = client.post(url, json={})
    assert r.status_code == 201, r.text
    made = r.json()
    # the newest of the incident's bundles, pending, the caller its author
    assert (made["bundle"], made["state"], made["requested_by"]) == ("b/step4.pt", "pending", "anonymous")
    assert (made["run_id"], made["incident_id"], made["claimed_by"]) == (rid, iid, None)
    # asked again while open: the same request
    again = client.post(url, json={"bundle": "b/step2.pt"})
    assert again.status_code == 200 and again.json()["id"] == made["id"]

    pending = client.get(f"{API}/replay-requests", params={"state": "pending"}).json()
    assert [p["id"] for p in pending] == [made["id"]]
    claimed = client.post(f"{API}/replay-requests/{made['id']}/claim")
    assert claimed.status_code == 200 and claimed.json()["state"] == "running"
    # a second worker does not get it
    second = client.post(f"{API}/replay-requests/{made['id']}/claim")
    assert second.status_code == 409 and "running, not pending" in second.json()["detail"]
    assert client.get(f"{API}/replay-requests", params={"state": "pending"}).json() == []

    finish = f"{API}/replay-requests/{made['id']}/finish"
    done = client.post(finish, json={"state": "failed", "detail": "gone"})
    assert done.status_code == 200 and (done.json()["state"], done.json()["detail"]) == ("failed", "gone")
    assert client.post(finish, json={"state": "done"}).status_code == 409
    # closed: the incident may be asked again, for another of its bundles
    r = client.post(url, json={"bundle": "b/step2.pt"})
    assert r.status_code == 201 and r.json()["bundle"] == "b/step2.pt" and r.json()["id"] > made["id"]
    listed = client.get(f"{API}/runs/{rid}/replay-requests").json()
    assert [(x["id"], x["state"]) for x in listed] == [(made["id"], "failed"), (r.json()["id"], "pending")]


def test_bad_requests_are_refused_naming_why(client):
    rid, iid = incident_with_bundles(client, bundle_steps=(4,))
    url = f"{API}/runs/{rid}/incidents/{iid}/replay-requests"
    r = client.post(url, json={"bundle": "elsewhere.pt"})
    assert r.status_code == 422 and "not one of incident" in r.json()["detail"]
    assert client.post(url, json={"bundle": "b/step4.pt", "extra": 1}).status_code == 422
    assert client.post(f"{API}/runs/{rid}/incidents/999/replay-requests", json={}).status_code == 404
    assert client.post(f"{API}/replay-requests/999/claim").status_code == 404
    bad_state = client.post(f"{API}/replay-requests/1/finish", json={"state": "maybe"})
    assert bad_state.status_code == 422
    assert client.get(f"{API}/replay-requests", params={"state": "lost"}).status_code == 422
    # an incident whose job captured nothing
    bare = incident_with_bundles(client, bundle_steps=())
    r = client.post(f"{API}/runs/{bare[0]}/incidents/{bare[1]}/replay-requests", json={})
    assert r.status_code == 409 and "lists no bundle" in r.json()["detail"]
    assert client.get(f"{API}/runs/{rid}/replay-requests").json() == []


def test_requests_take_the_control_scope(make_client):
    client = make_client(tokens=TOKENS)
    rid, iid = incident_with_bundles(_authed(client))
    url = f"{API}/runs/{rid}/incidents/{iid}/replay-requests"
    dash = {"Authorization": "Bearer dash-secret-1"}
    assert client.post(url, json={}, headers=dash).status_code == 403
    assert client.post(url, json={}, headers=TRAINER).status_code == 403
    made = client.post(url, json={}, headers=OPS).json()
    assert made["requested_by"] == "ops"
    assert client.get(f"{API}/runs/{rid}/replay-requests", headers=dash).status_code == 200
    assert client.get(f"{API}/replay-requests", headers=dash).status_code == 403
    assert client.post(f"{API}/replay-requests/{made['id']}/claim", headers=dash).status_code == 403
    claimed = client.post(f"{API}/replay-requests/{made['id']}/claim", headers=OPS).json()
    assert claimed["claimed_by"] == "ops"


class _authed:
    """`client` with the job's token on every request (the helpers take a plain client)."""

    def __init__(self, client):
        self.client = client

    def post(self, url, headers=None, **kw):
        return self.client.post(url, headers={**(headers or {}), **TRAINER}, **kw)

    def get(self, url, headers=None, **kw):
        return self.client.get(url, headers={**(headers or {}), **TRAINER}, **kw)


def test_a_run_without_incidents_lists_no_requests(client):
    rid = create_run(client)["id"]
    assert client.get(f"{API}/runs/{rid}/replay-requests").json() == []
    assert client.get(f"{API}/runs/99999/replay-requests").status_code == 404


def test_the_worker_fails_a_request_whose_bundle_it_does_not_have(tmp_path):
    """`fp8-monitor replay-worker --once` against a real service: the request's bundle is not on the
    worker's machine, so it is failed at once, saying so, and the worker exits having run it."""
    import httpx

    from monitor_server import cli
    from tests.support.server import running_server

    with (
        running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server,
        httpx.Client(base_url=server.url) as client,
    ):
        rid, iid = incident_with_bundles(client, bundle_steps=(4,))
        made = client.post(f"{API}/runs/{rid}/incidents/{iid}/replay-requests", json={}).json()
        assert cli.main(["replay-worker", "--url", server.url, "--once"]) == 0
        (ended,) = client.get(f"{API}/runs/{rid}/replay-requests").json()
        assert ended["id"] == made["id"] and ended["state"] == "failed"
        assert ended["detail"] == "bundle not found on the replay worker's machine: b/step4.pt"
        assert ended["claimed_by"] == "anonymous"
    # nothing listening: a clear error, exit code 2
    assert cli.main(["replay-worker", "--url", server.url, "--once"]) == 2
