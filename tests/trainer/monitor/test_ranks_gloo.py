"""Monitor in a 2-process data-parallel job (gloo): rank 0 reports the reduced statistics, per-rank amaxes
are sampled as rank_amax events, and a command reaches every rank at the same step."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from fp8_trainer import Monitor, fp8_autocast, get_layer_recipes, step_stats
from tests.support.http import loopback
from tests.support.polling import wait_until
from tests.support.server import API, free_port, running_server
from tests.trainer.gloo import gloo_group, per_rank_stats, rank_step, spawn_ranks
from tests.trainer.monitor_utils import FAST, get, stored_heatmap, tiny_model

WORLD = 2
LAYER = "blocks.0.mlp.fc"
SAMPLE = 4


def worker(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    with gloo_group(rank, port, WORLD):
        model, recipe = tiny_model()  # the same weights on both ranks
        mon = Monitor(
            url,
            "ddp",
            model,
            recipe,
            spool_path=f"{spool_dir}/r{rank}.jsonl",
            rank_sample_interval=SAMPLE,
            **FAST,
        )
        ddp = DistributedDataParallel(model)  # the ranks keep one model: the same weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
        stats, margins, extra = {}, {}, 0
        for step in range(1, 300):
            margins[step] = get_layer_recipes(model)[LAYER]["margin"]
            loss = rank_step(ddp, opt, gen, rank, recipe)
            stats[step] = step_stats(model).clone().numpy()
            mon.step(step, loss=loss.detach())
            # rank 0 decides for both when to stop: a few steps after the command took effect
            if get_layer_recipes(model)[LAYER]["margin"] == 2:
                extra += 1
            go = torch.tensor([int(step < SAMPLE * 2 or extra < 3)])
            dist.broadcast(go, src=0)
            if not go.item():
                break
            time.sleep(0.03)
        mon.close()
        out[rank] = {"stats": stats, "margins": margins, "run_id": mon.run_id}


@pytest.mark.slow
def test_two_ranks_report_reduced_stats_rank_amax_and_apply_commands_together(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        manager = mp.Manager()
        out = manager.dict()
        ctx = mp.start_processes(
            worker,
            args=(free_port(), server.url, str(tmp_path), out),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        assert wait_until(lambda: get(server.url, "/runs"), timeout=60)
        run_id = get(server.url, "/runs")[0]["id"]
        posted = loopback.post(
            f"{server.url}{API}/runs/{run_id}/commands", json={"target": LAYER, "changes": {"margin": 2}}
        )
        assert posted.status_code == 201, posted.text
        while not ctx.join(timeout=60):
            pass
        res = {rank: out[rank] for rank in range(WORLD)}
        assert res[0]["run_id"] == run_id and res[1]["run_id"] is None  # only rank 0 talks HTTP

        # the command took effect at the same step on both ranks, and was acked with that step
        assert res[0]["margins"] == res[1]["margins"]
        applied_at = min(s for s, m in res[0]["margins"].items() if m == 2)
        cmd = get(server.url, f"/runs/{run_id}/commands")[0]
        assert cmd["state"] == "applied" and cmd["applied_step"] == applied_at

        steps = sorted(res[0]["stats"])
        run = get(server.url, f"/runs/{run_id}")
        assert run["world_size"] == WORLD and run["steps_stored"] == len(steps)
        per_rank = per_rank_stats(res, steps)  # (W, S, T, 6)
        assert not np.array_equal(per_rank[0, :, :, 0], per_rank[1, :, :, 0])  # the ranks saw different data
        # a weight is one tensor held by both ranks (DDP's replicas): counted once; activations and
        # gradients are each rank's part of the global batch: summed
        tensors = sorted(get(server.url, f"/runs/{run_id}/tensors"), key=lambda t: t["index"])
        weights = np.array([t["role"] == "weight" for t in tensors])
        assert weights.any() and not weights.all()
        np.testing.assert_array_equal(per_rank[0][:, weights], per_rank[1][:, weights])
        assert per_rank[0][:, weights, 3].sum() > 0  # weights underflow: summing the copies would show twice
        counts = {
            name: np.where(weights, per_rank[0, ..., col], per_rank[..., col].sum(axis=0))
            for col, name in ((2, "overflow"), (3, "underflow"), (4, "nonfinite"))
        }
        expected = {"amax": per_rank[..., 0].max(axis=0), "scale": per_rank[0, ..., 1], **counts}
        np.testing.assert_array_equal(per_rank[0, ..., 1], per_rank[1, ..., 1])  # one shared scale
        for metric, want in expected.items():
            bucket_start, got = stored_heatmap(server.url, run_id, metric)  # (S, T)
            assert bucket_start == steps
            np.testing.assert_array_equal(got, want, err_msg=metric)

        listed = get(server.url, f"/runs/{run_id}/events", kind="rank_amax")
        events = [get(server.url, f"/runs/{run_id}/events/{e['id']}") for e in listed]  # each whole
        assert [e["step"] for e in events] == [s for s in steps if s % SAMPLE == 0]
        for e in events:
            assert e["details"]["world_size"] == WORLD
            i = steps.index(e["step"])
            np.testing.assert_array_equal(
                np.array(e["details"]["amax"], dtype=np.float64), per_rank[:, i, :, 0]
            )


def worker_without_fp8(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    with gloo_group(rank, port, WORLD):
        model, recipe = tiny_model()
        mon = Monitor(url, "ddp-no-fp8", model, recipe, spool_path=f"{spool_dir}/n{rank}.jsonl", **FAST)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(7 + rank)
        losses = {}
        for step in range(1, 7):
            x = torch.randint(0, 256, (2, 16), generator=gen)
            if step in (3, 4):  # the forward not wrapped in fp8_autocast on every rank
                _, loss = model(x, x)
            else:
                with fp8_autocast(fp8_recipe=recipe):
                    _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step] = loss.item()
            mon.step(step, loss=loss.detach())
        mon.close()
        out[rank] = {"losses": losses, "run_id": mon.run_id}


@pytest.mark.slow
def test_two_ranks_report_steps_without_fp8_with_their_scalars(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        out = spawn_ranks(worker_without_fp8, WORLD, server.url, str(tmp_path))
        run_id = out[0]["run_id"]
        run = get(server.url, f"/runs/{run_id}")
        assert run["steps_stored"] == 6 and run["status"] == "finished"
        loss = get(server.url, f"/runs/{run_id}/series", name="loss")
        assert loss["steps"] == [1, 2, 3, 4, 5, 6]
        assert loss["values"] == [out[0]["losses"][s] for s in range(1, 7)]  # rank 0's
        bucket_start, values = stored_heatmap(server.url, run_id, "amax", max_cols=100)
        with_stats = [s for s, col in zip(bucket_start, values, strict=True) if not np.isnan(col).all()]
        assert with_stats == [1, 2, 5, 6]
        assert get(server.url, f"/runs/{run_id}/alerts") == []
