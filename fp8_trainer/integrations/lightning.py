"""``Fp8ScopeCallback`` for Lightning: FP8 health of every optimizer step from a callback.

    import lightning as L
    from fp8_trainer import DelayedScaling
    from fp8_trainer.integrations.lightning import Fp8ScopeCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[Fp8ScopeCallback(recipe=DelayedScaling())])
    # or Fp8ScopeCallback(shadow=DelayedScaling()): the model trains as it is, FP8 what-if statistics
    trainer.fit(module, train_loader)

At ``on_fit_start`` the callback prepares the LightningModule (``integrations/common.py``) and registers the
run with the module's hyperparameters and the Trainer's settings as its config. Each training batch runs in
the FP8 region (entered at ``on_train_batch_start``, left at ``on_train_batch_end``, so a ``training_step``
that calls submodules directly is covered too). The step's loss is the sum of the losses handed to
backward (Lightning divides each by ``accumulate_grad_batches``, so it is their mean); when
``trainer.global_step`` moves on (an optimizer step happened), the FP8 step is closed and reported with the
learning rate it used. Under DDP every rank runs the callback and rank 0 reports.
"""

from __future__ import annotations

import contextlib
import json

from lightning.pytorch.callbacks import Callback

from .common import BridgeCallback

__all__ = ["Fp8ScopeCallback"]


class Fp8ScopeCallback(BridgeCallback, Callback):
    """Monitor a Lightning run with fp8scope (see the module docstring). Arguments: those of
    ``BridgeCallback``; ``run_name`` defaults to the LightningModule's class name.
    """

    _region: contextlib.ExitStack | None = None  # the FP8 region of the batch in progress
    _reported = 0  # the last global step reported

    def on_fit_start(self, trainer, pl_module) -> None:
        config = {
            "hparams": dict(pl_module.hparams),
            "max_steps": trainer.max_steps,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "precision": str(trainer.precision),
            "world_size": trainer.world_size,
        }
        config = json.loads(json.dumps(config, default=str))  # JSON-able whatever the hyperparameters hold
        self.bridge.start(pl_module, config, type(pl_module).__name__)
        self._reported = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._leave_region()
        self._region = contextlib.ExitStack()
        self._region.enter_context(self.bridge.region())

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.bridge.add_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = float(optimizer.param_groups[0]["lr"])  # before the scheduler steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._leave_region()
        if trainer.global_step > self._reported:  # an optimizer step ended with this batch
            self._reported = trainer.global_step
            self.bridge.step_end(trainer.global_step, lr=self._lr)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._leave_region()
        self.bridge.close("finished")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._leave_region()
        self.bridge.close("crashed")

    def _leave_region(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None
