"""``Fp8ScopeCallback`` in a real Lightning ``Trainer`` (tiny Llama from transformers, CPU) streaming into a
real `fp8-monitor serve`: every optimizer step stored once, with the statistics the runtime computed at that
step and the loss handed to backward, under gradient accumulation; in FP8 and in shadow mode."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from lightning.pytorch.utilities import grad_norm  # noqa: E402

from fp8_trainer import DelayedScaling, Linear, step_stats  # noqa: E402
from fp8_trainer.integrations.lightning import Fp8ScopeCallback  # noqa: E402
from tests.trainer.integrations.lightning_llama import BATCH, SEQ, TinyLlama  # noqa: E402
from tests.trainer.monitor_utils import FAST, get, stored_stats  # noqa: E402

STEPS, ACCUM = 4, 2


CLIP = 0.05  # well under the gradient norms here: clipping changes every step's gradients


class Seen(L.Callback):
    """After fp8scope's callback: the runtime's statistics at each optimizer step, and the gradient norm
    before clipping as Lightning's own ``grad_norm`` utility measures it."""

    def __init__(self):
        self.stats, self.last, self.norms = {}, 0, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self.last:
            self.last = trainer.global_step
            s = step_stats(pl_module) if hasattr(pl_module, "_fp8_state") else None
            self.stats[trainer.global_step] = None if s is None else s.clone().numpy()


def fit(callback=None):
    module = TinyLlama()
    data = torch.randint(0, 64, (BATCH * ACCUM * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    seen = Seen()
    callbacks = [c for c in (callback, seen) if c is not None]
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="cpu", devices=1,
                        gradient_clip_val=CLIP,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer.fit(module, loader)
    return module, seen


def assert_stored(url, name, module, seen):
    run = next(r for r in get(url, "/runs") if r["name"] == name)
    run = get(url, f"/runs/{run['id']}")
    assert run["steps_stored"] == STEPS and (run["first_step"], run["last_step"]) == (1, STEPS)
    assert run["status"] == "finished"
    assert run["config"]["hparams"] == {"lr": 1e-3} and run["config"]["accumulate_grad_batches"] == ACCUM
    # the step's loss: its micro-batches' losses as Lightning hands them to backward (divided by ACCUM)
    want = [
        float(module.losses[ACCUM * s] / ACCUM + module.losses[ACCUM * s + 1] / ACCUM) for s in range(STEPS)
    ]
    assert get(url, f"/runs/{run['id']}/series", name="loss")["values"] == want
    assert get(url, f"/runs/{run['id']}/series", name="lr")["values"] == [1e-3] * STEPS
    # the gradient norm of each step, before Lightning clipped it to CLIP
    norms = get(url, f"/runs/{run['id']}/series", name="grad_norm")["values"]
    np.testing.assert_allclose(norms, seen.norms, rtol=1e-4)
    assert min(norms) > CLIP
    got = stored_stats(url, run["id"])
    for c, metric in enumerate(("amax", "scale", "overflow", "underflow", "nonfinite")):
        expected = np.stack([seen.stats[s][:, c] for s in range(1, STEPS + 1)], axis=1)
        np.testing.assert_array_equal(got[metric], expected, err_msg=metric)
    assert seen.stats[1][0, 5] == ACCUM * BATCH * SEQ * 32  # both micro-batches in one FP8 step
    return run


def test_lightning_in_fp8(server, tmp_path):
    cb = Fp8ScopeCallback(server.url, run_name="pl-fp8", recipe=DelayedScaling(amax_history_len=4),
                          module_filter_fn=lambda m, fqn: not fqn.endswith("lm_head"),
                          spool_path=tmp_path / "s.jsonl", **FAST)  # fmt: skip
    module, seen = fit(cb)
    assert sum(isinstance(m, Linear) for m in module.modules()) == 14
    assert seen.stats[STEPS][:, 1].min() != 1.0  # the delayed scales moved: the FP8 region was active
    assert_stored(server.url, "pl-fp8", module, seen)


def test_lightning_in_shadow_mode_keeps_the_numerics(server, tmp_path):
    plain, _ = fit()
    cb = Fp8ScopeCallback(server.url, run_name="pl-shadow", shadow=DelayedScaling(),
                          spool_path=tmp_path / "s.jsonl", **FAST)  # fmt: skip
    module, seen = fit(cb)
    assert [x.item() for x in module.losses] == [x.item() for x in plain.losses]
    for p, q in zip(module.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    run = assert_stored(server.url, "pl-shadow", module, seen)
    assert run["config"]["fp8_source"] == "shadow"
