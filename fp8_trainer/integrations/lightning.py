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
learning rate it used and the gradient norm before clipping (as ``grad_norm``: on one device and under DDP;
a sharded strategy's gradients are not whole on a rank, so none is sent there). Under DDP every rank runs
the callback and rank 0 reports.
"""

from __future__ import annotations

import contextlib
import json

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from .common import BridgeCallback

__all__ = ["Fp8ScopeCallback"]


class Fp8ScopeCallback(BridgeCallback, Callback):
    """Monitor a Lightning run with fp8scope (see the module docstring). Arguments: those of
    ``BridgeCallback``; ``run_name`` defaults to the LightningModule's class name.
    """

    _region: contextlib.ExitStack | None = None  # the FP8 region of the batch in progress
    _grad_norm: torch.Tensor | None = None  # of the optimizer step in progress (None: not measured)
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
        # the gradient norm before Lightning clips (callbacks run first, on unscaled gradients), over what
        # the optimizer steps; only where this rank holds whole gradients (one device, or DDP after its
        # all-reduce): a sharded strategy's local norm would not be the model's
        self._grad_norm = None
        if isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            grads = [
                p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
            ]
            if grads:
                self._grad_norm = torch.nn.utils.get_total_norm(grads)  # a tensor: read a step late

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._leave_region()
        if trainer.global_step > self._reported:  # an optimizer step ended with this batch
            self._reported = trainer.global_step
            self.bridge.step_end(trainer.global_step, lr=self._lr, grad_norm=self._grad_norm)

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
