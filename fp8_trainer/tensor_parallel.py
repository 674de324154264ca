"""Tensor parallelism (``torch.distributed.tensor.parallel``) for the FP8 ``Linear``.

``parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})`` on a model converted
by ``convert_to_fp8`` makes the layers' weights DTensors (``Shard(0)`` column-wise, ``Shard(1)`` row-wise) and
hands their forwards DTensor inputs (``Replicate`` column-wise, ``Shard(-1)`` row-wise). The FP8 ``Linear``
sees a DTensor weight and comes here (``tp_forward``): it takes the local shards, runs its three GEMMs on them
in FP8 and returns the DTensor an ``nn.Linear`` would (``Shard(-1)`` column-wise; ``Partial`` row-wise, plus
the replicated bias), which the style then redistributes as it does for ``nn.Linear``.

Which tensors are sharded: column-wise the weight and grad_output (the input is replicated), row-wise the
input and the weight (grad_output is replicated). A replicated tensor is the same on every rank of the group;
a sharded one is held in pieces, and for these:

* **scales**: delayed scaling takes the scale from the amax history, which the step's end fills from every
  rank's amaxes (the statistics merge below gives each rank the whole tensor's amax before the history is
  updated, whatever ``reduce_amax`` says). Current scaling takes ``FP8_MAX / amax`` with the amax of the whole
  tensor: each rank's shard amax, one all-reduce (MAX) over the TP group, then the cast (``_CurrentTPFn``);
* **statistics**: each rank records its shard's row as usual; at the step's end the rows of the sharded
  tensors are all-gathered over the TP group (one collective for all of them) and merged as micro-batches
  are (``merge_step_stats``: amax the max, counts, numel and sums of squares summed, ``min_abs`` the min), so
  every rank holds the whole tensor's row (a hook in the state's ``before_step_end``, added by the first
  TP forward: ``_register``). Replicated tensors' rows are left as they are: every rank holds the same tensor.

With FSDP2 on a 2-D ``(dp, tp)`` mesh (``parallelize_module`` over ``mesh["tp"]``, then ``fully_shard``
over ``mesh["dp"]``), FSDP2 stores the weight on both dimensions and, when it unshards it over dp, hands the
layer the DTensor ``parallelize_module`` made (the 1-D tp mesh, ``Shard(0)`` / ``Shard(1)``): this path runs
as it is.

Not supported (clear errors): block-scaled recipes (MXFP8, FP8 block scaling), a weight on a mesh of more
than one dimension, weights sharded other than ``Shard(0)`` / ``Shard(1)``, transposed-weight layers
(``Conv1D``), the FP8 all-gather of ``fp8_trainer.fsdp`` on tensor-parallel weights.
Under ``torch.compile`` the layer's TP forward runs eagerly (a graph break).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fp8_kernels import current_scale_reference, quantize_with_stats, tensor_amax

from .distributed import all_reduce_amax
from .gemm import fp8_mm, gemm_operand
from .linear_ops import FP8LinearFn, layer_plan
from .merge import merge_step_stats
from .step import begin_forward
from .weight_cache import PreQuantizedWeight

if TYPE_CHECKING:
    from .state import FP8State

__all__ = ["DTensor", "leads_tp_group", "sharded_tensors", "tp_forward"]


class _Sharded:
    """Per model state: the TP group and the indices of the tensors whose statistics rows are shards."""

    def __init__(self, group):
        self.group = group
        self.rows: set[int] = set()


_SHARDED: weakref.WeakKeyDictionary[FP8State, _Sharded] = weakref.WeakKeyDictionary()


def sharded_tensors(state: FP8State) -> list[int]:
    """The indices of ``state``'s tensors seen sharded by a TP forward (rows merged at the step's end)."""
    info = _SHARDED.get(state)
    return sorted(info.rows) if info is not None else []


def leads_tp_group(state: FP8State) -> bool:
    """Whether this rank's statistics rows stand for its tensor-parallel group: True on the group's first
    rank and wherever no TP forward has run. After the step's end the group's ranks hold the same rows (the
    sharded ones merged, the replicated ones alike), so a reduction over ranks counts one of them."""
    info = _SHARDED.get(state)
    return info is None or dist.get_rank(info.group) == 0


def _register(state: FP8State, group, rows: tuple[int, ...]) -> None:
    info = _SHARDED.get(state)
    if info is None:
        info = _SHARDED[state] = _Sharded(group)
        if _merge_sharded not in state.before_step_end:  # a deep copy of a state carries the hook already
            state.before_step_end.append(_merge_sharded)
    elif info.group is not group and dist.get_process_group_ranks(info.group) != dist.get_process_group_ranks(
        group
    ):
        raise NotImplementedError("tensor parallelism: all FP8 layers of a model must share one TP mesh")
    info.rows.update(rows)


def _merge_sharded(state: FP8State) -> None:
    """``FP8State.before_step_end`` hook: the sharded tensors' rows merged before the step's amaxes are."""
    info = _SHARDED.get(state)
    if info is not None:
        _merge_rows(state, info)


def _merge_rows(state: FP8State, info: _Sharded) -> None:
    """Every sharded tensor's statistics row, merged over the TP group (one all-gather), in place."""
    index = sorted(info.rows)
    rows = state.stats[index].contiguous()
    world = dist.get_world_size(info.group)
    gathered = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(gathered, rows, group=info.group)
    merged = gathered[0]
    for other in gathered[1:]:
        merged = merge_step_stats(merged, other)
    state.stats[index] = merged


