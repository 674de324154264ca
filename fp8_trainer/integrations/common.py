"""What the trainer callbacks share: prepare the model, run its forward in the FP8 region, report once per
optimizer step.

A trainer (Hugging Face, Lightning) owns the loop, so the callbacks cannot put ``fp8_autocast`` around the
forward or call ``monitor.step`` after the optimizer themselves. ``TrainerBridge`` does it from the hooks
they do get:

* ``start(model)``: shadow mode attached, or the model converted with ``convert_to_fp8`` (unless it has
  FP8 layers already), or a torchao model watched; the ``Monitor`` made (every rank makes one; rank 0
  reports, see ``fp8_trainer.monitor.ranks``);
* ``region()``: the forward's context: ``fp8_autocast(step_boundary=False)`` for fp8scope's FP8 layers,
  so the micro-batches of one optimizer step accumulate into one step (amax max, counts summed);
* ``add_loss(loss)``: a micro-batch's loss, summed on the device (no host read) into the step's loss;
* ``step_end(step, lr)``: after the optimizer step: ``end_step(model)`` closes the FP8 step (one amax-history
  entry per optimizer step, whatever ``gradient_accumulation_steps`` is), then ``monitor.step`` reports it
  and applies recipe commands at this boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..autocast import fp8_autocast
from ..convert import convert_to_fp8, ineligible_layers
from ..linear import Linear
from ..shadow import HookedState

__all__ = ["BridgeCallback", "TrainerBridge"]


def _none_converted(model: nn.Module, filtered: bool) -> str:
    """Why the callback's ``convert_to_fp8`` left ``model`` without an FP8 layer, in words."""
    left = ineligible_layers(model)
    what = (
        f"Fp8ScopeCallback(recipe=...): convert_to_fp8 found no layer of {type(model).__name__} to run in FP8"
    )
    if left:
        shown = "; ".join(f"{fqn}: {reason}" for fqn, reason in list(left.items())[:3])
        what += f"; {len(left)} left out ({shown}{'; ...' if len(left) > 3 else ''})"
    if filtered:
        what += "; module_filter_fn accepted none of the others"
    return what + " (nn.Linear and transformers Conv1D layers with features multiples of 16 are converted)"


class TrainerBridge:
    """One training run's monitor and FP8 region, driven by a trainer's callbacks (module docstring)."""

    def __init__(
        self,
        url: str | None,
        run_name: str | None,
        recipe=None,
        shadow=None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        token: str | None = None,
        **monitor_kwargs: Any,
    ):
        if recipe is not None and shadow is not None:
            raise ValueError(
                "recipe, shadow: give one (run in FP8 with recipe, or watch a model with shadow)"
            )
        self.url, self.run_name, self.token = url, run_name, token
        self.recipe, self.shadow, self.module_filter_fn = recipe, shadow, module_filter_fn
        self.monitor_kwargs = monitor_kwargs
        self.monitor = None
        self.model: nn.Module | None = None
        self.fp8 = False
        self._loss: torch.Tensor | None = None

    def start(self, model: nn.Module, config: dict[str, Any], run_name: str) -> None:
        """Prepare ``model`` and register the run (``config``: the trainer's arguments, JSON-able)."""
        from ..monitor import Monitor

        self.model = model
        if self.recipe is not None and not any(isinstance(m, Linear) for m in model.modules()):
            convert_to_fp8(model, recipe=self.recipe, module_filter_fn=self.module_filter_fn)
            if not any(isinstance(m, Linear) for m in model.modules()):
                raise ValueError(_none_converted(model, self.module_filter_fn is not None))
        if self.shadow is not None and self.module_filter_fn is not None:
            from ..shadow import shadow as attach_shadow

            attach_shadow(model, self.shadow, module_filter_fn=self.module_filter_fn)
        self.fp8 = self.recipe is not None
        self.monitor = Monitor(
            self.url,
            self.run_name or run_name,
            model,
            self.recipe,
            token=self.token,
            config=config,
            shadow=self.shadow,
            **self.monitor_kwargs,
        )
        state = getattr(model, "_fp8_state", None)
        if isinstance(state, HookedState):
            state.step_boundary = False  # closed by step_end, once per optimizer step

    def region(self):
        """The context the model's forward runs in."""
        if not self.fp8:
            return contextlib.nullcontext()
        return fp8_autocast(fp8_recipe=self.recipe, step_boundary=False)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's (already normalised) loss to this optimizer step's loss, on the device."""
        loss = loss.detach().to(torch.float32).reshape(())
        self._loss = loss.clone() if self._loss is None else self._loss + loss

    def step_end(self, step: int, lr: float | None = None, **scalars: Any) -> None:
        """After optimizer step ``step`` (1-based): close the FP8 step and report it."""
        self.close_step()
        self.report(step, lr, **scalars)

    def close_step(self) -> None:
        """Close the FP8 step (one amax-history entry per optimizer step); its loss waits for ``report``."""
        state = getattr(self.model, "_fp8_state", None)
        if state is not None and state.n_layers:
            state.end_step()

    def report(self, step: int, lr: float | None = None, **scalars: Any) -> None:
        """Send step ``step`` (closed by ``close_step``) with its loss and ``scalars`` to the monitor, which
        applies recipe commands at this boundary."""
        loss, self._loss = self._loss, None
        if self.monitor is not None:
            self.monitor.step(step, loss=loss, lr=lr, **scalars)

    def close(self, status: str = "finished") -> None:
        if self.monitor is not None:
            self.monitor.close(status)
            self.monitor = None


class BridgeCallback:
    """The constructor and ``monitor`` of the trainer callbacks (Hugging Face, Lightning): each owns one
    ``TrainerBridge``; a trainer's own callback base comes after this one in the class's bases.

    Args:
        url: the monitor service root; ``None``: ``FP8SCOPE_URL``.
        run_name: the run's name; ``None``: the trainer's own name for the run (see each callback).
        recipe: train in FP8 with this recipe (the model is converted with ``convert_to_fp8`` unless it
            has FP8 layers already).
        shadow: keep the model as it is and record FP8 what-if statistics under this recipe.
        module_filter_fn: ``(module, fqn) -> bool``: the layers to convert or shadow (e.g. not ``lm_head``).
        token: bearer token; ``None``: ``FP8SCOPE_TOKEN`` / ``FP8SCOPE_TOKEN_FILE``.
        **monitor_kwargs: passed to ``Monitor`` (``spool_path``, ``fail_fast``, tuning).
    """

    def __init__(
        self,
        url: str | None = None,
        run_name: str | None = None,
        recipe=None,
        shadow=None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        token: str | None = None,
        **monitor_kwargs: Any,
    ):
        self.bridge = TrainerBridge(url, run_name, recipe, shadow, module_filter_fn, token, **monitor_kwargs)
        self._lr: float | None = None  # the learning rate of the optimizer step in progress

    @property
    def monitor(self):
        """The run's ``Monitor`` (``None`` before training starts and after it ends)."""
        return self.bridge.monitor
