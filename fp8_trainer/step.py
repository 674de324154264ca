"""The step in progress, on the host: which forwards were recorded, and when the step closes.

An FP8 layer's forward asks ``begin_forward`` what to do before it quantizes anything: this is the one place
that reads the ``fp8_autocast`` region, applies its recipe, closes a step that had no backward, and tells a
checkpoint's recompute from an original forward. It runs inside the layer's FP8 operation (eagerly, and as
the body of the ``fp8scope::linear_forward`` custom operator under ``torch.compile``), never in traced code:
this state changes every step, and a compiled graph must not depend on it.

Per model it does its real work once per region (the first recorded forward of a region closes the previous
step if that one had no backward); per layer it is a few attribute writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .autocast import current_region
from .distributed import resolve_amax_group

if TYPE_CHECKING:
    from .state import FP8State

__all__ = ["StepTracker", "begin_forward", "in_backward"]


def in_backward() -> bool:
    """True while the autograd engine executes a backward pass (in this thread): a forward then is activation
    checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class StepTracker:
    """Where the step in progress stands, as the FP8 layers' forwards and the autograd engine see it (host
    bookkeeping only, never a tensor): the step boundary logic of ``end_step`` (module docstring).

    Activation checkpointing runs a layer's forward a second time inside backward. Each forward that is not
    such a recompute gets the next serial number of its layer; a recompute belongs to its layer's latest
    one, and records only if that forward did not (reentrant checkpointing runs the original under
    ``no_grad``; non-reentrant records the original and skips the recompute).
    """

    pending: bool = False  # statistics recorded since the last end_step
    step_complete: bool = False  # the pending forward belongs to a step_boundary=True region
    region_id: int = -1  # the fp8_autocast region of the pending step's last recorded forward
    last_region: Any = None  # the fp8_autocast region of the last FP8 forward (for checkpoint recomputes)
    forward_serial: dict[int, int] = field(default_factory=dict)  # per layer, its latest original forward
    forward_recorded: set[tuple[int, int]] = field(default_factory=set)  # (layer, serial) in this step
    callback_queued: bool = False  # the end of the running backward pass will close the step

    def original_forward(self, k: int) -> None:
        """Layer ``k`` runs a forward that is not a checkpoint's recompute."""
        self.forward_serial[k] = self.forward_serial.get(k, 0) + 1

    def was_recorded(self, k: int) -> bool:
        """Layer ``k``'s latest original forward was recorded in this step (its recompute is not)."""
        return (k, self.forward_serial.get(k, 0)) in self.forward_recorded

    def mark_recorded(self, k: int) -> None:
        self.forward_recorded.add((k, self.forward_serial.get(k, 0)))

    def closed(self) -> None:
        """The pending step was closed (``end_step``)."""
        self.pending = False
        self.step_complete = False
        self.forward_recorded.clear()

    def queue_end_of_backward(self, on_end) -> None:
        """Have ``on_end`` run when the running backward pass ends, once per pass, if the step is complete."""
        if self.step_complete and not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(on_end)


def begin_forward(state: FP8State, k: int, device: torch.device, record: bool) -> tuple[bool, bool]:
    """Layer ``k`` of ``state`` is about to run a forward on ``device``; ``record``: grad mode is on and an
    operand needs a gradient. ``(fp8, record)``: whether the forward runs in FP8 (an enabled region, or the
    region of the layer's last forward for a checkpoint's recompute, and FP8 on for the layer), and whether it
    records statistics (a recompute only where its original forward did not).

    Moves the state to ``device`` if needed, applies the region's recipe, and opens the step (closing the
    previous one first where it had no backward)."""
    recompute = in_backward()
    tracker = state.tracker
    # a forward inside backward is activation checkpointing's recompute: the original forward's region
    region = tracker.last_region if recompute else current_region()
    if region is None or not region.enabled:
        return False, False
    if state.device != device:
        state.to(device)
    recipe = region.recipe
    if recipe is not None and recipe is not state.recipe:  # the same recipe object: the usual case
        state.set_recipe(recipe)
    tracker.last_region = region
    if not state.enabled[k]:
        return False, False
    if recompute:
        record = record and not tracker.was_recorded(k)  # count a forward once
    else:
        tracker.original_forward(k)
    if record:
        if tracker.pending and tracker.step_complete and tracker.region_id != region.id:
            state.end_step()  # the previous step had no backward: close it now
        if tracker.region_id != region.id or not tracker.pending:
            state.group = resolve_amax_group(region.group, state.reduce_amax)
        tracker.region_id = region.id
        tracker.step_complete = region.step_boundary
        tracker.pending = True
        tracker.mark_recorded(k)
        if recompute:  # queued on the outer backward, not on a reentrant checkpoint's nested one
            tracker.queue_end_of_backward(state.on_backward_end)
    return True, record
