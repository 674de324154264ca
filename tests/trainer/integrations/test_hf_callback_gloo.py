"""``Fp8ScopeCallback`` in a 2-process Hugging Face ``Trainer`` job on the CPU (gloo, launched as torchrun
would: RANK / WORLD_SIZE / MASTER_ADDR in the environment): every rank runs the callback, rank 0 alone
registers and reports, with the statistics reduced over the ranks (amax max, counts summed), one step per
optimizer step under gradient accumulation."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tests.support.server import running_server
from tests.trainer.gloo import per_rank_stats, spawn_ranks
from tests.trainer.monitor_utils import FAST, get, stored_heatmap

WORLD, STEPS, ACCUM = 2, 3, 2


def worker(rank: int, port: int, url: str, tmp: str, out) -> None:
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD, MASTER_PORT=port)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    from transformers import Trainer, TrainingArguments

    from fp8_trainer import DelayedScaling
    from fp8_trainer.integrations.hf import Fp8ScopeCallback
    from tests.trainer.integrations.llama import BATCH, Seen, Tokens, tiny_llama

    model = tiny_llama()
    args = TrainingArguments(output_dir=f"{tmp}/out", per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-3,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                             ddp_backend="gloo", run_name="hf-ddp")  # fmt: skip
    seen = Seen(model)
    cb = Fp8ScopeCallback(url, shadow=DelayedScaling(), spool_path=f"{tmp}/r{rank}.jsonl", **FAST)
    Trainer(model=model, args=args, train_dataset=Tokens(BATCH * ACCUM * STEPS * WORLD),
            callbacks=[cb, seen]).train()  # fmt: skip
    out[rank] = {"stats": seen.stats, "world": torch.distributed.get_world_size()}


@pytest.mark.slow
def test_two_processes_rank_zero_reports(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        res = spawn_ranks(worker, WORLD, server.url, str(tmp_path))
        assert res[0]["world"] == res[1]["world"] == WORLD
        runs = get(server.url, "/runs")
        assert [r["name"] for r in runs] == ["hf-ddp"]  # one run: rank 1 registered nothing
        run = get(server.url, f"/runs/{runs[0]['id']}")
        assert run["world_size"] == WORLD and run["steps_stored"] == STEPS
        steps = list(range(1, STEPS + 1))
        per_rank = per_rank_stats(res, steps)
        assert not np.array_equal(per_rank[0, ..., 0], per_rank[1, ..., 0])  # each rank its own data
        _, got = stored_heatmap(server.url, run["id"], "amax")
        np.testing.assert_array_equal(got, per_rank[..., 0].max(axis=0))
