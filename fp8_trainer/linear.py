"""FP8 ``Linear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8.

How input, weight and grad_output map to the three GEMMs (``x`` flattened to ``(tokens, in_features)``):

    forward   output      = q(input)       @ q(weight)^T    fprop, input and weight E4M3 (HYBRID)
    backward  grad_input  = q(grad_output) @ q(weight)      dgrad, grad_output E5M2 (HYBRID)
              grad_weight = q(grad_output)^T @ q(input)     wgrad
              grad_bias   = grad_output.sum(0)              high precision

Each tensor is quantized exactly once per use (the weight and input quantized in forward are saved for
backward), and its statistics are recorded in the same call. Bias and output are in the input's dtype;
the GEMMs accumulate in float32.

Operand layouts (real FP8 GEMMs, ``gemm.py``): ``torch._scaled_mm`` takes a row-major first and a
column-major second operand. fprop gets both from ``q(input)`` and ``q(weight)`` as they are, but dgrad
needs ``q(weight)`` and wgrad ``q(input)`` and ``q(grad_output)`` in the other layout, i.e. their transposes
stored contiguously. Where a Triton kernel is registered, the quantize pass writes that transpose beside
``q`` (one extra write instead of a later read-and-write copy), and forward saves only the transposes it
will need; elsewhere the GEMM wrapper copies as before. The CPU emulation has no layout constraint and
never asks for transposes.

Activation checkpointing (``torch.utils.checkpoint``, both ``use_reentrant`` modes): the recompute runs
inside backward, where no ``fp8_autocast`` region is active (and, on a GPU, on an autograd worker thread). A
forward that runs while the autograd engine executes a backward is such a recompute: it runs under the region
of the layer's last forward, so in FP8 with the same recipe and, the step not being closed yet, the same
scales, bit for bit the original forward. Its statistics count once per step: a recompute records the
input and weight only when the original forward did not (reentrant mode runs that one under ``no_grad``);
grad_output is recorded by whichever backward runs. In reentrant mode the gradient of the checkpointed
region is a nested backward pass; the end-of-step callback is queued from the recompute, on the outer pass,
so that the step closes when the whole backward ends.

``torch.compile``: traced, ``forward`` reads only the layer's mode (FP8 on for the region and the layer,
per-tensor or block scaling, formats), on which Dynamo guards, and calls the custom operators
``fp8scope::linear_forward`` / ``linear_backward`` (``linear_ops.py``); everything that changes per step (the
step's statistics buffer, scales, the step bookkeeping of ``step.begin_forward``) is read when the operator
runs, never traced. So a model compiles as one graph (``fullgraph=True``), with or without activation
checkpointing, once: a later step recompiles only when a layer's mode changes (a recipe command), and the
compiled model computes exactly what the eager one does. ``fp8_autocast`` goes around the compiled call;
inside a compiled function it is a graph break (the region is entered eagerly), which ``fullgraph=True``
refuses. Under compile the region's mode is read from ``autocast.fp8_traced_enabled`` (the last region
entered or left, in any thread); a region recipe that turns a layer's FP8 off or to block scaling takes
effect from the layer's next forward (the re-traced graph). Block-scaled layers keep a graph break
(``_untraced_forward``) and run as they do eagerly.

Block-scaled layers (``scaling`` ``"mxfp8"`` or ``"block"``) run ``block_linear._BlockLinearFn`` instead:
the same three GEMMs on block-scaled copies (see that module for which copy feeds which GEMM).

Checkpoints: each layer's slice of the model's scaling state (amax histories, scales, recipe overrides, step
counter) is its module extra state, so ``model.state_dict()`` / ``load_state_dict`` carry it (see
``FP8State.layer_extra_state``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .autocast import fp8_traced_enabled, is_fp8_enabled
from .block_linear import _BlockLinearFn
from .linear_ops import apply_fp8_linear, fused_transposes, layer_plan
from .state import FP8State
from .step import begin_forward
from .tensor_parallel import DTensor, tp_forward

__all__ = ["Conv1D", "Linear", "fused_transposes", "is_conv1d"]

# whether any device's autocast is on: one global read, where ``torch.is_autocast_enabled(device type)``
# costs a device object and a lookup per call (older releases lack it: ask the device then)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def is_conv1d(mod: nn.Module) -> bool:
    """A transformers ``Conv1D`` (GPT-2's linear layer, weight stored as (in, out)), without importing it."""
    cls = type(mod)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


class Linear(nn.Linear):
    """``torch.nn.Linear`` that runs in FP8 inside ``fp8_autocast``.

    ``in_features`` and ``out_features`` must be multiples of 16 (FP8 GEMM constraint); the token
    dimension may be anything. Outside ``fp8_autocast`` (or with FP8 turned off for this layer) it is a
    plain ``F.linear`` in the input's precision. Build models with ``convert_to_fp8``, which registers the
    layers' tensors with stable indices; a Linear used on its own gets a one-layer state at first use.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        if in_features % 16 or out_features % 16:
            raise ValueError(
                f"in_features/out_features: FP8 GEMMs need multiples of 16, got {in_features}x{out_features}"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._fp8_state: FP8State | None = None
        self._fp8_index = 0

    @classmethod
    def from_linear(cls, mod: nn.Linear) -> Linear:
        """A ``Linear`` sharing ``mod``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def _bind(self, state: FP8State, index: int) -> None:
        self._fp8_state, self._fp8_index = state, index

    def _state(self) -> FP8State:
        """The bound state; a Linear used on its own gets a one-layer state, as at its first FP8 forward."""
        if self._fp8_state is None:
            device = self.weight.device if self.weight.device.type != "meta" else None
            self._bind(FP8State([""], device=device), 0)
        return self._fp8_state

    def get_extra_state(self) -> dict[str, Any]:
        """This layer's slice of the FP8 scaling state, saved under ``<module path>._extra_state``."""
        return self._state().layer_extra_state(self._fp8_index)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # check before the weights are copied in place: a pending backward still needs the old ones
        if self._fp8_state is not None:
            self._fp8_state.check_not_pending(prefix[:-1] or "<root>")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_extra_state(self, state: Any) -> None:
        """Restore the slice saved by ``get_extra_state`` (call ``convert_to_fp8`` before loading)."""
        self._state().load_layer_extra_state(self._fp8_index, state)

    def gemm_weight(self) -> torch.Tensor:
        """The weight as the GEMMs take it, ``(out_features, in_features)``."""
        return self._gemm_view(self.weight)

    @staticmethod
    def _gemm_view(weight: torch.Tensor) -> torch.Tensor:
        """``gemm_weight`` of the stored ``weight``: the weight itself (``Conv1D``: its transpose)."""
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # host time per call matters here (bench/host_path.py): the weight is read once, and the device's
        # autocast state only where some autocast is on
        weight = self.weight
        if isinstance(weight, DTensor):  # tensor parallelism: fp8_trainer.tensor_parallel
            return tp_forward(self, x)
        if torch.compiler.is_compiling():
            return self._traced_forward(x)
        if _any_autocast() and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        weight = self._gemm_view(weight)
        state = self._fp8_state
        if state is None:
            if not is_fp8_enabled():
                return F.linear(x, weight, self.bias)
            state = self._state()
        record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        fp8, record = begin_forward(state, self._fp8_index, x.device, record)
        if not fp8:
            return F.linear(x, weight, self.bias)
        k = self._fp8_index
        if state.block_specs[k] is not None:  # MXFP8 or FP8 block scaling (block_linear.py)
            out = _BlockLinearFn.apply(x, weight, self.bias, state, k, record)
            if state.captures and torch.is_grad_enabled():  # FP8State.capture_once
                state.run_capture(3 * k, x)
                if 3 * k + 2 in state.captures and out.requires_grad:
                    out.register_hook(state.captures.pop(3 * k + 2))
            return out
        # grad mode, not record, decides (a checkpoint's recompute must save what its original forward saved);
        # read here: inside an autograd Function's forward grad mode is always off
        grad = torch.is_grad_enabled()
        plan = layer_plan(state, k, x, grad and x.requires_grad, grad and weight.requires_grad)
        return apply_fp8_linear(x, weight, self.bias, state, k, record, plan)

    def _traced_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` as ``torch.compile`` traces it: the layer's mode (FP8 or not, per-tensor or block
        scaling, formats) is read here and guarded by Dynamo; the step's state is read by the custom
        operator when it runs (``fp8_trainer.linear_ops``)."""
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        weight = self.gemm_weight()
        state, k = self._fp8_state, self._fp8_index
        if not fp8_traced_enabled() or (state is not None and not state.enabled[k]):
            return F.linear(x, weight, self.bias)
        if state is None or state.block_specs[k] is not None or state.device != x.device:
            return self._untraced_forward(x)  # a graph break: see the module docstring
        grad = torch.is_grad_enabled()
        need_dgrad, need_wgrad = grad and x.requires_grad, grad and weight.requires_grad
        shape = x.shape
        out, *_ = torch.ops.fp8scope.linear_forward(
            x.reshape(-1, shape[-1]),
            weight,
            self.bias,
            state.handle,
            k,
            need_dgrad or need_wgrad,
            need_dgrad,
            need_wgrad,
            state.current[k],
            state.dtypes[3 * k],
            state.dtypes[3 * k + 1],
        )
        return out.reshape(*shape[:-1], out.shape[-1])

    @torch.compiler.disable
    def _untraced_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class Conv1D(Linear):
    """A transformers ``Conv1D`` (GPT-2's linear layer) in FP8: its weight stays stored ``(in, out)``, as
    checkpoints and optimizers hold it, and the GEMMs take its transpose, a view (``gemm_weight``); otherwise
    exactly an FP8 ``Linear`` (the same three GEMMs, statistics and weight copy rule: a view of a
    parameter is kept like the parameter). ``convert_to_fp8`` makes one from each transformers ``Conv1D``."""

    @classmethod
    def from_conv1d(cls, mod: nn.Module) -> Conv1D:
        """An FP8 ``Conv1D`` sharing ``mod``'s parameters (no copy); ``mod.weight`` is ``(in, out)``."""
        in_features, out_features = mod.weight.shape
        with torch.device("meta"):
            new = cls(in_features, out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    @staticmethod
    def _gemm_view(weight: torch.Tensor) -> torch.Tensor:
        return weight.t()
