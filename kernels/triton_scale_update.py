"""The delayed-scaling update of every tensor of a model in one Triton launch.

Same semantics, bit for bit, as ``fp8_trainer.scaling.delayed_scaling_update`` (Transformer Engine's
DelayedScaling) followed by ``scale_inv = 1 / scale``, with every setting per tensor:

* history roll: the step's amax enters row 0, rows at or beyond the tensor's ``history_len`` are zero;
* ``amax = max(history)`` or, with ``most_recent``, row 0; ``scale = (fp8_max / amax) / 2**margin``,
  clamped to the float32 maximum; a zero or non-finite amax (a NaN or Inf anywhere in a ``max`` window)
  keeps the previous scale;
* the scale is recomputed only when ``step % interval == 0``; a tensor with ``enabled`` False keeps both
  its history and its scale.

Divisions are ``div_rn`` (correctly rounded, as PyTorch divides) and ``2**margin`` is evaluated by PyTorch
on the same device, so fractional margins round exactly as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["scale_update_triton"]


@triton.jit(do_not_specialize=["L", "n", "amax_stride"])
def _scale_update_kernel(hist_ptr, amax_ptr, amax_stride, scale_ptr, fmax_ptr, pow2_ptr, recent_ptr, hlen_ptr,
                         interval_ptr, step_ptr, enabled_ptr, new_hist_ptr, new_scale_ptr, new_scale_inv_ptr,
                         L, n, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < n
    amax = tl.load(amax_ptr + cols * amax_stride, mask=cm, other=0.0).to(tl.float32)
    enabled = tl.load(enabled_ptr + cols, mask=cm, other=0) != 0
    hlen = tl.load(hlen_ptr + cols, mask=cm, other=1)
    # running max of the new history, NaN tracked apart (the GPU's float max would drop it)
    mx = tl.zeros([BLOCK_N], dtype=tl.float32)
    has_nan = tl.zeros([BLOCK_N], dtype=tl.int1)
    row0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, L, BLOCK_L):
        rows = r0 + tl.arange(0, BLOCK_L)
        m = (rows[:, None] < L) & cm[None, :]
        old = tl.load(hist_ptr + rows[:, None] * n + cols[None, :], mask=m, other=0.0)
        above = tl.load(hist_ptr + (rows[:, None] - 1) * n + cols[None, :], mask=m & (rows[:, None] > 0),
                        other=0.0)
        new = tl.where(rows[:, None] == 0, amax[None, :], above)  # roll by one, the step's amax on top
        new = tl.where(rows[:, None] < hlen[None, :], new, 0.0)
        new = tl.where(enabled[None, :], new, old)
        tl.store(new_hist_ptr + rows[:, None] * n + cols[None, :], new, mask=m)
        nan = (new != new) & m
        has_nan = has_nan | (tl.max(nan.to(tl.int32), axis=0) != 0)
        mx = tl.maximum(mx, tl.max(tl.where(nan | ~m, 0.0, new), axis=0))
        row0 = tl.where(r0 == 0, tl.sum(tl.where(rows[:, None] == 0, new, 0.0), axis=0), row0)
    recent = tl.load(recent_ptr + cols, mask=cm, other=0) != 0
    eff = tl.where(recent, row0, mx)
    finite = (eff > 0) & (tl.abs(eff).to(tl.int32, bitcast=True) < 0x7F800000)  # NaN compares False
    ok = finite & (recent | ~has_nan)
    fmax = tl.load(fmax_ptr + cols, mask=cm, other=1.0)
    pow2 = tl.load(pow2_ptr + cols, mask=cm, other=1.0)
    safe = tl.where(ok, eff, 1.0)
    cand = tl.minimum(tl.math.div_rn(tl.math.div_rn(fmax, safe), pow2), 3.4028234663852886e38)
    step = tl.load(step_ptr)
    interval = tl.load(interval_ptr + cols, mask=cm, other=1)
    due = ((step % interval) == 0) & enabled
    old_scale = tl.load(scale_ptr + cols, mask=cm, other=1.0)
    scale = tl.where(due & ok, cand, old_scale)
    tl.store(new_scale_ptr + cols, scale, mask=cm)
    tl.store(new_scale_inv_ptr + cols, tl.math.div_rn(tl.full([BLOCK_N], 1.0, tl.float32), scale), mask=cm)


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
        scale: ``(n,)`` float32 scales used during that step.
        fp8_max, margin: ``(n,)`` float32; most_recent, enabled: ``(n,)`` bool;
        history_len, interval: ``(n,)`` int64; step: 0-dim int64, the 1-based number of the step that ended.
    """
    if amax_history.dim() != 2 or amax_history.dtype != torch.float32:
        raise ValueError(f"amax_history: expected a float32 (L, n) tensor, got {amax_history.dtype} "
                         f"{tuple(amax_history.shape)}")
    length, n = amax_history.shape
    for name, t in (("amax", amax), ("scale", scale), ("fp8_max", fp8_max), ("margin", margin),
                    ("most_recent", most_recent), ("history_len", history_len), ("interval", interval),
                    ("enabled", enabled)):
        if t.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
        if t.device != amax_history.device:
            raise ValueError(f"{name}: on {t.device}, expected {amax_history.device}")
    hist = amax_history.contiguous()
    new_hist = torch.empty_like(hist)
    new_scale = torch.empty(n, dtype=torch.float32, device=hist.device)
    new_scale_inv = torch.empty_like(new_scale)
    if n == 0:
        return new_hist, new_scale, new_scale_inv
    pow2 = torch.exp2(margin.to(torch.float32))  # the reference's own op: fractional margins round alike
    block_l, block_n = (32, 128) if hist.device.type == "cuda" else (8, 8)
    grid = (triton.cdiv(n, block_n),)
    _scale_update_kernel[grid](
        hist, amax, amax.stride(0), scale.to(torch.float32).contiguous(),
        fp8_max.to(torch.float32).contiguous(), pow2, most_recent.contiguous(), history_len.contiguous(),
        interval.contiguous(), step, enabled.contiguous(),
        new_hist, new_scale, new_scale_inv, length, n, BLOCK_L=block_l, BLOCK_N=block_n,
    )  # fmt: skip
    return new_hist, new_scale, new_scale_inv
