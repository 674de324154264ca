"""The delayed-scaling update of every tensor of a model in one Triton launch.

Same semantics, bit for bit, as ``fp8_trainer.scaling.delayed_scaling_update`` (Transformer Engine's
delayed-scaling kernel, ``kernel_bulk``, plus fp8scope's ``interval`` and per-tensor ``enabled``) followed by
``scale_inv = 1 / scale``, with every setting per tensor:

* history roll (fp8scope's layout, newest entry in row 0): the step's amax enters row 0 and rows at or
  beyond the tensor's ``history_len`` are zero; a step amax of zero does not roll (and keeps the scale);
* ``amax = max(history)`` ignoring NaN, or with ``most_recent`` row 0; ``scale = scaled_max / amax`` with
  ``scaled_max = fp8_max * 2**-margin`` in float32, clamped to the float32 maximum; a zero or non-finite
  amax (an Inf in a ``max`` window) keeps the previous scale;
* the scale is recomputed only when ``step % interval == 0``; a tensor with ``enabled`` False keeps both
  its history and its scale.

Divisions are ``div_rn`` (correctly rounded, as PyTorch divides) and ``scaled_max`` is evaluated by PyTorch
on the same device with the reference's own ops, so fractional margins round exactly as there. The new
``scale`` and ``scale_inv`` are 16-byte-aligned per-tensor vectors (``fp8_kernels.layout.aligned_scales``):
every ``scale_inv[i]`` can go to ``torch._scaled_mm`` as it is.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from ..layout import aligned_scales
from .launch import block_scale_update, cdiv, divisor, launch

__all__ = ["scale_update_triton"]

#: ``id(margin)`` -> ``(weak reference to margin, (fp8_max's pointer and version, margin's version),
#: scaled_max)``: the settings change only when a recipe does (``FP8State`` then makes new tensors), so the
#: three small ops that make ``scaled_max`` run once per settings, not once per step
_SCALED_MAX: dict[int, tuple] = {}


def _scaled_max(fp8_max: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """``fp8_max * 2**-margin`` in float32, with the reference's own ops (``fp8_trainer.scaling``) so that
    fractional margins round alike; cached per settings tensors (``_SCALED_MAX``)."""
    key = (fp8_max.data_ptr(), fp8_max._version, margin._version)
    held = _SCALED_MAX.get(id(margin))
    if held is None or held[0]() is not margin or held[1] != key:
        if len(_SCALED_MAX) > 64:
            _SCALED_MAX.clear()
        value = fp8_max.to(torch.float32) * torch.exp2(-margin.to(torch.float32))
        held = _SCALED_MAX[id(margin)] = (weakref.ref(margin), key, value)
    return held[2]


@triton.jit(do_not_specialize=["L", "n", "amax_stride", "scale_stride"])
def _scale_update_kernel(
    hist_ptr,
    amax_ptr,
    amax_stride,
    scale_ptr,
    scale_stride,
    scaled_max_ptr,
    recent_ptr,
    hlen_ptr,
    interval_ptr,
    step_ptr,
    enabled_ptr,
    new_hist_ptr,
    new_scale_ptr,
    new_scale_inv_ptr,
    L,
    n,
    OUT_STRIDE: tl.constexpr,
    DIV_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n = (n // DIV_N) * DIV_N  # exact (the launcher passes a divisor of n): history rows start aligned
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < n
    amax = tl.load(amax_ptr + cols * amax_stride, mask=cm, other=0.0).to(tl.float32)
    enabled = tl.load(enabled_ptr + cols, mask=cm, other=0) != 0
    hlen = tl.load(hlen_ptr + cols, mask=cm, other=1)
    rolls = enabled & (amax != 0)  # TE: ``last_amax != 0`` (a NaN rolls)
    mx = tl.zeros([BLOCK_N], dtype=tl.float32)  # max of the new history, NaN ignored (fmaxf)
    row0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, L, BLOCK_L):
        rows = r0 + tl.arange(0, BLOCK_L)
        m = (rows[:, None] < L) & cm[None, :]
        old = tl.load(hist_ptr + rows[:, None] * n + cols[None, :], mask=m, other=0.0)
        above = tl.load(
            hist_ptr + (rows[:, None] - 1) * n + cols[None, :], mask=m & (rows[:, None] > 0), other=0.0
        )
        new = tl.where(rows[:, None] == 0, amax[None, :], above)  # roll by one, the step's amax on top
        new = tl.where(rows[:, None] < hlen[None, :], new, 0.0)
        new = tl.where(rolls[None, :], new, old)
        tl.store(new_hist_ptr + rows[:, None] * n + cols[None, :], new, mask=m)
        mx = tl.maximum(mx, tl.max(tl.where((new != new) | ~m, 0.0, new), axis=0))
        row0 = tl.where(r0 == 0, tl.sum(tl.where(rows[:, None] == 0, new, 0.0), axis=0), row0)
    recent = tl.load(recent_ptr + cols, mask=cm, other=0) != 0
    eff = tl.where(recent, row0, mx)
    ok = (eff > 0) & (tl.abs(eff).to(tl.int32, bitcast=True) < 0x7F800000)  # NaN compares False
    scaled_max = tl.load(scaled_max_ptr + cols, mask=cm, other=1.0)
    cand = tl.minimum(tl.math.div_rn(scaled_max, tl.where(ok, eff, 1.0)), 3.4028234663852886e38)
    step = tl.load(step_ptr)
    interval = tl.load(interval_ptr + cols, mask=cm, other=1)
    due = ((step % interval) == 0) & rolls
    old_scale = tl.load(scale_ptr + cols * scale_stride, mask=cm, other=1.0)
    scale = tl.where(due & ok, cand, old_scale)
    tl.store(new_scale_ptr + cols * OUT_STRIDE, scale, mask=cm)
    scale_inv = tl.math.div_rn(tl.full([BLOCK_N], 1.0, tl.float32), scale)
    tl.store(new_scale_inv_ptr + cols * OUT_STRIDE, scale_inv, mask=cm)


def scale_update_triton(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_max: torch.Tensor,
    margin: torch.Tensor,
    most_recent: torch.Tensor,
    history_len: torch.Tensor,
    interval: torch.Tensor,
    step: torch.Tensor,
    enabled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One delayed-scaling update of ``n`` tensors: ``(new_history, new_scale, new_scale_inv)``.

    Args:
        amax_history: ``(L, n)`` float32, newest entry in row 0 (not modified).
        amax: ``(n,)`` amaxes of the step that just ended, any float dtype and stride (e.g. ``stats[:, 0]``).
        scale: ``(n,)`` float32 scales used during that step, any stride (e.g. an ``aligned_scales`` vector).
        fp8_max, margin: ``(n,)`` float32; most_recent, enabled: ``(n,)`` bool;
        history_len, interval: ``(n,)`` int64; step: 0-dim int64, the 1-based number of the step that ended.
    Returns:
        ``new_history`` contiguous ``(L, n)``; ``new_scale`` and ``new_scale_inv`` as ``aligned_scales``
        vectors (stride ``SCALE_STRIDE``: each element on its own 16-byte boundary).
    """
    if amax_history.dim() != 2 or amax_history.dtype != torch.float32:
        raise ValueError(
            f"amax_history: expected a float32 (L, n) tensor, got {amax_history.dtype} "
            f"{tuple(amax_history.shape)}"
        )
    length, n = amax_history.shape
    for name, t in (
        ("amax", amax),
        ("scale", scale),
        ("fp8_max", fp8_max),
        ("margin", margin),
        ("most_recent", most_recent),
        ("history_len", history_len),
        ("interval", interval),
        ("enabled", enabled),
    ):
        if t.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
        if t.device != amax_history.device:
            raise ValueError(f"{name}: on {t.device}, expected {amax_history.device}")
    hist = amax_history.contiguous()
    new_hist = torch.empty_like(hist)
    new_scale = aligned_scales(n, hist.device)
    new_scale_inv = aligned_scales(n, hist.device)
    if n == 0:
        return new_hist, new_scale, new_scale_inv
    scaled_max = _scaled_max(fp8_max, margin)
    scale_f = scale if scale.dtype == torch.float32 else scale.to(torch.float32)  # its stride is passed
    block_l, block_n = block_scale_update(hist.device)
    launch(
        _scale_update_kernel,
        cdiv(n, block_n),
        hist,
        amax,
        amax.stride(0),
        scale_f,
        scale_f.stride(0),
        scaled_max,
        most_recent.contiguous(),
        history_len.contiguous(),
        interval.contiguous(),
        step,
        enabled.contiguous(),
        new_hist,
        new_scale,
        new_scale_inv,
        length,
        n,
        OUT_STRIDE=new_scale.stride(0),
        DIV_N=divisor(n),
        BLOCK_L=block_l,
        BLOCK_N=block_n,
    )
    return new_hist, new_scale, new_scale_inv
