"""Shadow mode in a 2-process data-parallel job (gloo): the what-if amaxes are reduced across ranks before the
scale update (one shared scale), and rank 0 alone reports: amax the max over ranks, counts summed (a weight's
counted once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from fp8_trainer import DelayedScaling, Monitor, step_stats, tensor_table
from fp8_trainer.app.model import GPT, GPTConfig
from tests.support.server import running_server
from tests.trainer.gloo import gloo_group, per_rank_stats, rank_step, spawn_ranks
from tests.trainer.monitor_utils import FAST, get, stored_heatmap

WORLD, STEPS = 2, 5


def worker(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, WORLD):
        torch.manual_seed(0)  # the same weights on both ranks
        model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64))
        ddp = DistributedDataParallel(model)  # one model: the same weights on both ranks
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
        stats = {}
        with Monitor(url, "ddp-shadow", model, shadow=DelayedScaling(amax_history_len=4),
                     spool_path=f"{spool_dir}/r{rank}.jsonl", **FAST) as mon:  # fmt: skip
            for step in range(1, STEPS + 1):
                loss = rank_step(ddp, opt, gen, rank)
                stats[step] = step_stats(model).clone().numpy()
                mon.step(step, loss=loss.detach())
        roles = [t.role for t in tensor_table(model)]
        out[rank] = {"stats": stats, "run_id": mon.run_id, "weights": [r == "weight" for r in roles]}


@pytest.mark.slow
def test_two_ranks_in_shadow_mode(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        res = spawn_ranks(worker, WORLD, server.url, str(tmp_path))
        assert res[1]["run_id"] is None and len(get(server.url, "/runs")) == 1  # only rank 0 reports
        run_id = res[0]["run_id"]
        run = get(server.url, f"/runs/{run_id}")
        assert run["world_size"] == WORLD and run["steps_stored"] == STEPS
        assert run["config"]["fp8_source"] == "shadow"
        steps = list(range(1, STEPS + 1))
        per_rank = per_rank_stats(res, steps)  # (W,S,T,6)
        assert not np.array_equal(per_rank[0, ..., 0], per_rank[1, ..., 0])  # the ranks saw different data
        np.testing.assert_array_equal(per_rank[0, ..., 1], per_rank[1, ..., 1])  # reduced amax: one scale
        weights = np.array(res[0]["weights"])  # copies of one weight on both ranks: counted once
        np.testing.assert_array_equal(per_rank[0][:, weights], per_rank[1][:, weights])
        underflow = np.where(weights, per_rank[0, ..., 3], per_rank[..., 3].sum(axis=0))
        expected = {"amax": per_rank[..., 0].max(axis=0), "scale": per_rank[0, ..., 1]}
        expected["underflow"] = underflow
        for metric, want in expected.items():
            _, got = stored_heatmap(server.url, run_id, metric)  # (S, T)
            np.testing.assert_array_equal(got, want, err_msg=metric)
