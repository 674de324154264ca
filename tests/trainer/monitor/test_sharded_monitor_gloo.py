"""The monitor of a sharded job (4 CPU processes, gloo, FSDP2 x tensor parallelism on a ``(dp=2, tp=2)``
mesh): what the service stores is one row per logical tensor, as an unsharded run on the same global batch
records it, and a monitor that hangs changes nothing in the training.

Every rank calls ``Monitor.step``; rank 0 reports the reduction over ranks. Counted once: the two tp ranks of
a dp group (they hold the same rows after the step's merge) and a weight's copies on the dp ranks; summed:
the dp ranks' activations and gradients (each rank's part of the batch). At the first step every scale is 1
in both runs, so a weight's statistics and the first layer's input (the data itself, no FP8 GEMM before it)
are the unsharded run's exactly; summing over all four ranks would store four times a weight's counts and
twice an input's.

Three runs per rank, one after the other: with a live service, with a service that accepts connections and
never answers (a hung monitor), and without a monitor. The losses and statistics of the three are the same
bits: the monitor only reads.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

import fp8_trainer
from fp8_trainer import DelayedScaling, Monitor
from tests.support.server import running_server
from tests.trainer import sharded_runs
from tests.trainer.gloo import gloo_group, spawn_ranks
from tests.trainer.monitor_utils import FAST, get, stored_stats

DP, TP = 2, 2
WORLD = DP * TP
STEPS, ROWS = 3, 8
ROLES = ("input", "weight", "grad_output")
METRICS = ("amax", "scale", "overflow", "underflow", "nonfinite")  # step_stats' first columns, in order


def _recipe() -> DelayedScaling:
    return DelayedScaling(amax_history_len=4)


def _fp8_model(recipe):
    return fp8_trainer.convert_to_fp8(sharded_runs.small_model(), recipe=recipe)


def worker(rank: int, port: int, url: str, hung_url: str, spool_dir: str, out: dict) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, WORLD):
        mesh, rows = sharded_runs.mesh_2d(DP, TP, ROWS)
        res = {}
        for mode, where in (("live", url), ("hung", hung_url), ("off", None)):
            recipe = _recipe()
            model = sharded_runs.shard_2d(_fp8_model(recipe), mesh)
            mon = None
            if where is not None:
                spool = f"{spool_dir}/{mode}-r{rank}.jsonl"
                mon = Monitor(where, f"mesh2d-{mode}", model, recipe, spool_path=spool, **FAST)
            after = None if mon is None else (lambda step, loss, mon=mon: mon.step(step + 1, loss=loss))
            r = sharded_runs.train(model, STEPS, ROWS, rows, after_step=after)
            if mon is not None:
                mon.close()
                r["run_id"] = mon.run_id
            res[mode] = r
        out[rank] = res


def reference() -> dict:
    torch.set_num_threads(1)
    return sharded_runs.train(_fp8_model(_recipe()), STEPS, ROWS)


@pytest.mark.slow
def test_sharded_run_stores_one_row_per_logical_tensor_and_a_hung_monitor_changes_nothing(tmp_path):
    hung = socket.socket()  # listens (the kernel completes the handshakes), never accepts nor answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
            hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
            runs = spawn_ranks(worker, WORLD, server.url, hung_url, str(tmp_path))
            ref = reference()
            run_id = runs[0]["live"]["run_id"]
            assert run_id is not None and all(runs[r]["live"]["run_id"] is None for r in range(1, WORLD))
            assert runs[0]["hung"]["run_id"] is None  # never registered: the service never answered
            stored = stored_stats(server.url, run_id)
            tensors = sorted(get(server.url, f"/runs/{run_id}/tensors"), key=lambda t: t["index"])
    finally:
        hung.close()

    # the monitor only reads: the same losses and statistics with a live, a hung or no monitor
    for r in range(WORLD):
        for mode in ("live", "hung"):
            assert runs[r][mode]["losses"] == runs[r]["off"]["losses"], (r, mode)
            for got, want in zip(runs[r][mode]["stats"], runs[r]["off"]["stats"], strict=True):
                assert torch.equal(got, want), (r, mode)

    np.testing.assert_array_equal(stored["steps"], np.arange(1, STEPS + 1))
    role = np.array([t["role"] for t in tensors])
    assert set(role) == set(ROLES)
    first = {metric: stored[metric][:, 0] for metric in METRICS}
    want = ref["stats"][0].numpy()
    weights = role == "weight"
    assert want[weights, 3].sum() > 0  # the weights underflow at scale 1: counted twice, it would show
    for j, metric in enumerate(METRICS):
        # every weight: the unsharded weight's statistics, once
        np.testing.assert_array_equal(first[metric][weights], want[weights, j], err_msg=metric)
        # the first layer's input: the two dp halves of the batch make the whole batch
        assert first[metric][0] == want[0, j], metric
    assert want[0, 3] > 0  # the input underflows too: summed over four ranks, it would be twice the count
    # later steps: each stored row is the reduction of the dp leads' rows (weights once, the rest summed)
    for step in range(STEPS):
        per_dp = np.stack([runs[r]["live"]["stats"][step].numpy() for r in range(0, WORLD, TP)])
        for j, metric in ((2, "overflow"), (3, "underflow"), (4, "nonfinite")):
            expected = np.where(weights, per_dp[0, :, j], per_dp[:, :, j].sum(axis=0))
            np.testing.assert_array_equal(stored[metric][:, step], expected, err_msg=f"{metric} step {step}")
        np.testing.assert_array_equal(stored["amax"][:, step], per_dp[:, :, 0].max(axis=0))
