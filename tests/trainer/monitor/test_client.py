"""Monitor in a plain training loop against a real `fp8-monitor serve`: every step's statistics stored as
the job computed them, baselines without FP8, client-side events with the flight recorder, bad arguments."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from fp8_trainer import DelayedScaling, Monitor, fp8_autocast, step_stats, tensor_table
from fp8_trainer.app.model import GPT, GPTConfig
from tests.support.polling import wait_until
from tests.trainer.monitor_utils import FAST, assert_stored_equal, get, stored_stats, tiny_model, train


def test_plain_loop_stores_every_step_as_computed(server, tmp_path):
    model, recipe = tiny_model()
    spool = tmp_path / "spool.jsonl"
    with Monitor(server.url, "plain", model, recipe, config={"lr": 1e-3}, spool_path=spool, **FAST) as mon:
        seen = train(model, recipe, mon, 12)
        mon.event("checkpoint", 12, path="ckpt-12.pt")
    assert mon.run_id is not None and not mon.spooling
    assert_stored_equal(server.url, mon.run_id, seen)
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["status"] == "finished"
    used = run["config"].pop("fp8_recipe")  # the recipe in force, every parameter of it
    assert run["config"].pop("fp8_run")["argv"] == sys.argv  # how the job was started (test_run_info.py)
    assert run["config"] == {"lr": 1e-3}
    assert used == {**recipe.to_dict(), "scaling": "delayed"} and used["margin"] == 0
    assert run["effective_recipe"]["model"]["amax_history_len"] == 4
    assert run["effective_recipe"]["model"]["scaling"] == "delayed"
    tensors = get(server.url, f"/runs/{mon.run_id}/tensors")
    assert [(t["index"], t["name"], t["role"], t["format"]) for t in tensors] == [
        (t.index, t.name, t.role, t.format) for t in tensor_table(model)
    ]
    assert not spool.exists()  # nothing had to be spooled
    events = get(server.url, f"/runs/{mon.run_id}/events")
    assert [(e["kind"], e["step"], e["details"]) for e in events] == [
        ("custom", 12, {"name": "checkpoint", "path": "ckpt-12.pt"})
    ]


def test_a_converted_model_without_a_recipe_argument_reports_under_its_own_recipe(server, tmp_path):
    # Monitor(url, name, model) after convert_to_fp8: the model's recipe, not a run without statistics
    model, recipe = tiny_model()
    with Monitor(server.url, "no-recipe-arg", model, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        seen = train(model, recipe, mon, 3)
    assert_stored_equal(server.url, mon.run_id, seen)
    assert get(server.url, f"/runs/{mon.run_id}")["effective_recipe"]["model"]["amax_history_len"] == 4


def test_event_details_of_any_type_never_stop_telemetry(server, tmp_path):
    """Values JSON cannot carry as they are (a Path, numpy scalars, NaN) are sent in the wire form or as
    text, and the steps after the event are still stored."""
    model, recipe = tiny_model()
    with Monitor(server.url, "odd-details", model, recipe, **FAST) as mon:
        seen = train(model, recipe, mon, 4)
        mon.event("checkpoint", 4, path=tmp_path / "ck.pt", loss=np.float32("nan"), n=np.int64(7),
                  scales=(np.float64(2.0), float("inf")))  # fmt: skip
        seen |= train(model, recipe, mon, 4, start=5)
    assert_stored_equal(server.url, mon.run_id, seen)
    events = get(server.url, f"/runs/{mon.run_id}/events")
    path = str(tmp_path / "ck.pt")
    assert [e["details"] for e in events] == [
        {"name": "checkpoint", "path": path, "loss": "NaN", "n": 7, "scales": [2.0, "Infinity"]}
    ]


def test_a_batch_rejected_as_malformed_is_dropped_and_sending_goes_on(server, tmp_path, caplog):
    """An event nested past the service's depth limit makes its batch a 422: the job drops that batch and
    says why, instead of retrying or spooling it for ever, and the steps after it are all stored."""
    caplog.set_level(logging.WARNING, logger="fp8scope.monitor")
    tree: dict = {"leaf": 1}
    for _ in range(40):
        tree = {"a": tree}
    model, recipe = tiny_model()
    spool = tmp_path / "spool.jsonl"
    with Monitor(server.url, "poisoned", model, recipe, spool_path=spool, **FAST) as mon:
        train(model, recipe, mon, 4)
        mon.event("deep", 4, tree=tree)
        assert wait_until(lambda: mon.sender.stats["dropped"] == 1)
        seen = train(model, recipe, mon, 4, start=5)
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["status"] == "finished" and run["last_step"] == 8
    loss = get(server.url, f"/runs/{mon.run_id}/series", name="loss")
    assert set(seen) <= set(loss["steps"])
    assert get(server.url, f"/runs/{mon.run_id}/events") == []
    assert "as malformed (HTTP 422" in caplog.text and "(max_json_depth)" in caplog.text
    assert not spool.exists()  # nothing was set aside


def test_exception_in_loop_marks_run_crashed(server, tmp_path):
    model, recipe = tiny_model()
    mon = Monitor(server.url, "crash", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST)
    with pytest.raises(RuntimeError, match="boom"), mon:
        seen = train(model, recipe, mon, 3)
        raise RuntimeError("boom")
    assert get(server.url, f"/runs/{mon.run_id}")["status"] == "crashed"
    assert_stored_equal(server.url, mon.run_id, seen)  # the last step is flushed on the way out


def test_baseline_without_fp8_sends_scalars(server, tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = {}
    with Monitor(server.url, "bf16-baseline", model, None, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        for step in range(1, 6):
            x = torch.randint(0, 256, (2, 16))
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step] = loss.item()
            mon.step(step, loss=loss.detach(), tokens_per_s=1000.0 * step)
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["num_tensors"] == 0 and run["steps_stored"] == 5
    series = get(server.url, f"/runs/{mon.run_id}/series", name="loss")
    assert series["values"] == [losses[s] for s in range(1, 6)]
    tps = get(server.url, f"/runs/{mon.run_id}/series", name="tokens_per_s")
    assert tps["values"] == [1000.0 * s for s in range(1, 6)]


def test_programmer_errors_raise_value_error(tmp_path):
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64))
    with pytest.raises(ValueError, match="no FP8 layers"):
        Monitor("http://127.0.0.1:9", "x", model, object(), spool_path=tmp_path / "a.jsonl")
    fp8_model, recipe = tiny_model()
    with pytest.raises(ValueError, match="flush_interval"):
        Monitor("http://127.0.0.1:9", "x", fp8_model, recipe, flush_interval=0)
    with pytest.raises(ValueError, match="unknown Monitor tuning option"):
        Monitor("http://127.0.0.1:9", "x", fp8_model, recipe, flush_intervall=1.0)
    with pytest.raises(ValueError, match="url"):
        Monitor("127.0.0.1:8000", "x", fp8_model, recipe)
    with pytest.raises(ValueError, match="max_batch_steps"):
        Monitor("http://127.0.0.1:9", "x", fp8_model, recipe, max_batch_steps=2.5)


def test_bad_scalars_never_reach_the_loop(server, tmp_path, caplog):
    model, recipe = tiny_model()

    class Monitored:  # passes a loss that is not a number at steps 3 and 4
        def step(self, step, loss, lr):
            mon.step(step, loss=object() if step in (3, 4) else loss, lr=lr, note="n/a" if step == 5 else 1.0)

    with caplog.at_level(logging.WARNING, logger="fp8scope.monitor"):
        with Monitor(server.url, "odd", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
            seen = train(model, recipe, Monitored(), 6)
        mon.step(7)  # after close: ignored
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["steps_stored"] == 6 and run["last_step"] == 6
    series = get(server.url, f"/runs/{mon.run_id}/series", name="loss")
    assert series["steps"] == [1, 2, 5, 6]
    assert series["values"] == [seen[s][0] for s in (1, 2, 5, 6)]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'loss' is not a number" in m for m in messages) == 1  # once, not per step
    assert sum("'note' is not a number" in m for m in messages) == 1
    assert any("after close" in m for m in messages)


def _events(url, run_id, kind):
    """The run's events of `kind`, each read whole (a list carries big details as their summary)."""
    listed = get(url, f"/runs/{run_id}/events", kind=kind)
    return [get(url, f"/runs/{run_id}/events/{e['id']}") for e in listed]


