"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with the FP8 weights cast *before* the all-gather.

Without this module an FP8 model wrapped in ``fully_shard`` all-gathers its weights in high precision and
quantizes the gathered weight on every rank. ``enable_fp8_all_gather(model)``, called after
``convert_to_fp8`` and before ``fully_shard``, makes each per-tensor-scaled FP8 ``Linear``'s weight an
``FP8ShardedWeight``: FSDP2 then calls its ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (FSDP2's
all-gather extension), and per weight and forward:

1. the scale is the one an unsharded run would use. Delayed scaling: the weight's scale in the model's
   ``FP8State`` (the same on every rank: the amaxes are all-reduced at the step's end). Current scaling:
   ``FP8_MAX / amax`` of the whole weight, the amax an all-reduce (MAX) of the shards' amaxes over the FSDP
   group (NaN read as +Inf, as ``fp8_trainer.distributed.all_reduce_amax`` does);
2. each rank quantizes its own shard with that scale (in ``MixedPrecisionPolicy.param_dtype`` first, as
   the high-precision all-gather would hand it to the layer), recording the shard's statistics;
3. the all-gather moves the FP8 bytes (as ``uint8``: one byte per element, half of bf16's);
4. the gathered weight (``FP8GatheredWeight``) holds the FP8 tensor and its ``scale_inv``; the FP8
   ``Linear`` takes them as they are (``FP8State.quantized_weight``) instead of quantizing again.

Statistics: in a recording forward (grad mode on, not inside backward) the shards' statistics rows are
all-gathered (one small collective per weight) and merged (``merge_step_stats``: amax the max, counts and
numel summed, ``min_abs`` the min), so the weight's row is the whole weight's, as an unsharded run records
it: amax and counts exactly, the sums of squares to float64 rounding. The row is written into the step's
statistics once per step, by the layer's first recording forward (as the weight cache does unsharded).

The gradient reduce-scatter is FSDP2's own, in the reduce dtype (high precision): only the all-gather is
FP8. Outside ``fp8_autocast``, for a layer whose FP8 is off and for block-scaled recipes (MXFP8, FP8 block
scaling: their scales follow blocks that a row shard does not hold whole), the weight is all-gathered in
high precision. Switching between the two resets the parameter's all-gather buffers (their dtype is fixed
by FSDP2 at the first all-gather); the all-gather inside backward reuses the mode of the forward.

Eager only for now: under ``torch.compile`` the FP8 ``Linear``'s traced path hands the weight to the
``fp8scope::linear_forward`` operator, which cannot take a gathered weight; ``FP8GatheredWeight`` refuses
to be traced with a message saying so.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from fp8_kernels import current_scale_reference, new_stats, quantize_with_stats, tensor_amax

from .autocast import current_region
from .distributed import all_reduce_amax
from .linear import Linear
from .merge import merge_step_stats
from .step import in_backward
from .weight_cache import PreQuantizedWeight

__all__ = ["FP8GatheredWeight", "FP8ShardedWeight", "enable_fp8_all_gather"]

_aten = torch.ops.aten

# FSDP2 shards, pads and copies the weight with these; their results stay sharded weights
_KEEP_SUBCLASS = {
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.new_empty.default,
    _aten.slice.Tensor,
    _aten.narrow.default,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.chunk.default,
    _aten.clone.default,
    _aten.alias.default,
}


@dataclass
class _Gather:
    """What the last all-gather of one layer's weight was: ``fp8`` (else high precision), the FSDP2
    parameter (found once, for a reset when the mode changes)."""

    fp8: bool | None = None
    fsdp_param: Any = None


_GATHERS: weakref.WeakKeyDictionary[nn.Module, _Gather] = weakref.WeakKeyDictionary()


def enable_fp8_all_gather(model: nn.Module) -> list[str]:
    """Make every FP8 ``Linear`` weight of ``model`` (converted by ``convert_to_fp8``) all-gather in FP8 under
    ``fully_shard``; call it before ``fully_shard`` and before making the optimizer (the weights become new
    ``Parameter`` objects holding the same data). Transposed-weight layers (``Conv1D``) and weights shared
    with another module (a tied embedding, which must stay one parameter) keep the high-precision
    all-gather. Returns the names of the layers changed."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    changed = []
    for name, mod in model.named_modules():
        if type(mod) is not Linear or isinstance(mod.weight, FP8ShardedWeight) or seen[id(mod.weight)] > 1:
            continue
        w = mod.weight
        if isinstance(w, DTensor):
            raise NotImplementedError(
                f"enable_fp8_all_gather: layer {name!r} has a DTensor weight (tensor parallelism or an "
                "earlier fully_shard); the FP8 all-gather is not supported there: shard tensor-parallel "
                "weights with fully_shard's high-precision all-gather, and call this before fully_shard"
            )
        mod.weight = nn.Parameter(FP8ShardedWeight(w.data), requires_grad=w.requires_grad)
        changed.append(name)
    return changed


def _fp8_mode(module: nn.Module) -> bool:
    """Whether ``module``'s weight is gathered in FP8 now: as ``step.begin_forward`` will decide (an enabled
    region, its recipe applied, FP8 on for the layer, per-tensor scaling)."""
    state = getattr(module, "_fp8_state", None)
    region = current_region()
    if state is None or region is None or not region.enabled:
        return False
    if region.recipe is not None:
        state.set_recipe(region.recipe)
    k = module._fp8_index
    return bool(state.enabled[k]) and state.block_specs[k] is None


def _find_fsdp_param(module: nn.Module):
    # FSDP2 keeps each fully_shard'ed module's state in this mapping; its param groups hold the parameters
    from torch.distributed._composable_state import _module_state_mapping

    for ref in list(_module_state_mapping.values()):
        group = getattr(ref(), "_fsdp_param_group", None)
        for fp in group.fsdp_params if group is not None else ():
            if fp._module_info.module is module and fp._module_info.param_name == "weight":
                return fp
    raise RuntimeError("fp8 all-gather: no FSDP2 parameter found for this layer's weight")


def _reset_buffers(module: nn.Module, gather: _Gather) -> None:
    """Forget the all-gather buffers and the unsharded parameter of ``module``'s weight: FSDP2 makes them
    anew, of the new mode's dtype, at the next all-gather."""
    if gather.fsdp_param is None:
        gather.fsdp_param = _find_fsdp_param(module)
    fp = gather.fsdp_param
    fp.all_gather_outputs = []
    fp._unsharded_inner_tensors = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param


