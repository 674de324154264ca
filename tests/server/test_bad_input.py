"""Bad input: a 4xx naming the problem and nothing partially written."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.server import API, batch_body, create_run, random_stats


def _stored(client, run_id: int) -> int:
    return client.get(f"{API}/runs/{run_id}").json()["steps_stored"]


@pytest.fixture
def run_and_stats(client):
    run = create_run(client, n_layers=1)  # T = 3
    return run, random_stats(np.random.default_rng(0), 4, 3)


def _post(client, run_id, body=None, content=None, headers=None):
    if content is not None:
        return client.post(f"{API}/runs/{run_id}/telemetry", content=content, headers=headers or {})
    return client.post(f"{API}/runs/{run_id}/telemetry", json=body, headers=headers or {})


def test_malformed_json(client, run_and_stats):
    run, _ = run_and_stats
    r = _post(
        client,
        run["id"],
        content=b'{"idempotency_key": "x", "steps": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["detail"]
    assert _stored(client, run["id"]) == 0


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (
            lambda b: b["steps"][2]["stats"].__setitem__("amax", [1.0, 2.0]),
            "steps[2].stats.amax: column has 2 values, expected 3",
        ),
        (lambda b: b["steps"][1]["stats"].__setitem__("bogus", [1, 2, 3]), "unknown statistic(s) ['bogus']"),
        (lambda b: b["steps"][1]["stats"].pop("numel"), "missing statistic(s) ['numel']"),
        (lambda b: b["steps"][3].__setitem__("step", "7"), "steps[3].step: expected an integer"),
        (lambda b: b["steps"][3].__setitem__("step", -1), "steps[3].step: must be >= 0"),
        (lambda b: b["steps"][0]["stats"]["scale"].__setitem__(1, "big"), "steps[0].stats.scale[1]"),
        (lambda b: b["steps"][0]["stats"]["scale"].__setitem__(1, True), "steps[0].stats.scale[1]"),
        (lambda b: b["steps"][0]["scalars"].__setitem__("loss", "nan"), "steps[0].scalars.loss"),
        (
            lambda b: b["steps"][1].__setitem__("step", b["steps"][0]["step"]),
            "same step number appears twice",
        ),
        (lambda b: b.pop("idempotency_key"), "idempotency_key"),
        (lambda b: b.__setitem__("steps", {}), "steps: expected an array"),
        (lambda b: b.__setitem__("extra", 1), "unknown field(s) ['extra']"),
        (lambda b: b["steps"][0]["stats"].__setitem__("amax", {"dtype": "int8", "b64": ""}), "dtype must be"),
        (
            lambda b: b["steps"][0]["stats"].__setitem__("amax", {"dtype": "float64", "b64": "AAAA"}),
            "packed column holds",
        ),
        (
            lambda b: b["steps"][0]["stats"].__setitem__("amax", {"dtype": "float64", "b64": "!!"}),
            "invalid base64",
        ),
        (lambda b: b.__setitem__("events", [{"kind": "boom", "step": 1}]), "events[0].kind"),
        (lambda b: b.__setitem__("acks", [{"command_id": 1, "state": "done"}]), "acks[0].state"),
    ],
)
def test_invalid_batches_are_rejected_whole(client, run_and_stats, mutate, needle):
    run, stats = run_and_stats
    body = batch_body("bad", range(4), stats, losses=[1, 2, 3, 4])
    mutate(body)
    r = _post(client, run["id"], body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"]
    assert _stored(client, run["id"]) == 0
    # the key was not consumed: the corrected batch is stored
    ok = _post(client, run["id"], batch_body("bad", range(4), stats))
    assert ok.json()["stored_steps"] == 4


def test_wrong_tensor_count_packed(client, run_and_stats):
    run, _ = run_and_stats
    stats = random_stats(np.random.default_rng(1), 2, 5)  # T = 5 for a run with 3 tensors
    r = _post(client, run["id"], batch_body("k", [0, 1], stats, "float32"))
    assert r.status_code == 422 and "expected 3 (one per tensor)" in r.json()["detail"]


def test_unknown_run_and_unknown_command_ack(client, run_and_stats):
    run, stats = run_and_stats
    r = _post(client, 424242, batch_body("k", range(4), stats))
    assert r.status_code == 404 and "run 424242" in r.json()["detail"]
    body = batch_body("k", range(4), stats, acks=[{"command_id": 999, "state": "applied", "step": 3}])
    r = _post(client, run["id"], body)
    assert r.status_code == 422 and "command 999" in r.json()["detail"]
    assert _stored(client, run["id"]) == 0  # the steps of that batch were rolled back too


def test_oversized_body_413(make_client):
    client = make_client(max_body_bytes=2000)
    run = create_run(client, n_layers=1)
    stats = random_stats(np.random.default_rng(0), 50, 3)
    r = _post(client, run["id"], batch_body("big", range(50), stats))
    assert r.status_code == 413 and "exceeds the limit of 2000 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the streamed size is checked
        for _ in range(10):
            yield b" " * 500

    json_type = {"Content-Type": "application/json"}
    r = client.post(f"{API}/runs/{run['id']}/telemetry", content=chunks(), headers=json_type)
    assert r.status_code == 413
    assert _stored(client, run["id"]) == 0


def test_bad_run_bodies(client):
    base = {
        "name": "x",
        "tensors": [{"index": 0, "name": "a.input", "layer": "a", "role": "input", "format": "e4m3"}],
    }
    assert client.post(f"{API}/runs", json=base).status_code == 201
    gap = {**base, "tensors": [{**base["tensors"][0], "index": 1}]}
    r = client.post(f"{API}/runs", json=gap)
    assert r.status_code == 422 and "dense" in r.text
    bad_role = {**base, "tensors": [{**base["tensors"][0], "role": "output"}]}
    assert client.post(f"{API}/runs", json=bad_role).status_code == 422
    bad_format = {**base, "tensors": [{**base["tensors"][0], "format": "e3m4"}]}
    assert client.post(f"{API}/runs", json=bad_format).status_code == 422
    r = client.post(f"{API}/runs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert client.post(f"{API}/runs", json={**base, "world_size": "2"}).status_code == 422