def test_loss_spike_event_with_flight_recorder(server, tmp_path):
    model, recipe = tiny_model()
    spike_at = 22  # the first step with 20 losses before it
    with Monitor(
        server.url, "spiky", model, recipe, spool_path=tmp_path / "s.jsonl", flight_steps=16, **FAST
    ) as mon:
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, 25):
            x = torch.randint(0, 256, (2, 16), generator=gen)
            with fp8_autocast(fp8_recipe=recipe):
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            reported = loss.detach() * (20.0 if step == spike_at else 1.0)
            mon.step(step, loss=reported)
    events = _events(server.url, mon.run_id, "loss_spike")
    assert [e["step"] for e in events] == [spike_at]
    d = events[0]["details"]
    assert d["z"] >= d["threshold"] == 6.0
    fr = d["flight_recorder"]
    assert fr["steps"] == list(range(spike_at - 15, spike_at + 1))
    assert fr["scalars"]["loss"][-1] == pytest.approx(d["loss"])
    assert [row["step"] for row in d["last_steps"]] == fr["steps"]
    assert d["last_steps"][-1]["loss"] == pytest.approx(d["loss"])
    assert fr["stats"]["amax"]["shape"] == [16, len(tensor_table(model))]
    assert len(d["tensors"]) == 3 and len(fr["tensors"]) == 3
    # the server's own detector agrees on the step
    alerts = get(server.url, f"/runs/{mon.run_id}/alerts", kind="loss_spike")
    assert [a["first_step"] for a in alerts] == [spike_at]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_nonfinite_event_names_the_tensor_and_histograms_it(server, tmp_path, dynamo, compiled):
    # compiled: the histogram hooks the event installs run under torch.compile as they do eagerly
    model, recipe = tiny_model()
    layer = "blocks.0.mlp.fc"
    poisoned = 6

    def poison(step):
        if step == poisoned - 1:  # the weight used in step `poisoned`
            with torch.no_grad():
                dict(model.named_modules())[layer].weight[0, 0] = float("nan")

    spool = tmp_path / "s.jsonl"
    with Monitor(server.url, "nan", model, recipe, spool_path=spool, alerts_refresh=0.1, **FAST) as mon:
        assert mon.open_alerts == 0
        seen = train(model, recipe, mon, 9, hook=poison, forward=torch.compile(model) if compiled else None)
        assert wait_until(lambda: mon.open_alerts > 0)  # the job sees the service's alerts (progress bar)
        # the poisoned weight spreads to other tensors: more alerts than incidents, one incident at least
        grouped = wait_until(lambda: 0 < mon.open_incidents < mon.open_alerts)
        assert grouped, (mon.open_incidents, mon.open_alerts)
    # where it began, as the job itself saw it: the poisoned weight, not the tensors it spread to
    assert mon.first_nonfinite == (poisoned, f"{layer}.weight"), mon.first_nonfinite
    events = _events(server.url, mon.run_id, "nonfinite")
    stat_events = [e for e in events if e["details"]["what"] == "statistics"]
    assert stat_events[0]["step"] == poisoned
    d = stat_events[0]["details"]
    names = [t.name for t in tensor_table(model)]
    first_bad = [i for i in range(len(names)) if seen[poisoned][1][i, 4] > 0]
    assert sorted(d["tensor_indices"]) == first_bad
    # named first: the poisoned weight, which is where the NaN enters in forward-then-backward order
    assert d["tensor"] == f"{layer}.weight" and names[d["tensor_index"]] == d["tensor"]
    assert f"{layer}.weight" in d["tensors"]
    assert d["histograms"][f"{layer}.weight"]["nonfinite"] >= 1
    # the service's alert is on that tensor too
    alerts = get(server.url, f"/runs/{mon.run_id}/alerts", kind="nonfinite")
    first = min(alerts, key=lambda a: (a["first_step"], a["id"]))
    assert (first["first_step"], first["tensor_name"]) == (poisoned, f"{layer}.weight")
    assert d["flight_recorder"]["steps"][-1] == poisoned
    loss_events = [e for e in events if e["details"]["what"] == "loss"]
    assert [e["step"] for e in loss_events] == [poisoned]
    # inputs / gradients involved are histogrammed by one-shot hooks at the next step
    follow = [
        e
        for e in _events(server.url, mon.run_id, "custom")
        if e["details"].get("histogram_for") == "nonfinite" and e["details"]["event_step"] == poisoned
    ]
    captured = {e["details"]["tensor"] for e in follow}
    involved = {names[i] for i in d["tensor_indices"][:8] if not names[i].endswith(".weight")}
    assert captured == involved
    assert all(
        sum(e["details"]["histogram"]["exponents"].values())
        + e["details"]["histogram"]["zeros"]
        + e["details"]["histogram"]["nonfinite"]
        > 0
        for e in follow
    )
    np.testing.assert_equal(len(follow), len(involved))
    if compiled:  # one graph: the FP8 Linears' operators capture the tensors (FP8State.capture_once)
        assert not list(dynamo["graph_break"]), list(dynamo["graph_break"])


