"""The FP8 Linear's forward and backward, as plain functions and as ``torch.library`` custom operators.

``forward`` quantizes the input and the weight (recording their statistics), runs fprop and returns what
backward needs; ``backward`` quantizes grad_output and runs dgrad, wgrad and the bias gradient (see
``fp8_trainer.linear`` for which operand feeds which GEMM). Both read and write the model's ``FP8State``
(scales, the step's statistics rows, the weight cache, the step tracker) at run time.

Eagerly the ``Linear`` runs them through an ``autograd.Function`` (``FP8LinearFn``): a custom operator's
dispatch costs host time a layer does not need to spend there. Under ``torch.compile`` it calls the custom
operators ``fp8scope::linear_forward`` and ``fp8scope::linear_backward`` (autograd registered with
``torch.library.register_autograd``), which Dynamo and AOTAutograd keep whole: the graph holds one node per
layer and direction, with a fake implementation that gives the output shapes, and everything that changes
from step to step (the step's statistics buffer, the scales, the step bookkeeping) stays out of the graph,
read by the operator's body when it runs. The same functions run either way, so a compiled model computes
exactly what the eager one does.

Why the statistics buffer is not a declared mutated argument: the buffer of a step is replaced when the step
closes (``FP8State.end_step``), and grad_output's row is written in backward; a declared mutation would make
AOTAutograd copy the whole buffer back after every layer, and a graph input mutated in backward is what
AOTAutograd supports least. The operators are tagged ``nondeterministic_seeded`` instead, which keeps the
compiler from merging two calls with equal arguments (each records its own statistics) or recomputing one,
and ``cudagraph_unsafe`` (see ``_TAGS``).

The state is passed to the operators as an integer handle (``FP8State.handle``, looked up in ``_STATES``):
an operator's schema holds tensors and plain values only.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fp8_kernels import generation as dispatch_generation
from fp8_kernels import has_kernel, prepare_quantize

from .gemm import fp8_mm, gemm_operand, is_plain_scaled_mm, uses_scaled_mm
from .step import begin_forward

if TYPE_CHECKING:
    from .state import FP8State

__all__ = [
    "FP8LinearFn",
    "LayerPlan",
    "apply_fp8_linear",
    "backward",
    "forward",
    "fused_transposes",
    "layer_plan",
    "register_state",
]

_STATES: weakref.WeakValueDictionary[int, FP8State] = weakref.WeakValueDictionary()
_handles = itertools.count()


def register_state(state: FP8State) -> int:
    """Make ``state`` reachable from the custom operators by its handle (``FP8State`` calls this)."""
    handle = next(_handles)  # never reused: a compiled graph holds it as a constant
    _STATES[handle] = state
    return handle


def fused_transposes(state: FP8State, k: int, device: torch.device) -> bool:
    """Whether layer ``k``'s quantize calls on ``device`` write the transposed FP8 tensors the backward GEMMs
    need (real FP8 GEMMs, a kernel registered for this layer's scaling mode; see ``fp8_trainer.linear``)."""
    if not uses_scaled_mm(device):
        return False
    return has_kernel("current_transposed" if state.current[k] else "quantize_transposed", device.type)


def _quantize(
    state: FP8State, i: int, t: torch.Tensor, record: bool, transpose: bool, plan: LayerPlan | None = None
):
    """``(q, qt or None, scale_inv)``: tensor ``i`` quantized, with its transpose (same pass) if asked;
    through ``plan``'s prepared call where there is one."""
    if record and plan is not None:
        fast = _prepared_call(state, plan, i, t, transpose, False)
        if fast is not None:
            return fast[:3]
    if transpose:
        return state.quantize_transposed(i, t, record)
    q, scale_inv = state.quantize(i, t, record)
    return q, None, scale_inv


def _quantize_grad(
    state: FP8State, i: int, g2: torch.Tensor, record: bool, transpose: bool, dbias: bool, plan: LayerPlan
):
    """``(q, qt or None, scale_inv, grad_bias or None)``: grad_output quantized, with its column sums (the
    bias gradient) taken by the same pass where asked, as Transformer Engine's cast-transpose-dbias does:
    no second read of grad_output, no launch of its own."""
    if record:
        fast = _prepared_call(state, plan, i, g2, transpose, dbias)
        if fast is not None:
            return fast
    if transpose:
        q, qt, scale_inv, *column_sums = state.quantize_transposed(i, g2, record, dbias=dbias)
    else:
        q, scale_inv, *column_sums = state.quantize(i, g2, record, dbias=dbias)
        qt = None
    return q, qt, scale_inv, column_sums[0] if dbias else None


_UNPREPARED = object()


def _prepared_call(state: FP8State, plan: LayerPlan, i: int, t: torch.Tensor, transpose: bool, dbias: bool):
    """Tensor ``i``'s recording quantize through the prepared call the plan holds for it (made at the first
    such call: ``fp8_kernels.prepare_quantize``): ``(q, qt or None, scale_inv, column sums or None)``, or
    ``None`` where the kernel routed to has no prepared form (the caller then takes the op's full path)."""
    row, scale, scale_inv = state._rows(i)
    key = (i, t.shape, t.dtype, row.shape[0], dispatch_generation())
    fn = plan.prepared.get(key, _UNPREPARED)
    if fn is _UNPREPARED:
        if len(plan.prepared) > 12:  # quality widths or routings gone by
            plan.prepared.clear()
        current = state.current[i // 3]
        op = ("current" if current else "quantize") + ("_transposed" if transpose else "")
        fn = plan.prepared[key] = prepare_quantize(
            op,
            t,
            state.dtypes[i],
            row,
            None if current else scale,
            dbias=dbias,
            power_2_scale=current and state.power_2_scale,
        )
    if fn is None:
        return None
    q, qt, sinv, column_sums = fn(t, scale, row)
    return q, qt, scale_inv if sinv is None else sinv, column_sums


_NOT_PLAIN = object()  # a LayerPlan's GEMM that goes through fp8_mm


@dataclass(slots=True)
class LayerPlan:
    """What layer ``k``'s FP8 forward and backward decide once per input shape and state version
    (``layer_plan``), instead of on every call: which operands the quantize passes transpose, and whether
    the three GEMMs' argument checks have passed (they then run unchecked: the same code makes operands of
    the same layouts, freshly allocated, every call). A GEMM found to be a plain ``torch._scaled_mm`` call
    (``gemm.is_plain_scaled_mm``) is then made directly: its ``*_plain`` field holds the dtype (of the bias
    for fprop, of the output for dgrad and wgrad) the decision was made for, which each call compares."""

    need_dgrad: bool
    need_wgrad: bool
    # forward writes q(input)'s transpose (the wgrad operand); backward, wgrad's other operand, writes
    # q(grad_output)'s under the same condition (transposes fused, weight gradient needed)
    x_t: bool
    w_t: bool  # forward writes q(weight)'s transpose (the dgrad operand)
    fp8_gemms: bool  # real FP8 GEMMs: the quantized tensors are the GEMM operands (``gemm.gemm_operand``)
    fprop_checked: bool = False
    backward_checked: bool = False
    fprop_plain: object = _NOT_PLAIN
    dgrad_plain: object = _NOT_PLAIN
    wgrad_plain: object = _NOT_PLAIN
    # per quantized tensor (and statistics width, routing): its prepared quantize call (``_prepared_call``)
    prepared: dict = field(default_factory=dict)


def layer_plan(state: FP8State, k: int, x2: torch.Tensor, need_dgrad: bool, need_wgrad: bool) -> LayerPlan:
    """Layer ``k``'s plan for a 2-D input like ``x2`` (made at the first such call; see ``LayerPlan``).
    ``need_dgrad`` / ``need_wgrad``: the input / the weight needs a gradient (grad mode on)."""
    key = (k, state.version, x2.shape, x2.dtype, x2.device, need_dgrad, need_wgrad)
    plans = state.linear_plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) > 4 * state.n_layers + 64:  # shapes or versions gone by
            plans.clear()
        fused = (need_dgrad or need_wgrad) and fused_transposes(state, k, x2.device)
        plan = plans[key] = LayerPlan(
            need_dgrad, need_wgrad, fused and need_wgrad, fused and need_dgrad, uses_scaled_mm(x2.device)
        )
    return plan


def _planned_mm(
    plan: LayerPlan,
    field_name: str,
    key: object,
    a: torch.Tensor,
    sinv_a: torch.Tensor,
    b: torch.Tensor,
    sinv_b: torch.Tensor,
    out_dtype: torch.dtype,
    check: bool,
    bias: torch.Tensor | None = None,
    *,
    fast: bool = False,
) -> torch.Tensor:
    """One of the layer's three GEMMs (its ``LayerPlan`` field ``field_name``: ``fprop_plain``,
    ``dgrad_plain`` or ``wgrad_plain``). Once that field holds ``key`` (the bias dtype in fprop, the output
    dtype in dgrad and wgrad) the call is known to be a plain ``torch._scaled_mm`` and is made directly;
    until then it goes through ``fp8_mm``, and the field records ``key`` when the call turns out plain.
    ``fast``: cuBLASLt's fast accumulation (fprop); ``check``: ``fp8_mm``'s argument check."""
    if getattr(plan, field_name) is key:
        return torch._scaled_mm(
            a, b, scale_a=sinv_a, scale_b=sinv_b, bias=bias, out_dtype=out_dtype, use_fast_accum=fast
        )
    out = fp8_mm(a, sinv_a, b, sinv_b, out_dtype, bias, fast_accum=fast, check=check)
    if plan.fp8_gemms and is_plain_scaled_mm(a, b, out_dtype, bias):
        setattr(plan, field_name, key)
    return out


def forward(state, k, x2, weight, bias, record, plan: LayerPlan):
    """fprop of layer ``k`` for a 2-D input: ``(out, saved_x, sinv_x, saved_w, sinv_w)``.

    ``saved_x`` is the wgrad operand: ``q(x)``'s transpose ``(in, tokens)`` as the quantize pass wrote it
    where ``plan.x_t``, else the GEMM operand ``(tokens, in)``; ``saved_w`` likewise the dgrad operand,
    ``(in, out)`` where ``plan.w_t``, else ``(out, in)``."""
    if state.captures and (plan.need_dgrad or plan.need_wgrad):  # a training forward (capture_once)
        state.run_capture(3 * k, x2)
    qx, qxt, sinv_x = _quantize(state, 3 * k, x2, record, plan.x_t, plan)
    t_w = plan.w_t
    qw, qwt, sinv_w = state.quantized_weight(
        k, weight, t_w, record, lambda rec: _quantize(state, 3 * k + 1, weight, rec, t_w, plan)
    )
    ax, aw = (qx, qw) if plan.fp8_gemms else (gemm_operand(qx), gemm_operand(qw))
    bw, bias_dtype = aw.t(), None if bias is None else bias.dtype
    check = not plan.fprop_checked
    # fast accumulation in fprop: as TE
    out = _planned_mm(
        plan, "fprop_plain", bias_dtype, ax, sinv_x, bw, sinv_w, x2.dtype, check, bias, fast=True
    )
    plan.fprop_checked = True
    saved_x = ax if qxt is None else qxt if plan.fp8_gemms else gemm_operand(qxt)
    saved_w = aw if qwt is None else qwt if plan.fp8_gemms else gemm_operand(qwt)
    return out, saved_x, sinv_x, saved_w, sinv_w


def backward(state, k, g2, saved, record, plan: LayerPlan, need_bias, x_dtype, w_dtype):
    """dgrad, wgrad and the bias gradient of layer ``k`` (``None`` where not needed); ``saved`` is forward's
    ``(saved_x, sinv_x, saved_w, sinv_w)`` as ``plan`` had it made."""
    saved_x, sinv_x, saved_w, sinv_w = saved
    if state.captures:
        state.run_capture(3 * k + 2, g2)
    qg, qgt, sinv_g, grad_b = _quantize_grad(state, 3 * k + 2, g2, record, plan.x_t, need_bias, plan)
    ag = qg if plan.fp8_gemms else gemm_operand(qg)
    if record:
        state.tracker.queue_end_of_backward(state.on_backward_end)
    grad_x = grad_w = None
    check = not plan.backward_checked  # dgrad and wgrad: the split accumulator (_scaled_mm's default), as TE
    if plan.need_dgrad:  # (out, in) column-major: the transpose's view where the quantize pass wrote one
        bw = saved_w.t() if plan.w_t else saved_w
        grad_x = _planned_mm(plan, "dgrad_plain", x_dtype, ag, sinv_g, bw, sinv_w, x_dtype, check)
    if plan.need_wgrad:
        # (out, tokens) row-major: the transpose written by the quantize pass, if any
        agt = ag.t() if qgt is None else qgt if plan.fp8_gemms else gemm_operand(qgt)
        bx = saved_x.t() if plan.x_t else saved_x
        grad_w = _planned_mm(plan, "wgrad_plain", w_dtype, agt, sinv_g, bx, sinv_x, w_dtype, check)
    plan.backward_checked = True
    return grad_x, grad_w, grad_b


class FP8LinearFn(torch.autograd.Function):
    """The eager FP8 Linear (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state: FP8State, k: int, record: bool, plan: LayerPlan):
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        out, saved_x, sinv_x, saved_w, sinv_w = forward(state, k, x2, weight, bias, record, plan)
        # the FP8 operands are saved tensors (activation checkpointing and saved-tensor hooks see them, and
        # they are freed when backward has run); the two 0-dim scales ride along with the plain values,
        # which saves their packing and unpacking on every call
        ctx.save_for_backward(saved_x, saved_w)
        shape = None if flat else x.shape
        ctx.meta = (state, k, record, plan, shape, x.dtype, weight.dtype, bias is not None, sinv_x, sinv_w)
        return out if flat else out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        state, k, record, plan, shape, x_dtype, w_dtype, has_bias, sinv_x, sinv_w = ctx.meta
        g2 = grad_output if shape is None else grad_output.reshape(-1, grad_output.shape[-1])
        need_bias = has_bias and ctx.needs_input_grad[2]
        saved_x, saved_w = ctx.saved_tensors
        saved = (saved_x, sinv_x, saved_w, sinv_w)
        grad_x, grad_w, grad_b = backward(state, k, g2, saved, record, plan, need_bias, x_dtype, w_dtype)
        if grad_x is not None and shape is not None:
            grad_x = grad_x.reshape(shape)
        return grad_x, grad_w, grad_b, None, None, None, None


#: ``FP8LinearFn.apply`` without ``torch.autograd.Function.apply``'s Python wrapper: the C++ apply that the
#: wrapper ends in, bound once. The wrapper's own work (binding default arguments for a Function with a
#: ``setup_context``, unwrapping functorch's dead wrappers, routing into functorch) matters only under a
#: functorch transform, where the caller takes ``FP8LinearFn.apply`` instead (``apply_fp8_linear``); the
#: layer saves a few microseconds of host time per forward.
try:
    _bare_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, FP8LinearFn)
    _functorch_active = torch._C._are_functorch_transforms_active
except (AttributeError, KeyError):  # a release without them: the wrapper, always
    _bare_apply, _functorch_active = FP8LinearFn.apply, lambda: False


def apply_fp8_linear(x, weight, bias, state: FP8State, k: int, record: bool, plan: LayerPlan):
    """``FP8LinearFn.apply(...)``, through the bare C++ apply where no functorch transform is active."""
    if _functorch_active():
        return FP8LinearFn.apply(x, weight, bias, state, k, record, plan)
    return _bare_apply(x, weight, bias, state, k, record, plan)


# ----- the custom operators (torch.compile) -----
# nondeterministic_seeded: never merged with an equal call nor recomputed (module docstring);
# cudagraph_unsafe: the body does host work on every call (the step bookkeeping), which a replay would skip,
# so Inductor's CUDA graphs (mode="reduce-overhead") leave these operators out; fp8_trainer.graphs captures a
# whole step and does that host work itself after each replay
_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.cudagraph_unsafe)


@torch.library.custom_op("fp8scope::linear_forward", mutates_args=(), tags=_TAGS)
def linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    handle: int,
    k: int,
    record: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    current: bool,
    x_fp8: torch.dtype,
    w_fp8: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``forward`` with the operator's contract: no output aliases another. A delayed-scaling tensor's
    ``scale_inv`` is a view of the model's scale vector, so for delayed scaling the operator returns empty
    tensors in their place and backward takes them from the state, where they stay until the step closes.
    ``current``, ``x_fp8``, ``w_fp8``: the layer's mode when the graph was traced (Dynamo guards on them; the
    fake implementation's shapes and dtypes follow from them)."""
    state = _STATES[handle]
    _, record = begin_forward(state, k, x.device, record)
    plan = layer_plan(state, k, x, need_dgrad, need_wgrad)
    out, saved_x, sinv_x, saved_w, sinv_w = forward(state, k, x, weight, bias, record, plan)
    if not current:
        sinv_x = sinv_w = None
    return out, saved_x, _scalar_or_empty(sinv_x, x), saved_w, _scalar_or_empty(sinv_w, x)


def _scalar_or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0, dtype=torch.float32)