class FP8ShardedWeight(torch.Tensor):
    """A weight (or FSDP2's shard of it) in high precision, that FSDP2 all-gathers in FP8 (module
    docstring). Every op but the few FSDP2 shards and copies with returns a plain tensor."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"FP8ShardedWeight({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8ShardedWeight(inner["_tensor"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is _aten.detach.default:
            return FP8ShardedWeight(args[0]._tensor.detach())
        args, kwargs = pytree.tree_map_only(FP8ShardedWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, FP8ShardedWeight, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        param_dtype = mp_policy.param_dtype or self.dtype
        w = self._tensor.to(param_dtype)
        # the padded shard: FSDP2 pads an uneven last shard with rows of zeros
        world = mesh.size()
        rows = -(-outer_size[0] // world)
        if w.shape[0] != rows:
            w = torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])
        gather = _GATHERS.setdefault(module, _Gather())
        backward = in_backward()
        # inside backward (reshard_after_forward) the weight is gathered again as its forward had it
        fp8 = gather.fp8 if backward and gather.fp8 is not None else _fp8_mode(module)
        if gather.fp8 is not None and fp8 != gather.fp8:
            _reset_buffers(module, gather)
        gather.fp8 = fp8
        if not fp8:
            return (w,), None
        state, k = module._fp8_state, module._fp8_index
        if state.device != w.device:  # as the layer's forward would, before it reads a scale
            state.to(w.device)
        i = 3 * k + 1
        dtype = state.dtypes[i]
        group = mesh.get_group()
        if state.current[k]:
            amax = all_reduce_amax(tensor_amax(self._tensor), group)  # the whole weight's
            scale = current_scale_reference(amax, dtype, power_2_scale=state.power_2_scale)
        else:
            amax, scale = None, state.scale[i].clone()
        # FSDP2 all-gathers under no_grad: whether the forward records is the layer's to say; the statistics
        # are ready for every forward (the all-gather of backward's reshard is never recorded)
        record = not backward
        row = None
        if record:
            row = new_stats(device=w.device, quality=state.stats.shape[1] > 6)
        shard = self._tensor.to(param_dtype)  # statistics of the real rows only, not the padding
        q_shard, _ = quantize_with_stats(shard, scale, dtype, row, amax=amax)
        if q_shard.shape[0] != rows:
            q_shard = torch.cat([q_shard, q_shard.new_zeros(rows - q_shard.shape[0], *q_shard.shape[1:])])
        if record:
            rows_all = [torch.empty_like(row) for _ in range(world)]
            dist.all_gather(rows_all, row, group=group)
            row = rows_all[0].unsqueeze(0)
            for other in rows_all[1:]:
                row = merge_step_stats(row, other.unsqueeze(0))
            row = row[0]
        return (q_shard.view(torch.uint8),), (torch.reciprocal(scale), dtype, row)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if metadata is None:  # high precision: the all-gather output is the weight
            if out is not None:
                return None
            return data, (data,)
        scale_inv, dtype, row = metadata
        if out is not None:
            out._scale_inv, out._stats_row = scale_inv, row
            return None
        return FP8GatheredWeight(data.view(dtype), scale_inv, param_dtype, row), (data,)


class FP8GatheredWeight(PreQuantizedWeight):
    """An all-gathered FP8 weight: the FP8 tensor ``_data``, its ``_scale_inv`` and (in a recording forward)
    the whole weight's statistics row, presenting itself as a tensor of the parameter dtype. The FP8
    ``Linear`` takes ``_data`` and ``_scale_inv`` as they are; any other op sees the dequantized weight."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, row=None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, row=None):
        self._data, self._scale_inv, self._stats_row = data, scale_inv, row

    def __repr__(self) -> str:
        return f"FP8GatheredWeight({self._data.dtype}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        # only torch.compile takes a gathered weight apart (to trace it), and the compiled FP8 operator cannot
        # take it: say so instead of failing deep inside the trace
        raise NotImplementedError(
            "torch.compile of a model with the FP8 all-gather (fp8_trainer.fsdp.enable_fp8_all_gather) is "
            "not supported yet; compile it with FSDP2's high-precision all-gather (without "
            "enable_fp8_all_gather)"
        )

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8GatheredWeight(inner["_data"], inner["_scale_inv"], meta[0])

    def _like(self, data: torch.Tensor) -> FP8GatheredWeight:
        return FP8GatheredWeight(data, self._scale_inv, self.dtype, self._stats_row)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        # FSDP2 makes the parameter with these (as_strided to the weight's shape, detach for Parameter)
        if func in (_aten.detach.default, _aten.alias.default):
            return w._like(w._data.detach())
        if func in (_aten.as_strided.default, _aten.view.default):
            return w._like(func(w._data, *args[1:], **kwargs))
        args, kwargs = pytree.tree_map_only(FP8GatheredWeight, lambda t: t.dequantize_hp(), (args, kwargs))
        return func(*args, **kwargs)

    def dequantize_hp(self) -> torch.Tensor:
        return (self._data.to(torch.float32) * self._scale_inv).to(self.dtype)

    def fp8_copies(self, state, k: int, transposed: bool, record: bool) -> tuple:
        """``(q, qt or None, scale_inv)`` as ``FP8State.quantized_weight`` hands them to the layer; with
        ``record``, the whole weight's statistics row goes into the step's row of the weight first."""
        if record and self._stats_row is not None and state.weight_cache.first_record(k):
            target = state.stats[3 * k + 1]
            width = min(target.shape[0], self._stats_row.shape[0])
            target[:width].copy_(self._stats_row[:width])
        q = self._data
        return q, q.t().contiguous() if transposed else None, self._scale_inv
