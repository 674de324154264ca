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

``torch.compile``: ``Linear.forward`` is ``torch.compiler.disable``d, so a compiled model breaks its graph at
each FP8 Linear and runs the layer exactly as it runs eagerly, while what lies between the layers
(LayerNorm, attention, activations, residual adds, the loss) compiles and fuses. Dynamo does not trace the
runtime's Python state (regions, step tracking, recorded-forward sets): that state changes every step, and
traced, it made every step recompile and trained wrongly. ``fp8_autocast`` may be inside the compiled
function or around its call. ``fullgraph=True`` cannot hold (each layer is a break), and under activation
checkpointing Dynamo runs the frame that calls a checkpointed block holding a break eagerly (for the GPT of
``fp8_trainer.model``: the whole model).

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
from fp8_kernels import has_kernel
from torch import nn

from .autocast import current_region
from .block_linear import _BlockLinearFn
from .distributed import resolve_amax_group
from .gemm import fp8_mm, gemm_operand, uses_scaled_mm
from .state import FP8State

__all__ = ["Conv1D", "Linear", "is_conv1d"]


def is_conv1d(mod: nn.Module) -> bool:
    """A transformers ``Conv1D`` (GPT-2's linear layer, weight stored as (in, out)), without importing it."""
    cls = type(mod)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _in_backward() -> bool:
    """True while the autograd engine executes a backward pass (in this thread)."""
    return torch._C._current_graph_task_id() != -1


def fused_transposes(state: FP8State, k: int, device: torch.device) -> bool:
    """Whether layer ``k``'s quantize calls on ``device`` write the transposed FP8 tensors the backward GEMMs
    need (real FP8 GEMMs, a kernel registered for this layer's scaling mode; see the module docstring)."""
    if not uses_scaled_mm(device):
        return False
    return has_kernel("current_transposed" if state.current[k] else "quantize_transposed", device.type)


def _quantize(state: FP8State, i: int, t: torch.Tensor, record: bool, transpose: bool):
    """``(q, qt or None, scale_inv)``: tensor ``i`` quantized, with its transpose (same pass) if asked."""
    if transpose:
        return state.quantize_transposed(i, t, record)
    q, scale_inv = state.quantize(i, t, record)
    return q, None, scale_inv


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: FP8State, k: int, record: bool, fused_t: bool):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qx, qxt, sinv_x = _quantize(state, 3 * k, x2, record, fused_t and need_wgrad)
        t_w = fused_t and need_dgrad
        qw, qwt, sinv_w = state.quantized_weight(
            k, weight, t_w, record, lambda: _quantize(state, 3 * k + 1, weight, record, t_w)
        )
        ax, aw = gemm_operand(qx), gemm_operand(qw)
        out = fp8_mm(ax, sinv_x, aw.t(), sinv_w, x.dtype, bias, fast_accum=True)  # fprop: as TE does
        # saved: the wgrad operand (tokens, in) and the dgrad operand (out, in), column-major views of the
        # transposes where the quantize pass wrote them
        bx = ax if qxt is None else gemm_operand(qxt).t()
        bw = aw if qwt is None else gemm_operand(qwt).t()
        ctx.save_for_backward(bx, sinv_x, bw, sinv_w)
        ctx.state, ctx.k, ctx.record = state, k, record
        ctx.shape, ctx.x_dtype, ctx.w_dtype = shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        bx, sinv_x, bw, sinv_w = ctx.saved_tensors
        state, k = ctx.state, ctx.k
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        fused_t = ctx.needs_input_grad[1] and fused_transposes(state, k, g2.device)
        qg, qgt, sinv_g = _quantize(state, 3 * k + 2, g2, ctx.record, fused_t)
        ag = gemm_operand(qg)
        if ctx.record:
            state.tracker.queue_end_of_backward(state.on_backward_end)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_mm(ag, sinv_g, bw, sinv_w, ctx.x_dtype).reshape(ctx.shape)
        if ctx.needs_input_grad[1]:
            # (out, tokens) row-major: the transpose written by the quantize pass, if any
            agt = ag.t() if qgt is None else gemm_operand(qgt)
            grad_w = fp8_mm(agt, sinv_g, bx, sinv_x, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


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
        return self.weight

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        weight = self.gemm_weight()
        state = self._fp8_state
        recompute = state is not None and _in_backward()
        # a forward inside backward is activation checkpointing's recompute: the original forward's region
        region = state.tracker.last_region if recompute else current_region()
        if region is None or not region.enabled:
            return F.linear(x, weight, self.bias)
        if state is None:
            state = FP8State([""], device=x.device)
            self._bind(state, 0)
        if state.device != x.device:
            state.to(x.device)
        if region.recipe is not None:
            state.set_recipe(region.recipe)
        tracker = state.tracker
        tracker.last_region = region
        k = self._fp8_index
        if not state.enabled[k]:
            return F.linear(x, weight, self.bias)
        record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if recompute:
            record = record and not tracker.was_recorded(k)  # count a forward once
        else:
            tracker.original_forward(k)
        if record:
            if tracker.pending and tracker.step_complete and tracker.region_id != region.id:
                state.end_step()  # the previous step had no backward: close it now
            tracker.region_id = region.id
            tracker.step_complete = region.step_boundary
            tracker.pending = True
            state.group = resolve_amax_group(region.group, state.reduce_amax)
            tracker.mark_recorded(k)
            if recompute:  # queued on the outer backward, not on a reentrant checkpoint's nested one
                tracker.queue_end_of_backward(state.on_backward_end)
        if state.block_specs[k] is not None:  # MXFP8 or FP8 block scaling (block_linear.py)
            return _BlockLinearFn.apply(x, weight, self.bias, state, k, record)
        # grad mode, not record, decides (a checkpoint's recompute must save what its original forward saved);
        # read here: inside an autograd Function's forward grad mode is always off
        fused_t = torch.is_grad_enabled() and fused_transposes(state, k, x.device)
        return _FP8LinearFn.apply(x, weight, self.bias, state, k, record, fused_t)


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

    def gemm_weight(self) -> torch.Tensor:
        return self.weight.t()
