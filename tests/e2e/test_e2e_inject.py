"""Injected faults in real runs become the right alerts: tensor, layer and step."""

from __future__ import annotations

import pytest
from conftest import run_by_name

pytestmark = pytest.mark.slow


def _alerts(api, run_id: int, kind: str) -> list[dict]:
    r = api.get(f"/runs/{run_id}/alerts", params={"kind": kind})
    assert r.status_code == 200, r.text
    return r.json()


def test_nan_in_an_activation_is_a_nonfinite_alert_on_that_tensor_and_step(server, api, train):
    proc = train("--steps", "20", "--monitor-url", server.url, "--run-name", "e2e-nan",
                 "--inject", "nan:blocks.1.mlp.fc@12")  # fmt: skip
    assert "nan" in proc.stdout.lower() and "blocks.1.mlp.fc" in proc.stdout
    run = run_by_name(api, "e2e-nan")
    found = _alerts(api, run["id"], "nonfinite")
    first = min(found, key=lambda a: (a["first_step"], a["id"]))
    assert first["first_step"] == 12
    assert first["tensor_name"] == "blocks.1.mlp.fc.input" and first["layer"] == "blocks.1.mlp.fc"
    assert first["severity"] == "critical"
    # nothing was non-finite before the injection
    assert all(a["first_step"] >= 12 for a in found)
    # the client reported it at once too, with its flight recorder
    events = api.get(f"/runs/{run['id']}/events", params={"kind": "nonfinite"}).json()
    assert events and events[0]["step"] == 12
    assert events[0]["details"].get("last_steps"), events[0]["details"].keys()


def test_saturating_weight_and_lr_spike_alert_on_the_layer_and_the_step(server, api, train):
    train("--steps", "40", "--monitor-url", server.url, "--run-name", "e2e-faults",
          "--inject", "overflow:blocks.2.attn.proj@10", "--inject", "lr-spike@30")  # fmt: skip
    run = run_by_name(api, "e2e-faults")
    overflow = _alerts(api, run["id"], "overflow_burst")
    assert [(a["tensor_name"], a["first_step"]) for a in overflow][:1] == [("blocks.2.attn.proj.weight", 10)]
    assert {a["layer"] for a in overflow} == {"blocks.2.attn.proj"}
    layers = api.get(f"/runs/{run['id']}/layers").json()
    assert layers[0]["layer"] == "blocks.2.attn.proj" and layers[0]["severity"] != "ok"

    spikes = _alerts(api, run["id"], "loss_spike")
    # lr x100 in optimizer step 30: the loss measured in step 31 jumps
    assert spikes and min(a["first_step"] for a in spikes) == 31, spikes
