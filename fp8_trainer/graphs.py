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

import os
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .convert import get_fp8_state

__all__ = ["GraphedStep", "HostSyncAudit"]


class GraphedStep:
    """``train_step`` run eagerly for its first ``warmup`` calls, then captured in a CUDA graph and replayed.

    Each call is one training step. The warm-up calls run on a side stream, as capture requires (Triton
    compiles, cuBLASLt and the caching allocator settle, the optimizer creates its state, the FP8 buffers
    reach their final form); gradients are set to ``None`` after each, and before capture, so that the
    captured backward writes them. ``output`` is what ``train_step`` returned (static tensors once captured:
    copy what must outlive the next call). The last warm-up call runs under ``HostSyncAudit``: a step that
    synchronises with the host is refused there with the ops named, before any capture.
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

    def _eager(self, audit: bool) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        checker = HostSyncAudit(device_types=("cuda",)) if audit else nullcontext()
        with torch.cuda.stream(side), checker:
            out = self.train_step()
            self._zero_grads()
        torch.cuda.current_stream().wait_stream(side)
        if audit and checker.found:
            # said now, in words, rather than as the capture's "operation not permitted when stream is
            # capturing" from somewhere inside the step
            raise RuntimeError(
                "GraphedStep: train_step makes the host wait for the GPU, which a CUDA graph cannot capture: "
                + checker.report()
            )
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
            # the last warm-up step is checked for host synchronisation: the earlier ones may set things
            # up (an optimizer's state, lazily made buffers) in ways the captured steps never repeat
            self.output = self._eager(audit=self.calls == self.warmup)
            return self.output
        if self.graph is None or self._version != self.state.version:
            self._capture()
        self.graph.replay()
        if self._fp8_steps:
            self.state.replayed()
        return self.output


# ----- host synchronisation audit ---------------------------------------------------------------------

#: ATen ops that make the host wait for the device: a scalar read (``.item()``, ``bool()``, ``float()``, an
#: ``if`` on a tensor), ops whose output size depends on the values, comparisons answered on the host
_SYNC_OPS = {
    "aten._local_scalar_dense": "a tensor read on the host (.item(), bool(), float(), an if on a tensor)",
    "aten.nonzero": "nonzero (its output size depends on the values)",
    "aten.masked_select": "masked_select (its output size depends on the values)",
    "aten.unique_dim": "unique (its output size depends on the values)",
    "aten._unique2": "unique (its output size depends on the values)",
    "aten.unique_consecutive": "unique_consecutive (its output size depends on the values)",
    "aten.equal": "torch.equal (answered on the host)",
    "aten.is_nonzero": "a tensor's truth value",
    "aten.allclose": "torch.allclose (answered on the host)",
}


_COPY_OPS = ("aten._to_copy", "aten.copy_", "aten.copy")


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module: where the step asked for it."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(torch_dir + os.sep):
            return f"{os.path.relpath(path) if path.startswith(os.getcwd()) else path}:{frame.lineno}"
    return "(inside torch)"


class HostSyncAudit(TorchDispatchMode):
    """Records every op dispatched inside it that would make the host wait for the device, which a CUDA
    graph cannot capture (and which stalls an eager GPU step): scalar reads, value-dependent output sizes
    (``nonzero``, indexing with a boolean mask), host-answered comparisons, and copies from the GPU into
    pageable host memory. The same ops are found on the CPU, so a step can be checked there before it
    meets a GPU (copies to the host show only where the source is on a GPU).

        with HostSyncAudit() as audit:
            train_step()
        assert not audit.found, audit.report()

    ``device_types``: count only ops on tensors of these device types (``GraphedStep`` passes
    ``("cuda",)``: reading a CPU tensor on the host is no wait for the GPU and captures fine); by default
    every tensor counts, so that a step run on the CPU is checked as if it ran on a GPU.
    """

    def __init__(self, device_types: tuple[str, ...] | None = None):
        super().__init__()
        self.device_types = device_types
        self.found: list[str] = []  # one entry per offending call, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.replace("::", ".")
        why = self._why(name, args, kwargs)
        if why is not None and self._counted(name, args):
            self.found.append(f"{why} at {_caller()}")
        return func(*args, **kwargs)

    def _counted(self, name: str, args) -> bool:
        """Whether an offending op is on a device this audit counts (a copy always is: its rule already
        asks for a GPU source)."""
        if self.device_types is None or name in _COPY_OPS:
            return True
        subject = args[0] if args else None
        return not isinstance(subject, torch.Tensor) or subject.device.type in self.device_types

    @staticmethod
    def _why(name: str, args, kwargs) -> str | None:
        if name in _SYNC_OPS:
            return f"{name}: {_SYNC_OPS[name]}"
        if name == "aten.index" and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())
        ):
            return "aten.index: indexing with a boolean mask (its output size depends on the values)"
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            return "aten.repeat_interleave without output_size (its output size depends on the values)"
        if name in _COPY_OPS:
            src = args[1] if name != "aten._to_copy" else args[0]
            dst_device = kwargs.get("device") if name == "aten._to_copy" else args[0].device
            if (
                isinstance(src, torch.Tensor)
                and src.device.type != "cpu"
                and dst_device is not None
                and torch.device(dst_device).type == "cpu"
                and not (name != "aten._to_copy" and args[0].is_pinned())
            ):
                return f"{name}: a copy from {src.device} into pageable host memory"
        return None

    def report(self) -> str:
        """The offending ops, each with how many times it was called."""
        counts: dict[str, int] = {}
        for why in self.found:
            counts[why] = counts.get(why, 0) + 1
        return "; ".join(f"{why} (x{n})" if n > 1 else why for why, n in counts.items())
