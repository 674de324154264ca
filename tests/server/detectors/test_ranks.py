"""Rank divergence: per-rank amaxes sampled by a data-parallel job name the one rank that disagrees."""

from __future__ import annotations

import typing

import numpy as np
import pytest

from fp8_protocol.client_events import EVENT_KINDS, parse_rank_amax
from monitor_server.core.detector_config import DetectorConfig
from monitor_server.detectors.ranks import rank_divergence
from monitor_server.storage.schemas import EventKind
from tests.server.detectors.runs import make_tensors
from tests.support.server import API, batch_body, create_run, random_stats


def _amax(world: int, n: int, seed: int = 0) -> np.ndarray:
    # ranks agree to within a factor of 1.3 (log2 spread < 0.4)
    base = np.random.default_rng(seed).uniform(0.5, 8.0, size=n)
    return base[None, :] * np.random.default_rng(seed + 1).uniform(0.85, 1.1, size=(world, n))


def test_agreeing_ranks_raise_nothing():
    tensors = make_tensors(2)
    assert rank_divergence(_amax(4, len(tensors)), tensors, 100, 2.0) == []


def test_one_rank_far_above_is_named_with_severity():
    tensors = make_tensors(2)
    amax = _amax(4, len(tensors))
    amax[2, 1] *= 6.0  # log2 6 ~ 2.6 > 2: warning
    amax[3, 4] *= 40.0  # log2 40 ~ 5.3 > 4: critical
    found = rank_divergence(amax, tensors, 100, 2.0)
    assert [(f.kind, f.tensor_index, f.step, f.severity, f.evidence["rank"]) for f in found] == [
        ("rank_divergence", 1, 100, "warning", 2),
        ("rank_divergence", 4, 100, "critical", 3),
    ]
    assert "rank 3" in found[1].message and tensors[4].name in found[1].message


def test_nonfinite_on_one_rank_is_critical_and_all_zero_or_skipped_tensors_are_ignored():
    tensors = make_tensors(1)
    amax = _amax(2, len(tensors))
    amax[1, 0] = np.nan
    amax[:, 1] = 0.0  # nothing quantized on any rank
    amax[0, 2] *= 100.0
    skip = np.array([False, False, True])
    found = rank_divergence(amax, tensors, 7, 2.0, skip)
    assert [(f.tensor_index, f.severity, f.evidence["rank"]) for f in found] == [(0, "critical", 1)]
    assert found[0].evidence["amax_per_rank"][1] == "NaN"


def test_parse_rank_amax_rejects_malformed_details():
    assert parse_rank_amax({"world_size": 2, "amax": [[1, "Infinity"], [2, 3]]}, 2)[0, 1] == np.inf
    for details, words in [
        ({"amax": [[1, 2]]}, "at least two"),
        ({"world_size": 3, "amax": [[1, 2], [1, 2]]}, "world_size 3"),
        ({"amax": [[1, 2], [1]]}, "row 1"),
        ({"amax": [[1, 2], [1, "big"]]}, "not a number"),
        ({"amax": [[1, 2], [1, None]]}, "not a number"),
        ({"amax": [[1, True], [1, 2]]}, "row 0 holds a value that is not a number"),
        ({"world_size": 2.0, "amax": [[1, 2], [1, 2]]}, "world_size 2.0"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_rank_amax(details, 2)


def test_event_kinds_agree_between_schema_and_detectors():
    assert set(typing.get_args(EventKind)) == set(EVENT_KINDS)


def test_rank_amax_event_opens_an_alert_on_the_tensor(client):
    run = create_run(client, n_layers=2)
    rid, n = run["id"], run["num_tensors"]
    amax = _amax(2, n)
    amax[1, 3] *= 256.0  # 8 binades: beyond twice the default threshold of 3
    events = [{"kind": "rank_amax", "step": 5, "details": {"world_size": 2, "amax": amax.tolist()}}]
    body = batch_body("r-1", [5], random_stats(np.random.default_rng(0), 1, n), events=events)
    r = client.post(f"{API}/runs/{rid}/telemetry", json=body)
    assert r.status_code == 200, r.text
    alerts = client.get(f"{API}/runs/{rid}/alerts", params={"kind": "rank_divergence"}).json()
    assert [(a["tensor_index"], a["first_step"], a["severity"]) for a in alerts] == [(3, 5, "critical")]
    assert alerts[0]["evidence"]["rank"] == 1 and "rank 1" in alerts[0]["message"]


def test_malformed_rank_amax_event_is_a_422_that_stores_nothing(client):
    run = create_run(client, n_layers=2)
    rid, n = run["id"], run["num_tensors"]
    events = [{"kind": "rank_amax", "step": 5, "details": {"amax": [[1.0] * n, [1.0] * (n - 1)]}}]
    body = batch_body("r-bad", [5], random_stats(np.random.default_rng(0), 1, n), events=events)
    r = client.post(f"{API}/runs/{rid}/telemetry", json=body)
    assert r.status_code == 422 and "events[0].details" in r.text and "row 1" in r.text
    assert client.get(f"{API}/runs/{rid}").json()["steps_stored"] == 0


def test_healthy_ranks_on_different_data_raise_nothing_by_default():
    """Two healthy ranks: a grad_output amax 4x apart (measured on a healthy two-rank run) is no divergence
    at the default threshold; 8x and more is."""
    tensors = make_tensors(1)
    default = DetectorConfig().rank_divergence_log2
    amax = np.array([[1.0, 0.5, 2.2e-4], [1.1, 0.5, 5.476e-5]])
    assert rank_divergence(amax, tensors, 50, default) == []
    amax[0, 2] = 9 * amax[1, 2]
    assert [f.tensor_index for f in rank_divergence(amax, tensors, 50, default)] == [2]
