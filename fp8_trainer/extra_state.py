"""Checkpoint I/O of the scaling state: each FP8 ``Linear``'s slice of its model's ``FP8State``.

Every FP8 ``Linear`` saves its slice as its module extra state (``<module path>._extra_state`` in
``model.state_dict()``), as Transformer Engine does: ``save`` writes it (tensors and plain values only, so
``torch.load(weights_only=True)`` reads it), ``parse`` checks one read back, and ``restored`` gives the
state's history and scale vectors with it put in. The step counter that phases ``interval`` is per model;
every layer's slice carries a copy of it and of the model-wide overrides, so loading any layer restores
them. ``FP8State.layer_extra_state`` and ``FP8State.load_layer_extra_state`` are the callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fp8_kernels import aligned_scales

from .recipe import LAYER_SETTINGS, validate_setting

if TYPE_CHECKING:
    from .state import FP8State

__all__ = ["EXTRA_STATE_VERSION", "SavedLayer", "parse", "restored", "save"]

#: Version of the per-layer checkpoint format written by ``save`` (``FP8State.layer_extra_state``).
EXTRA_STATE_VERSION = 1


@dataclass(frozen=True)
class SavedLayer:
    """One layer's slice as ``parse`` read it: checked, not yet applied."""

    layer_overrides: dict[str, Any]
    model_overrides: dict[str, Any]
    amax_history: torch.Tensor  # (L, 3) float32, newest first: input, weight, grad_output
    scale: torch.Tensor  # (3,) float32
    step: int


def save(state: FP8State, k: int) -> dict[str, Any]:
    """Layer ``k``'s slice of ``state``, tensors and plain values only (``weights_only``-safe), copied to
    the CPU.

    ``amax_history`` holds the layer's effective rows only (``(history_len, 3)``, newest first, columns
    input / weight / grad_output). A step still pending (between forward and backward, or between
    micro-batches) is not included: the slice is the state after the last completed step.
    """
    cols = slice(3 * k, 3 * k + 3)
    length = state.layer_settings(k)["amax_history_len"]
    return {
        "version": EXTRA_STATE_VERSION,
        "layer": state.layer_names[k],
        "amax_history": state.amax_history[:length, cols].detach().to("cpu", copy=True),
        "scale": state.scale[cols].detach().to("cpu", copy=True),
        "scale_inv": state.scale_inv[cols].detach().to("cpu", copy=True),
        "layer_overrides": dict(state.layer_overrides[k]),
        "model_overrides": dict(state.model_overrides),
        "step": state.steps,
    }


def parse(name: str, extra: Any) -> SavedLayer:
    """The slice ``save`` wrote for the layer called ``name``, checked.

    Raises:
        ValueError: the slice is malformed (another version, a missing or ill-typed entry, wrong shapes),
            naming the layer.
    """
    if not isinstance(extra, dict) or extra.get("version") != EXTRA_STATE_VERSION:
        version = extra.get("version") if isinstance(extra, dict) else type(extra).__name__
        raise ValueError(
            f"{name}._extra_state: expected FP8 extra state version {EXTRA_STATE_VERSION}, got {version!r}"
        )
    try:
        layer_overrides = _clean_overrides(extra["layer_overrides"])
        model_overrides = _clean_overrides(extra["model_overrides"])
        history = torch.as_tensor(extra["amax_history"], dtype=torch.float32)
        scale = torch.as_tensor(extra["scale"], dtype=torch.float32)
        scale_inv = torch.as_tensor(extra["scale_inv"], dtype=torch.float32)
        step = extra["step"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{name}._extra_state: malformed FP8 extra state ({e})") from None
    if history.dim() != 2 or history.shape[1] != 3 or scale.shape != (3,) or scale_inv.shape != (3,):
        raise ValueError(
            f"{name}._extra_state: expected amax_history (L, 3), scale (3,), scale_inv (3,); got "
            f"{tuple(history.shape)}, {tuple(scale.shape)}, {tuple(scale_inv.shape)}"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{name}._extra_state: step must be an integer >= 0, got {step!r}")
    return SavedLayer(layer_overrides, model_overrides, history, scale, step)


def restored(state: FP8State, k: int, saved: SavedLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``state``'s ``(amax_history, scale, scale_inv)`` with layer ``k``'s columns from ``saved``, as new
    tensors (earlier graphs may still hold views of the old scales). The state's settings must already be
    the saved ones (the layer's effective history length): a saved history of another length keeps its
    newest entries and is padded with zeros, as ``set_layer_recipe`` does when the length changes."""
    cols = slice(3 * k, 3 * k + 3)
    length = state.layer_settings(k)["amax_history_len"]
    n = min(length, saved.amax_history.shape[0])
    amax_history = state.amax_history.clone()
    amax_history[:, cols] = 0
    amax_history[:n, cols] = saved.amax_history[:n].to(state.device)
    scale = aligned_scales(state.scale)
    scale[cols] = saved.scale.to(state.device)
    # derived, not loaded: a stored scale_inv that disagreed with scale would scale every output wrongly
    scale_inv = aligned_scales(torch.reciprocal(scale))
    return amax_history, scale, scale_inv


def _clean_overrides(overrides: Any) -> dict[str, Any]:
    if not isinstance(overrides, dict):
        raise TypeError(f"overrides must be a dict, got {type(overrides).__name__}")
    clean = {}
    for key, value in overrides.items():
        if key not in LAYER_SETTINGS:
            raise ValueError(f"{key!r} is not a per-layer recipe setting")
        clean[key] = validate_setting(key, value)
    return clean