def _dim(p, ndim: int) -> int | None:
    return p.dim % ndim if isinstance(p, Shard) else None


def tp_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """The FP8 ``Linear``'s forward for a DTensor weight (module docstring)."""
    if torch.compiler.is_compiling():
        return _untraced(layer, x)
    weight = layer.gemm_weight()
    if weight is not layer.weight:
        raise NotImplementedError(
            "tensor parallelism: transposed-weight FP8 layers (Conv1D) are not supported; the parallel "
            "styles shard their stored (in, out) weight as an nn.Linear's (out, in)"
        )
    if not isinstance(weight, DTensor):
        raise TypeError("tensor parallelism: a DTensor input needs the layer's weight to be a DTensor too")
    local = weight._local_tensor
    if isinstance(local, PreQuantizedWeight) or hasattr(local, "fsdp_pre_all_gather"):
        # the FP8 all-gather casts the dp shard with the weight's scale but knows nothing of the tp shards
        raise NotImplementedError(
            "tensor parallelism: the FP8 all-gather (fp8_trainer.fsdp.enable_fp8_all_gather) is not "
            "supported on tensor-parallel weights; shard them with fully_shard's high-precision all-gather"
        )
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(f"tensor parallelism: a 1-D device mesh only, got {mesh.ndim} dimensions")
    if torch.is_autocast_enabled(weight.device.type):
        x = x.to(torch.get_autocast_dtype(weight.device.type))
    w_dim = _dim(weight.placements[0], 2)
    if w_dim is None:
        raise NotImplementedError(
            f"tensor parallelism: FP8 Linear weights sharded Shard(0) (ColwiseParallel) or Shard(1) "
            f"(RowwiseParallel) only, got {weight.placements}"
        )
    colwise = w_dim == 0
    want = Replicate() if colwise else Shard(x.dim() - 1)
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (want,), run_check=False)
    elif _dim(x.placements[0], x.dim()) != _dim(want, x.dim()):
        x = x.redistribute(mesh, (want,))
    bias = layer.bias
    state = layer._fp8_state
    if state is None:
        from .autocast import is_fp8_enabled

        if not is_fp8_enabled():
            return F.linear(x, weight, bias)
        state = layer._state()
    record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    fp8, record = begin_forward(state, layer._fp8_index, x.device, record)
    if not fp8:
        return F.linear(x, weight, bias)
    k = layer._fp8_index
    if state.block_specs[k] is not None:
        raise NotImplementedError(
            f"tensor parallelism: block-scaled recipes (MXFP8, FP8 block scaling) are not supported under TP "
            f"(layer {state.layer_names[k] or '<root>'!r}); use DelayedScaling or CurrentScaling"
        )
    group = mesh.get_group()
    # column-wise: weight and grad_output are shards; row-wise: input and weight
    sharded = (False, True, True) if colwise else (True, True, False)
    _register(state, group, tuple(3 * k + r for r in range(3) if sharded[r]))
    # the local input's gradient: a partial sum column-wise (each rank holds some output features)
    x_local = x.to_local(grad_placements=(Partial(),) if colwise else None)
    w_local = weight.to_local()
    b_local = bias.to_local() if colwise and bias is not None else None
    grad = torch.is_grad_enabled()
    if state.current[k]:
        out = _CurrentTPFn.apply(x_local, w_local, b_local, state, k, record, group, sharded)
    else:
        plan = layer_plan(state, k, x_local, grad and x.requires_grad, grad and weight.requires_grad)
        out = FP8LinearFn.apply(x_local, w_local, b_local, state, k, record, plan)
    if colwise:
        return DTensor.from_local(out, mesh, (Shard(out.dim() - 1),), run_check=False)
    out = DTensor.from_local(out, mesh, (Partial(),), run_check=False)
    return out if bias is None else out + bias


