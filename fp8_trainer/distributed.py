"""Amax reduction across data-parallel ranks: one all_reduce(MAX) for every amax of a step."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_amax", "resolve_amax_group"]

_DEFAULT = object()


def resolve_amax_group(fp8_group, reduce_amax: bool):
    """The group to reduce amaxes over, or ``None`` for no reduction.

    An explicit ``fp8_group`` always reduces; otherwise the default group does when ``reduce_amax`` is set
    and torch.distributed is initialised with more than one rank.
    """
    if fp8_group is not None:
        return fp8_group
    if reduce_amax and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _DEFAULT
    return None


def all_reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """Max of ``amax`` (all tensors of the step, one vector) over ``group`` in a single collective.

    NaN is sent as +Inf first (a MAX reduction's NaN handling differs between backends; the kernels' amaxes
    ignore NaN elements, so a NaN amax only comes from outside them); +Inf stays +Inf. Either way the
    reduced amax is non-finite and the scale update keeps the previous scale. (``nan_to_num`` would map
    +Inf to the float32 maximum without ``posinf``: a finite amax of 3.4e38 that collapses the scale.)
    """
    inf = float("inf")
    out = torch.nan_to_num(amax.to(torch.float32), nan=inf, posinf=inf, neginf=-inf)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=None if group is _DEFAULT else group)
    return out
