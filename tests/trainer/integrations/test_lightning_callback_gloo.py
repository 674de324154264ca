"""``Fp8ScopeCallback`` in a 2-process Lightning job on the CPU (``ddp_spawn``, gloo): every rank runs the
callback, rank 0 alone registers and reports, with the statistics reduced over the ranks (amax max), one
step per optimizer step under gradient accumulation."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from fp8_trainer import DelayedScaling, step_stats  # noqa: E402
from fp8_trainer.integrations.lightning import Fp8ScopeCallback  # noqa: E402
from tests.support.server import running_server  # noqa: E402
from tests.trainer.integrations.lightning_llama import BATCH, SEQ, TinyLlama  # noqa: E402
from tests.trainer.monitor_utils import FAST, get, stored_heatmap  # noqa: E402

WORLD, STEPS, ACCUM = 2, 3, 2


class SaveStats(L.Callback):
    """Each rank's own statistics at every optimizer step, written to a file at the end (spawned ranks)."""

    def __init__(self, folder: str):
        self.folder, self.stats, self.last = folder, {}, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self.last:
            self.last = trainer.global_step
            self.stats[trainer.global_step] = step_stats(pl_module).clone().numpy()

    def on_fit_end(self, trainer, pl_module):
        with open(f"{self.folder}/rank{trainer.global_rank}.pkl", "wb") as f:
            pickle.dump(self.stats, f)


@pytest.mark.slow
def test_two_processes_rank_zero_reports(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        data = torch.randint(
            0, 64, (BATCH * ACCUM * STEPS * WORLD, SEQ), generator=torch.Generator().manual_seed(0)
        )
        cb = Fp8ScopeCallback(server.url, run_name="pl-ddp", shadow=DelayedScaling(),
                              spool_path=str(tmp_path / "s.jsonl"), **FAST)  # fmt: skip
        trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="cpu", devices=WORLD,
                            strategy="ddp_spawn", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[cb, SaveStats(str(tmp_path))])  # fmt: skip
        trainer.fit(TinyLlama(), torch.utils.data.DataLoader(data, batch_size=BATCH))
        runs = get(server.url, "/runs")
        assert [r["name"] for r in runs] == ["pl-ddp"]  # one run: rank 1 registered nothing
        run = get(server.url, f"/runs/{runs[0]['id']}")
        assert run["world_size"] == WORLD and run["steps_stored"] == STEPS
        per_rank = []
        for r in range(WORLD):
            with open(tmp_path / f"rank{r}.pkl", "rb") as f:
                stats = pickle.load(f)
            per_rank.append(np.stack([stats[s] for s in range(1, STEPS + 1)]))
        per_rank = np.stack(per_rank)
        assert not np.array_equal(per_rank[0, ..., 0], per_rank[1, ..., 0])  # each rank its own data
        _, got = stored_heatmap(server.url, run["id"], "amax")
        np.testing.assert_array_equal(got, per_rank[..., 0].max(axis=0))
