"""``Fp8ScopeCallback`` for the Hugging Face ``Trainer``: FP8 health of every optimizer step, no subclass.

    from fp8_trainer import DelayedScaling
    from fp8_trainer.integrations.hf import Fp8ScopeCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[Fp8ScopeCallback(recipe=DelayedScaling())])     # train in FP8
    # or Fp8ScopeCallback(shadow=DelayedScaling()): the model trains as it is, FP8 what-if statistics
    # or Fp8ScopeCallback(): a torchao model is watched as it is; any other model sends its loss
    trainer.train()

At ``on_train_begin`` the callback prepares the model (``integrations/common.py``), registers the run with
the ``TrainingArguments`` as its config, and wraps the model's ``forward`` so that it runs in the FP8
region and hands its loss over. Every optimizer step (``on_step_end``, not only at ``logging_steps``) the
step's statistics and loss go to the monitor. The loss is the one the Trainer itself reports for that step:
the micro-batch losses as ``training_step`` returns them (divided by ``gradient_accumulation_steps`` unless
the model takes ``num_items_in_batch``), summed over the step's micro-batches. The learning rate is the one
the step used. At each of the Trainer's logging steps (``logging_steps``) the step also carries the
``grad_norm`` the Trainer logs (the norm before clipping): the step is reported at ``on_log``, which follows
``on_step_end`` in the same step. Each evaluation's metrics go as an ``eval`` event at the step it
followed (``eval_loss`` as ``val_loss``, drawn beside the loss; the others without their ``eval_``
prefix). Under torch.distributed every rank runs the callback and rank 0 reports.

The URL and token come from the arguments or ``FP8SCOPE_URL`` / ``FP8SCOPE_TOKEN`` (``Monitor``'s rules).
Saving checkpoints with FP8 layers: their scaling state is module extra state, which safetensors cannot
hold; use ``save_safetensors=False`` (or ``save_strategy="no"``) with ``recipe``.
"""

from __future__ import annotations

import functools
import json

from torch import nn
from transformers import TrainerCallback

from .common import BridgeCallback

__all__ = ["Fp8ScopeCallback"]


class Fp8ScopeCallback(BridgeCallback, TrainerCallback):
    """Monitor a Hugging Face ``Trainer`` run with fp8scope (see the module docstring). Arguments: those of
    ``BridgeCallback``; ``run_name`` defaults to ``TrainingArguments.run_name`` (else its ``output_dir``).
    """

    _grad_accum = 1  # TrainingArguments.gradient_accumulation_steps, read at train begin
    _pending: tuple[int, float | None] | None = None  # (step, lr) reported at its on_log

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        config = json.loads(args.to_json_string())  # JSON-able, tokens already masked
        if getattr(model, "config", None) is not None:  # a PretrainedConfig: Monitor makes it JSON
            config["model_config"] = model.config
        name = args.run_name or str(args.output_dir).rstrip("/").rsplit("/", 1)[-1] or "hf-trainer"
        self.bridge.start(model, config, name)
        self._grad_accum = max(1, int(args.gradient_accumulation_steps))
        self._wrap_forward(model)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:  # before the scheduler steps: the rate this step used
            self._lr = float(optimizer.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kwargs):
        self._flush()
        self.bridge.close_step()
        if control.should_log:
            # the Trainer's own flow callback (first in the list) asked for a log of this step: on_log follows
            # at once with the step's grad_norm (the norm before clipping); the step is reported there
            self._pending = (state.global_step, self._lr)
        else:
            self.bridge.report(state.global_step, lr=self._lr)

    def on_log(self, args, state, control, logs=None, **kwargs):
        grad_norm = (logs or {}).get("grad_norm")
        self._flush(float(grad_norm) if isinstance(grad_norm, int | float) else None)

    def _flush(self, grad_norm: float | None = None) -> None:
        """Report the step held for its log (if any), with the grad norm that log carried."""
        if self._pending is None:
            return
        (step, lr), self._pending = self._pending, None
        scalars = {} if grad_norm is None else {"grad_norm": grad_norm}
        self.bridge.report(step, lr=lr, **scalars)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._flush()
        # an evaluation's numbers as an "eval" event at the step it followed, as fp8-train sends its own:
        # eval_loss as val_loss (the run page draws it beside the loss), the others without "eval_"
        if self.monitor is None or not metrics:
            return
        numbers = {
            key.removeprefix("eval_"): float(value)
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        if "loss" in numbers:
            numbers["val_loss"] = numbers.pop("loss")
        if numbers:
            self.monitor.event("eval", state.global_step, **numbers)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._flush()
        if model is not None and "forward" in model.__dict__ and hasattr(model.forward, "__fp8scope__"):
            del model.forward  # the class's forward again
        self.bridge.close("finished")

    def _wrap_forward(self, model: nn.Module) -> None:
        forward = model.forward
        bridge, grad_accum = self.bridge, self._grad_accum

        @functools.wraps(forward)
        def fp8scope_forward(*args, **kwargs):
            with bridge.region():
                out = forward(*args, **kwargs)
            loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
            if loss is not None and model.training and loss.requires_grad:
                # training_step's normalisation: a model given num_items_in_batch normalises itself
                bridge.add_loss(loss if "num_items_in_batch" in kwargs else loss / grad_accum)
            return out

        fp8scope_forward.__fp8scope__ = True
        model.forward = fp8scope_forward
