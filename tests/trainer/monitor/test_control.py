"""The control loop: a recipe command posted over HTTP is applied at the next step boundary and acked with
the first step that runs under it; a rollback restores the previous values; bad commands are rejected
with the reason."""

from __future__ import annotations

import time

import torch

from fp8_trainer import Monitor, get_layer_recipes
from fp8_trainer.app.model import GPT, GPTConfig
from fp8_trainer.monitor.control import apply_commands
from tests.support.http import loopback
from tests.support.polling import wait_until
from tests.support.server import API
from tests.trainer.monitor_utils import FAST, get, tiny_model, train


def post_command(url, run_id, body):
    r = loopback.post(f"{url}{API}/runs/{run_id}/commands", json=body, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()


def command(url, run_id, cid):
    return next(c for c in get(url, f"/runs/{run_id}/commands") if c["id"] == cid)


def test_command_applied_at_step_boundary_acked_and_rolled_back(server, tmp_path, capfd):
    model, recipe = tiny_model()
    layer = "blocks.0.mlp.fc"
    margins = {}  # optimizer step -> the layer's margin in force while that step ran
    with Monitor(server.url, "control", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        train(model, recipe, mon, 3)
        assert wait_until(lambda: mon.run_id is not None)
        change = post_command(server.url, mon.run_id, {"target": layer, "changes": {"margin": 3}})
        rollback = None
        step = 4
        while True:
            margins[step] = get_layer_recipes(model)[layer]["margin"]
            train(model, recipe, mon, 1, start=step)  # ends with mon.step(step): commands apply there
            now = get_layer_recipes(model)[layer]["margin"]
            if rollback is None and now == 3:
                # the ack travels on the monitor's thread, and the service rolls back an applied command
                # only (409 while it is "delivered"): wait for the ack, as a user would see it applied
                assert wait_until(
                    lambda: command(server.url, mon.run_id, change["id"])["state"] == "applied"
                ), "the change's ack never reached the service"
                rollback = post_command(server.url, mon.run_id, {"rollback": change["id"]})
            if rollback is not None and now == 0:
                break
            step += 1
            assert step < 400, "the commands never arrived"
            time.sleep(0.02)  # the loop is faster than the batch timer
    applied_at = min(s for s, m in margins.items() if m == 3)  # first optimizer step under margin 3
    assert all(m == 0 for s, m in margins.items() if s < applied_at)
    done = command(server.url, mon.run_id, change["id"])
    assert done["state"] == "applied" and done["applied_step"] == applied_at
    assert done["previous"] == {"margin": 0}
    undone = command(server.url, mon.run_id, rollback["id"])
    assert undone["kind"] == "rollback" and undone["state"] == "applied"
    assert undone["applied_step"] == step + 1  # applied after step `step`: step + 1 runs with margin 0
    assert get_layer_recipes(model)[layer]["margin"] == 0
    eff = get(server.url, f"/runs/{mon.run_id}")["effective_recipe"]
    assert eff["layers"][layer]["margin"] == 0
    # the job's terminal said each, in one line: what, where, from which step, whose
    err = capfd.readouterr().err
    assert (
        f"fp8scope: recipe change {change['id']} by {change['created_by']} applied from step {applied_at}: "
        f"{layer} margin 0 -> 3"
    ) in err, err
    assert (
        f"fp8scope: rollback {rollback['id']} by {rollback['created_by']} applied from step {step + 1}" in err
    )


def test_bad_commands_are_rejected_with_the_reason():
    model, _ = tiny_model()
    commands = [
        {"id": 1, "target": "blocks.9.mlp.fc", "changes": {"margin": 1}},
        {"id": 2, "target": "model", "changes": {"amax_compute_algo": "mean"}},
        {"id": 3, "target": "blocks.0.mlp.fc", "changes": {"colour": "red"}},
        {"id": 4, "target": "blocks.0.attn.qkv", "changes": {"fp8_enabled": False}},
    ]
    acks = apply_commands(model, commands, step=41)
    assert acks[0] == {
        "command_id": 1,
        "state": "rejected",
        "reason": "layer_name: unknown FP8 layer 'blocks.9.mlp.fc'",
    }
    assert acks[1]["state"] == "rejected" and "amax_compute_algo" in acks[1]["reason"]
    assert acks[2]["state"] == "rejected" and "colour" in acks[2]["reason"]
    assert acks[3] == {"command_id": 4, "state": "applied", "step": 42}
    assert get_layer_recipes(model)["blocks.0.attn.qkv"]["fp8_enabled"] is False
    assert get_layer_recipes(model)["blocks.0.mlp.fc"]["amax_compute_algo"] == "max"  # nothing half-applied


def test_command_to_a_run_without_fp8_is_rejected_over_http(server, tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Monitor(server.url, "baseline", model, None, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        cid = None
        for step in range(1, 200):
            x = torch.randint(0, 256, (2, 16))
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
            mon.step(step)
            if step == 2:
                assert wait_until(lambda: mon.run_id is not None)
                cid = post_command(server.url, mon.run_id, {"target": "model", "changes": {"margin": 1}})[
                    "id"
                ]
            if cid and command(server.url, mon.run_id, cid)["state"] == "rejected":
                break
    c = command(server.url, mon.run_id, cid)
    assert c["state"] == "rejected" and "no FP8" in c["reason"]