def test_steps_without_fp8_send_their_scalars_and_say_why(server, tmp_path, caplog):
    """A loop that forgets fp8_autocast for some steps: every step's loss is stored, the statistics of the
    FP8 steps stay paired with their steps, no alert is raised, and the job is told once, in words."""
    model, recipe = tiny_model()
    gen = torch.Generator().manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fp8_steps = {1, 2, 3, 6, 7, 8}
    losses, seen = {}, {}
    with (
        caplog.at_level(logging.WARNING, logger="fp8scope.monitor"),
        Monitor(server.url, "forgot-autocast", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon,
    ):
        for step in range(1, 9):
            x = torch.randint(0, 256, (4, 16), generator=gen)
            if step in fp8_steps:
                with fp8_autocast(fp8_recipe=recipe):
                    _, loss = model(x, x)
            else:
                _, loss = model(x, x)  # the forward not wrapped: no FP8 layer runs
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = loss.item()
            if step in fp8_steps:
                seen[step] = step_stats(model).clone().numpy()
            mon.step(step, loss=loss.detach())
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["steps_stored"] == 8 and (run["first_step"], run["last_step"]) == (1, 8)
    series = get(server.url, f"/runs/{mon.run_id}/series", name="loss")
    assert series["steps"] == list(range(1, 9))
    assert series["values"] == [losses[s] for s in range(1, 9)]
    got = stored_stats(server.url, mon.run_id)
    cols = {int(s): j for j, s in enumerate(got["steps"])}
    for s in sorted(fp8_steps):
        np.testing.assert_array_equal(got["amax"][:, cols[s]], seen[s][:, 0], err_msg=f"step {s}")
        np.testing.assert_array_equal(got["overflow"][:, cols[s]], seen[s][:, 2], err_msg=f"step {s}")
    for s in (4, 5):  # no values invented for the steps without FP8
        assert s not in cols or np.isnan(got["amax"][:, cols[s]]).all()
    assert get(server.url, f"/runs/{mon.run_id}/alerts") == []
    said = [r.getMessage() for r in caplog.records if "no FP8 layer ran" in r.getMessage()]
    assert said == [said[0]] and "step 4: wrap the forward in fp8_autocast" in said[0]


def test_loop_that_never_enters_fp8_autocast_still_sends_every_loss(server, tmp_path):
    model, _ = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = {}
    with Monitor(server.url, "never-fp8", model, DelayedScaling(amax_history_len=4), **FAST) as mon:
        for step in range(1, 6):
            x = torch.randint(0, 256, (4, 16))
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = loss.item()
            mon.step(step, loss=loss.detach())
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["steps_stored"] == 5 and run["status"] == "finished"
    assert get(server.url, f"/runs/{mon.run_id}/series", name="loss")["values"] == [
        losses[s] for s in range(1, 6)
    ]
    alerts = get(server.url, f"/runs/{mon.run_id}/alerts")
    assert alerts == [], [(a["kind"], a["first_step"], a["message"]) for a in alerts][:3]


def test_tags_set_by_the_job_are_the_runs_tags(server, tmp_path):
    model, recipe = tiny_model()
    with Monitor(server.url, "tagged", model, recipe, tags=["sweep-7", "lr=1e-3", "sweep-7"], **FAST) as mon:
        train(model, recipe, mon, 2)
    assert get(server.url, f"/runs/{mon.run_id}")["tags"] == ["lr=1e-3", "sweep-7"]
    assert [r["id"] for r in get(server.url, "/runs", tag="sweep-7")] == [mon.run_id]
    with pytest.raises(ValueError, match="'has space' is not a tag"):
        Monitor(server.url, "x", model, recipe, tags=["has space"])
    with pytest.raises(ValueError, match="a list of strings"):
        Monitor(server.url, "x", model, recipe, tags="sweep-7")


def test_system_metrics_and_step_time_chart_beside_the_loss(server, tmp_path):
    model, recipe = tiny_model()
    with Monitor(server.url, "system", model, recipe, tokens_per_step=64, **FAST) as mon:
        train(model, recipe, mon, 6)
    step_time = get(server.url, f"/runs/{mon.run_id}/series", name="step_time_s")
    assert step_time["steps"] == [2, 3, 4, 5, 6]  # the time since the previous step()
    assert all(0 < v < 60 for v in step_time["values"])
    tps = get(server.url, f"/runs/{mon.run_id}/series", name="tokens_per_s")
    assert tps["steps"] == step_time["steps"]
    np.testing.assert_allclose(tps["values"], [64 / v for v in step_time["values"]], rtol=1e-12)
    mem = get(server.url, f"/runs/{mon.run_id}/series", name="host_memory_mb")
    assert mem["steps"] and all(50 < v < 64 * 1024 for v in mem["values"])  # this process's resident memory
    # no GPU here: no GPU metrics, and no error for their absence
    assert get(server.url, f"/runs/{mon.run_id}/series", name="gpu_memory_mb")["steps"] == []


def test_gpu_sampler_without_nvml_is_silent():
    from fp8_trainer.monitor.system import SystemSampler

    sample = SystemSampler(gpu_index=0).sample()
    assert "gpu_utilization" not in sample and sample["host_memory_mb"] > 0


def test_the_run_address_is_printed_once_on_the_job_terminal(server, tmp_path, capfd):
    model, recipe = tiny_model()
    with Monitor(server.url, "announced", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        train(model, recipe, mon, 4)
        wait_until(lambda: mon.run_id is not None)
        train(model, recipe, mon, 2, start=5)  # a step after registration prints it
    err = capfd.readouterr().err
    line = f"fp8scope: run 'announced' -> {server.url}/#/runs/{mon.run_id}"
    assert err.count(line) == 1, err
    with Monitor(server.url, "quiet", model, recipe, spool_path=tmp_path / "q.jsonl", announce=False,
                 **FAST) as mon:  # fmt: skip
        train(model, recipe, mon, 3)
        wait_until(lambda: mon.run_id is not None)
        train(model, recipe, mon, 1, start=4)
    assert "fp8scope: run 'quiet'" not in capfd.readouterr().err
