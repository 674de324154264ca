"""Shadow mode in a 2-process data-parallel job (gloo): the what-if amaxes are reduced across ranks before the
scale update (one shared scale), and rank 0 alone reports: amax the max over ranks, counts summed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from monitor_utils import FAST, decode, free_port, get, running_server

from fp8_trainer import DelayedScaling, Monitor, step_stats
from fp8_trainer.model import GPT, GPTConfig

WORLD, STEPS = 2, 5


def worker(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same weights on both ranks
        model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
        stats = {}
        with Monitor(url, "ddp-shadow", model, shadow=DelayedScaling(amax_history_len=4),
                     spool_path=f"{spool_dir}/r{rank}.jsonl", **FAST) as mon:  # fmt: skip
            for step in range(1, STEPS + 1):
                x = torch.randint(0, 256, (2 + rank, 16), generator=gen)
                _, loss = model(x, x)
                (loss * (1 + 3 * rank)).backward()
                opt.step()
                opt.zero_grad()
                stats[step] = step_stats(model).clone().numpy()
                mon.step(step, loss=loss.detach())
        out[rank] = {"stats": stats, "run_id": mon.run_id}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_in_shadow_mode(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        out = mp.Manager().dict()
        mp.start_processes(worker, args=(free_port(), server.url, str(tmp_path), out), nprocs=WORLD,
                           join=True, start_method="spawn")  # fmt: skip
        res = {rank: out[rank] for rank in range(WORLD)}
        assert res[1]["run_id"] is None and len(get(server.url, "/runs")) == 1  # only rank 0 reports
        run_id = res[0]["run_id"]
        run = get(server.url, f"/runs/{run_id}")
        assert run["world_size"] == WORLD and run["steps_stored"] == STEPS
        assert run["config"]["fp8_source"] == "shadow"
        steps = list(range(1, STEPS + 1))
        per_rank = np.stack(
            [np.stack([res[r]["stats"][s] for s in steps]) for r in range(WORLD)]
        )  # (W,S,T,6)
        assert not np.array_equal(per_rank[0, ..., 0], per_rank[1, ..., 0])  # the ranks saw different data
        np.testing.assert_array_equal(per_rank[0, ..., 1], per_rank[1, ..., 1])  # reduced amax: one scale
        expected = {"amax": per_rank[..., 0].max(axis=0), "scale": per_rank[0, ..., 1],
                    "underflow": per_rank[..., 3].sum(axis=0)}  # fmt: skip
        for metric, want in expected.items():
            h = get(server.url, f"/runs/{run_id}/heatmap", metric=metric, max_cols=1000)
            got = np.array([decode(row) for row in h["values"]]).T  # (S, T)
            np.testing.assert_array_equal(got, want, err_msg=metric)
