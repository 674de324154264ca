"""Scaling math as pure functions: amax history update, delayed and current scale computation.

All functions are vectorised over tensors: an ``amax_history`` has shape ``(history_len, n_tensors)``
with the newest entry in row 0 (Transformer Engine's layout), amaxes and scales have shape
``(n_tensors,)``. Per-tensor settings (``fp8_max``, ``margin``, ``history_len``, ``interval``, the
algorithm) may be Python scalars or ``(n_tensors,)`` tensors, so one call updates every tensor of a
model, each with its own (possibly overridden) recipe. Nothing here reads a tensor value on the host.

Edge cases, as DESIGN.md states them:

* a zero or non-finite amax keeps the previous scale;
* an amax so small that ``FP8_MAX / amax`` overflows gives the float32 maximum, not ``inf``;
* NaN propagates through ``max(amax_history)``: while a NaN (or Inf) step is inside the window of a
  tensor using ``"max"``, that tensor's scale stays where it was (the window's data cannot be trusted),
  and the entry itself stays visible in the history for post-mortem debugging.
"""

from __future__ import annotations

import torch

from .formats import FLOAT32_MAX

__all__ = [
    "compute_amax",
    "compute_scale",
    "current_scale",
    "delayed_scaling_update",
    "update_amax_history",
]


def _as_tensor(v, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(device=like.device, dtype=dtype or v.dtype)
    # torch.full is a fill kernel: no host-to-device copy (which would synchronise on a GPU)
    return torch.full((), v, device=like.device, dtype=dtype or like.dtype)


def update_amax_history(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    history_len: int | torch.Tensor | None = None,
    update: torch.Tensor | None = None,
) -> torch.Tensor:
    """Push ``amax`` as the newest entry (row 0) and drop the oldest.

    Args:
        amax_history: ``(L, n)`` history, newest first.
        amax: ``(n,)`` amaxes of the step that just ended.
        history_len: per-tensor effective length ``<= L``; entries at rows ``>= history_len`` are zeroed
            (zero is neutral for a max over non-negative amaxes).
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
    if update is not None:
        new = torch.where(update, new, amax_history)
    return new


def compute_amax(amax_history: torch.Tensor, amax_compute_algo: str | torch.Tensor = "max") -> torch.Tensor:
    """The amax a delayed scale is computed from.

    ``amax_compute_algo`` is ``"max"`` (max over the history, NaN propagating), ``"most_recent"`` (row 0),
    or a ``(n,)`` bool tensor that is True where the tensor uses ``"most_recent"``.
    """
    if isinstance(amax_compute_algo, str):
        if amax_compute_algo == "most_recent":
            return amax_history[0].clone()
        if amax_compute_algo == "max":
            return torch.amax(amax_history, dim=0)
        raise ValueError(f"amax_compute_algo: unknown algorithm {amax_compute_algo!r}")
    return torch.where(amax_compute_algo, amax_history[0], torch.amax(amax_history, dim=0))


def compute_scale(
    amax: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float | torch.Tensor,
    margin: float | torch.Tensor = 0,
) -> torch.Tensor:
    """``scale = (fp8_max / amax) / 2**margin`` in float32; zero/non-finite amax keeps ``scale``.

    A result that overflows (tiny amax) is clamped to the float32 maximum.
    """
    amax = amax.to(torch.float32)
    fmax = _as_tensor(fp8_max, amax, torch.float32)
    new = (fmax / amax) / torch.exp2(_as_tensor(margin, amax, torch.float32))
    new = torch.clamp(new, max=FLOAT32_MAX)
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
        amax: ``(n,)`` amax of the step that just ended (already reduced across ranks).
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
    if update is not None:
        due = due & update
    return history, torch.where(due, new_scale, scale.to(torch.float32))


def current_scale(amax: torch.Tensor, fp8_max: float | torch.Tensor) -> torch.Tensor:
    """Current scaling: ``fp8_max / amax`` (float32, clamped to its max); 1 for a zero or non-finite amax."""
    return compute_scale(amax, torch.ones_like(amax, dtype=torch.float32), fp8_max, 0)
