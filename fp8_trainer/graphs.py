"""A whole FP8 training step captured in a CUDA graph and replayed: no host work per layer at all.

Eager, an FP8 Linear costs the host several hundred microseconds per forward+backward (quantize launches,
three ``torch._scaled_mm`` calls with their cuBLASLt set-up, autograd), so a model of many small layers is
bound by the host, not the GPU. Captured once, a step replays as one graph launch.

    step = GraphedStep(train_step, model, optimizer=opt)  # train_step(): forward, backward, optimizer step
    for batch in loader:
        static_x.copy_(batch)       # inputs through tensors the step reads (static addresses)
        loss = step()               # eager for the first calls, then a replay; what train_step returned

What makes the FP8 state replayable (``FP8State.set_capturable``): the end of a step updates the amax
history, scales, step counter and statistics *in place*, so every replay reads and writes the addresses the
capture saw; the host side of a step (its count, the statistics handed to ``StatsReader``s and so to the
monitor) is done by ``GraphedStep`` after each replay, exactly as ``end_step`` does it eagerly. A recipe
change (``set_layer_recipe``, a command from the dashboard), a checkpoint load or a move replaces buffers;
the next call sees the state's ``version`` change and captures again before replaying. A captured step
should close one FP8 step (gradient accumulation with ``step_boundary=False`` on all but the last
micro-batch, the usual way): the statistics a replay hands on are those of the last step it closed. A model
without FP8 layers can be graphed too (the bf16 baseline of ``bench/gpt_throughput.py``).

Rules of CUDA graphs apply to ``train_step``: no host synchronisation (``.item()``, printing a tensor), the
same shapes every call, inputs in tensors that stay put, an optimizer that is capturable
(``torch.optim.AdamW(..., capturable=True)``), ``torch.autocast(..., cache_enabled=False)``. Gradients are
set to ``None`` before capture so the captured backward writes them afresh each replay (do not zero them
inside ``train_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .convert import get_fp8_state

__all__ = ["GraphedStep"]


class GraphedStep:
    """``train_step`` run eagerly for its first ``warmup`` calls, then captured in a CUDA graph and replayed.

    Each call is one training step. The warm-up calls run on a side stream, as capture requires (Triton
    compiles, cuBLASLt and the caching allocator settle, the optimizer creates its state, the FP8 buffers
    reach their final form); gradients are set to ``None`` after each, and before capture, so that the
    captured backward writes them. ``output`` is what ``train_step`` returned (static tensors once captured:
    copy what must outlive the next call).
    """

    def __init__(self, train_step: Callable[[], Any], model: nn.Module, *, warmup: int = 3, optimizer=None):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep: CUDA graphs need a CUDA GPU")
        if warmup < 1:
            raise ValueError(f"warmup: at least one eager step before capture, got {warmup}")
        self.train_step = train_step
        self.model = model
        self.optimizer = optimizer
        self.warmup = warmup
        self.state = get_fp8_state(model)
        self.state.set_capturable(True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None
        self.calls = 0
        self.captures = 0
        self._version = -1
        self._fp8_steps = 0

    def _zero_grads(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p.grad = None

    def _eager(self) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.train_step()
            self._zero_grads()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self) -> None:
        state = self.state
        # the capture runs train_step's Python once, including the host side of end_step; nothing ran on
        # the device, so what that counted is undone afterwards
        steps, boxes = state.steps, [(box, box[0], box[1]) for box in state._inboxes]
        self._zero_grads()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a monitor's background thread may call CUDA meanwhile (it never touches this stream)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.output = self.train_step()
        # FP8 steps the captured step closes: 1 in the usual loop, 0 where no FP8 layer ran (a bf16 model)
        self._fp8_steps = state.steps - steps
        state.steps = steps
        for box, stats, n in boxes:
            box[0], box[1] = stats, n
        self.graph = graph
        self.captures += 1
        self._version = state.version

    def __call__(self) -> Any:
        """One training step: eager during warm-up, else a replay (captured first, or again after the FP8
        state's buffers were replaced)."""
        self.calls += 1
        if self.calls <= self.warmup:
            self.output = self._eager()
            return self.output
        if self.graph is None or self._version != self.state.version:
            self._capture()
        self.graph.replay()
        if self._fp8_steps:
            self.state.replayed()
        return self.output
