"""Scaling math as pure functions: amax history update, delayed and current scale computation.

All functions are vectorised over tensors: an ``amax_history`` has shape ``(history_len, n_tensors)``
with the newest entry in row 0 (fp8scope's own layout; Transformer Engine keeps row 0 as the slot the
current step's amax is written into and rotates the rest, which holds the same window), amaxes and scales
have shape ``(n_tensors,)``. Per-tensor settings (``fp8_max``, ``margin``, ``history_len``, ``interval``,
the algorithm) may be Python scalars or ``(n_tensors,)`` tensors, so one call updates every tensor of a
model, each with its own (possibly overridden) recipe. Nothing here reads a tensor value on the host.

Edge cases, as Transformer Engine's delayed-scaling kernel (``kernel_bulk``) has them
(docs/fp8-semantics.md):

* a step amax of zero (a layer that did not run, an all-zero gradient or weight) does not enter the history
  and keeps the scale: one idle step must not push the window's maximum out;
* the maximum over the history ignores NaN (``fmaxf``); an Inf in the window, or a zero, Inf or NaN amax
  with ``"most_recent"``, keeps the previous scale. A NaN step amax (the statistics no longer produce one)
  still enters the history, as in TE, where it stays visible for post-mortem debugging;
* ``scale = scaled_max / amax`` with ``scaled_max = fp8_max * 2**-margin`` computed first, in float32, then
  one correctly rounded division; a result that overflows (tiny amax) is the float32 maximum, not ``inf``.

fp8scope's extensions: ``interval`` (recompute the scale only every N steps; the history still rolls every
step) and a per-tensor ``update`` mask (False freezes history and scale: FP8 turned off for that layer).
"""

from __future__ import annotations

import torch

from .formats import FLOAT32_MAX

__all__ = [
    "compute_amax",
    "compute_scale",
    "current_scale",
    "delayed_scaling_update",
    "scale_update_reference",
    "update_amax_history",
]

#: ``0xFF800000`` as an int32: keeps a float32's sign and exponent (rounds it down to a power of two).
_POW2_MASK = -(2**23)


def _as_tensor(v, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(device=like.device, dtype=dtype or v.dtype)
    # torch.full is a fill kernel: no host-to-device copy (which would synchronise on a GPU)
    return torch.full((), v, device=like.device, dtype=dtype or like.dtype)


def _rolls(amax: torch.Tensor, history_dtype: torch.dtype, update: torch.Tensor | None) -> torch.Tensor:
    """Where the step's amax enters the history: non-zero in the history's dtype (NaN included, as TE's
    ``last_amax != 0``) and not frozen by ``update``."""
    rolls = amax.to(history_dtype) != 0
    return rolls if update is None else rolls & update


def update_amax_history(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    history_len: int | torch.Tensor | None = None,
    update: torch.Tensor | None = None,
) -> torch.Tensor:
    """Push ``amax`` as the newest entry (row 0) and drop the oldest, for tensors whose ``amax`` is non-zero.

    Args:
        amax_history: ``(L, n)`` history, newest first.
        amax: ``(n,)`` amaxes of the step that just ended; a zero leaves that tensor's history as it was.
        history_len: per-tensor effective length ``<= L``; entries at rows ``>= history_len`` are zeroed
            when the history rolls (zero is neutral for a max over non-negative amaxes).
        update: optional ``(n,)`` bool; tensors where it is False keep their history unchanged.
    Returns:
        A new ``(L, n)`` history.
    """
    new = torch.roll(amax_history, shifts=1, dims=0)
    new[0] = amax.to(new.dtype)
    if history_len is not None:
        rows = torch.arange(new.shape[0], device=new.device).unsqueeze(1)
        new = torch.where(
            rows < _as_tensor(history_len, new, torch.int64), new, torch.zeros((), device=new.device)
        )
    return torch.where(_rolls(amax, new.dtype, update), new, amax_history)


def compute_amax(amax_history: torch.Tensor, amax_compute_algo: str | torch.Tensor = "max") -> torch.Tensor:
    """The amax a delayed scale is computed from.

    ``amax_compute_algo`` is ``"max"`` (max over the history, NaN ignored as ``fmaxf`` does, Inf kept),
    ``"most_recent"`` (row 0, as it is), or a ``(n,)`` bool tensor that is True where the tensor uses
    ``"most_recent"``.
    """
    if isinstance(amax_compute_algo, str) and amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo: unknown algorithm {amax_compute_algo!r}")
    if isinstance(amax_compute_algo, str) and amax_compute_algo == "most_recent":
        return amax_history[0].clone()
    # amaxes are >= 0, so NaN -> 0 is fmaxf's "ignore NaN" (an all-NaN window gives 0, as in TE)
    window_max = torch.amax(torch.nan_to_num(amax_history, nan=0.0, posinf=torch.inf), dim=0)
    if isinstance(amax_compute_algo, str):
        return window_max
    return torch.where(amax_compute_algo, amax_history[0], window_max)


def compute_scale(
    amax: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float | torch.Tensor,
    margin: float | torch.Tensor = 0,
) -> torch.Tensor:
    """``scale = scaled_max / amax`` in float32 with ``scaled_max = fp8_max * 2**-margin`` (rounded to float32
    first, as TE does); a zero or non-finite amax keeps ``scale``.

    A result that overflows (tiny amax) is clamped to the float32 maximum.
    """
    amax = amax.to(torch.float32)
    pow2 = torch.exp2(-_as_tensor(margin, amax, torch.float32))
    scaled_max = _as_tensor(fp8_max, amax, torch.float32) * pow2
    new = torch.clamp(scaled_max / amax, max=FLOAT32_MAX)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, new, scale.to(torch.float32))