@linear_forward.register_fake
def _(x, weight, bias, handle, k, record, need_dgrad, need_wgrad, current, x_fp8, w_fp8):
    state = _STATES[handle]
    tokens, n_in = x.shape
    n_out = weight.shape[0]
    fused_t = (need_dgrad or need_wgrad) and fused_transposes(state, k, x.device)
    real = uses_scaled_mm(x.device)
    dx, dw = (x_fp8, w_fp8) if real else (torch.float32, torch.float32)
    saved_x = x.new_empty((n_in, tokens) if fused_t and need_wgrad else (tokens, n_in), dtype=dx)
    saved_w = x.new_empty((n_in, n_out) if fused_t and need_dgrad else (n_out, n_in), dtype=dw)
    scalar = () if current else 0
    sinv_x, sinv_w = (x.new_empty(scalar, dtype=torch.float32) for _ in range(2))
    return x.new_empty((tokens, n_out)), saved_x, sinv_x, saved_w, sinv_w


@torch.library.custom_op("fp8scope::linear_backward", mutates_args=(), tags=_TAGS)
def linear_backward(
    grad: torch.Tensor,
    saved_x: torch.Tensor,
    sinv_x: torch.Tensor,
    saved_w: torch.Tensor,
    sinv_w: torch.Tensor,
    handle: int,
    k: int,
    record: bool,
    x_t: bool,
    w_t: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    need_bias: bool,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state = _STATES[handle]
    if not sinv_x.dim():  # current scaling: forward's; delayed: the state's (see linear_forward)
        saved = (saved_x, sinv_x, saved_w, sinv_w)
    else:
        saved = (saved_x, state.scale_inv_row(3 * k), saved_w, state.scale_inv_row(3 * k + 1))
    key = ("backward", k, state.version, grad.shape, grad.dtype, grad.device, need_dgrad, need_wgrad, x_t)
    plan = state.linear_plans.get(key + (w_t,))
    if plan is None:  # forward's plan, as the graph holds it (its operands' layouts came with the graph)
        plan = LayerPlan(need_dgrad, need_wgrad, x_t, w_t, uses_scaled_mm(grad.device))
        state.linear_plans[key + (w_t,)] = plan
    grads = backward(state, k, grad, saved, record, plan, need_bias, x_dtype, w_dtype)
    # an operator returns tensors: an empty one where a gradient is not needed
    return tuple(g if g is not None else grad.new_empty(0) for g in grads)


@linear_backward.register_fake
def _(
    grad,
    saved_x,
    sinv_x,
    saved_w,
    sinv_w,
    handle,
    k,
    record,
    x_t,
    w_t,
    need_dgrad,
    need_wgrad,
    need_bias,
    x_dtype,
    w_dtype,
):
    tokens, n_out = grad.shape
    n_in = saved_x.shape[0] if x_t else saved_x.shape[1]
    return (
        grad.new_empty((tokens, n_in) if need_dgrad else 0, dtype=x_dtype),
        grad.new_empty((n_out, n_in) if need_wgrad else 0, dtype=w_dtype),
        grad.new_empty(n_out if need_bias else 0),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, handle, k, record, need_dgrad, need_wgrad, *_ = inputs
    _, *saved = output
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(*saved)
    fused_t = (need_dgrad or need_wgrad) and fused_transposes(_STATES[handle], k, x.device)
    ctx.handle, ctx.k, ctx.record = handle, k, record
    ctx.x_t, ctx.w_t = fused_t and need_wgrad, fused_t and need_dgrad
    ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, weight.dtype, bias is not None


def _backward(ctx, grad_out, *_saved_grads):
    need = ctx.needs_input_grad
    need_bias = ctx.has_bias and need[2]
    grad_x, grad_w, grad_b = linear_backward(
        grad_out,
        *ctx.saved_tensors,
        ctx.handle,
        ctx.k,
        ctx.record,
        ctx.x_t,
        ctx.w_t,
        need[0],
        need[1],
        need_bias,
        ctx.x_dtype,
        ctx.w_dtype,
    )
    return (
        grad_x if need[0] else None,
        grad_w if need[1] else None,
        grad_b if need_bias else None,
        *(None,) * 8,
    )


torch.library.register_autograd("fp8scope::linear_forward", _backward, setup_context=_setup_context)