@torch.compiler.disable
def _untraced(layer, x: torch.Tensor) -> torch.Tensor:
    return tp_forward(layer, x)


def _quantize_current(state: FP8State, i: int, t: torch.Tensor, record: bool, group):
    """Tensor ``i`` cast with ``FP8_MAX / amax``, the amax the whole tensor's (reduced over ``group`` for a
    shard, ``None`` for a replicated tensor): ``(q, scale_inv)``, the statistics into row ``i`` if
    ``record``."""
    dtype = state.dtypes[i]
    amax = tensor_amax(t)
    if group is not None:
        amax = all_reduce_amax(amax, group)
    scale = current_scale_reference(amax, dtype, power_2_scale=state.power_2_scale)
    q, _ = quantize_with_stats(t, scale, dtype, state.stats[i] if record else None, amax=amax)
    return q, torch.reciprocal(scale)


class _CurrentTPFn(torch.autograd.Function):
    """The FP8 Linear on local shards with current scaling: as ``linear_ops.forward`` / ``backward``, the
    sharded tensors' amaxes reduced over the TP group before their scales are computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, state: FP8State, k: int, record: bool, group, sharded):
        x2 = x.reshape(-1, x.shape[-1])
        groups = tuple(group if s else None for s in sharded)
        qx, sinv_x = _quantize_current(state, 3 * k, x2, record, groups[0])

        def quantize_weight(rec: bool):
            return _quantize_current(state, 3 * k + 1, weight, rec, groups[1])

        qw, sinv_w = state.quantized_weight(k, weight, "tp-current", record, quantize_weight)
        ax, aw = gemm_operand(qx), gemm_operand(qw)
        out = fp8_mm(ax, sinv_x, aw.t(), sinv_w, x2.dtype, bias, fast_accum=True)
        ctx.save_for_backward(ax, sinv_x, aw, sinv_w)
        ctx.meta = (state, k, record, groups[2], x.shape, x.dtype, weight.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        state, k, record, group, shape, x_dtype, w_dtype = ctx.meta
        ax, sinv_x, aw, sinv_w = ctx.saved_tensors
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        qg, sinv_g = _quantize_current(state, 3 * k + 2, g2, record, group)
        if record:
            state.tracker.queue_end_of_backward(state.on_backward_end)
        ag = gemm_operand(qg)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = fp8_mm(ag, sinv_g, aw, sinv_w, x_dtype).reshape(shape) if need_x else None
        grad_w = fp8_mm(ag.t(), sinv_g, ax, sinv_x, w_dtype) if need_w else None
        grad_b = g2.sum(0, dtype=torch.float32).to(g2.dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None