def delayed_scaling_update(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_max: float | torch.Tensor,
    margin: float | torch.Tensor = 0,
    amax_compute_algo: str | torch.Tensor = "max",
    history_len: int | torch.Tensor | None = None,
    interval: int | torch.Tensor = 1,
    step: int | torch.Tensor = 1,
    update: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update at the end of an optimizer step: ``(history, amax) -> (history, scale)``.

    Args:
        amax_history: ``(L, n)`` history before this step, newest first.
        amax: ``(n,)`` amax of the step that just ended (already reduced across ranks); a zero leaves the
            tensor's history and scale as they were.
        scale: ``(n,)`` scales used during that step.
        fp8_max, margin, amax_compute_algo, history_len: the recipe, per tensor or shared.
        interval: recompute the scale only when ``step % interval == 0``; the history is updated every step.
        step: 1-based number of the step that just ended.
        update: optional ``(n,)`` bool; False freezes both history and scale (FP8 turned off).
    Returns:
        ``(new_history, new_scale)``.
    """
    history = update_amax_history(amax_history, amax, history_len, update)
    new_scale = compute_scale(compute_amax(history, amax_compute_algo), scale, fp8_max, margin)
    step_t = _as_tensor(step, amax, torch.int64)
    due = torch.remainder(step_t, _as_tensor(interval, amax, torch.int64)) == 0
    due = due & _rolls(amax, amax_history.dtype, update)
    return history, torch.where(due, new_scale, scale.to(torch.float32))


def current_scale(
    amax: torch.Tensor, fp8_max: float | torch.Tensor, *, power_2_scale: bool = False
) -> torch.Tensor:
    """Current scaling: ``fp8_max / amax`` (float32, clamped to its max); 1 for a zero or non-finite amax.

    With ``power_2_scale`` the scale is rounded down to a power of two by masking its bits with
    ``0xFF800000`` (Transformer Engine's ``force_pow_2_scales``, torchao's ``round_scales_to_power_of_2``):
    the FP8 values are then the input's own mantissas, and ``scale_inv`` is exact.
    """
    scale = compute_scale(amax, torch.ones_like(amax, dtype=torch.float32), fp8_max, 0)
    if power_2_scale:
        scale = torch.bitwise_and(scale.view(torch.int32), _POW2_MASK).view(torch.float32)
    return scale


def scale_update_reference(amax_history, amax, scale, *, most_recent, enabled, **recipe):
    """``delayed_scaling_update`` with the fused kernel's signature and result ``(history, scale, scale_inv)``
    (``fp8_kernels.fused_scale_update``), so ``FP8State.end_step`` makes one call whichever runs."""
    history, new_scale = delayed_scaling_update(
        amax_history, amax, scale, amax_compute_algo=most_recent, update=enabled, **recipe
    )
    return history, new_scale, torch.reciprocal(new_scale)
