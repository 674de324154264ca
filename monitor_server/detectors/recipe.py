"""The run's scaling recipe as the detectors see it: per-tensor margin, growth window and FP8 on/off.

A recipe is a plain dict with Transformer Engine's names. Keys read (others are ignored):

- ``margin`` (default 0): scale = (FP8_MAX / amax) / 2**margin.
- ``amax_history_len`` (default 1024), ``amax_compute_algo`` (``"max"`` default or ``"most_recent"``),
  ``interval`` (default 1).
- ``scaling`` (or ``type``, as `fp8_trainer.recipe` spells it, or ``scaling_mode``): ``"delayed"``
  (default), ``"current"``, or block scaling, ``"mxfp8"`` (1x32 blocks, E8M0 scales) or ``"block"`` (FP8
  block scaling, 1x128 / 128x128): like current scaling, each scale comes from this step's own amax (of its
  block), with no history.
- ``fp8_enabled`` (or ``fp8`` / ``enabled``): False turns the tensor detectors off for the tensors it covers.

Per-layer overrides live under ``"overrides": {layer: {...}}`` and win over the whole-model keys for the
tensors whose `TensorInfo.layer` matches. `split_recipe` takes a whole recipe (the one in force);
`merge_recipe` applies a partial change key by key (an override of None removes that layer's override; a
change of None resets to the defaults). Malformed values fall back to the default rather than raise: the
API layer validates commands, the detectors must never fail on them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fp8_protocol.tensors import TensorInfo

DEFAULT_RECIPE: dict[str, Any] = {"margin": 0.0, "amax_history_len": 1024, "amax_compute_algo": "max"}
#: scaling modes whose scales come from the step's own amax (no history): current and the block modes
JUST_IN_TIME = frozenset({"current", "mxfp8", "block"})


def split_recipe(recipe: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A whole recipe as (whole-model keys, per-layer overrides)."""
    if not recipe:
        return {}, {}
    base = {k: v for k, v in recipe.items() if k != "overrides"}
    overrides = {str(k): dict(v) for k, v in (recipe.get("overrides") or {}).items() if isinstance(v, dict)}
    return base, overrides


def merge_recipe(
    base: dict[str, Any], overrides: dict[str, dict[str, Any]], update: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Apply a recipe update to (base, overrides) and return the new pair; None resets both."""
    if update is None:
        return {}, {}
    base = dict(base)
    overrides = {k: dict(v) for k, v in overrides.items()}
    for key, value in update.items():
        if key != "overrides":
            base[key] = value
    for layer, layer_update in (update.get("overrides") or {}).items():
        if layer_update is None:
            overrides.pop(str(layer), None)
        elif isinstance(layer_update, dict):
            overrides.setdefault(str(layer), {}).update(layer_update)
    return base, overrides


def _number(value: Any, default: float, lo: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return default
    return x if math.isfinite(x) and x >= lo else default


def _effective(recipe: dict[str, Any]) -> tuple[float, int, int, bool]:
    """(margin, history_len, interval, enabled), after defaults."""
    margin = _number(recipe.get("margin"), 0.0, lo=-64.0)
    history = int(_number(recipe.get("amax_history_len"), 1024, lo=1))
    interval = int(_number(recipe.get("interval"), 1, lo=1))
    enabled = recipe.get("fp8_enabled", recipe.get("fp8", recipe.get("enabled", True))) is not False
    return margin, history, interval, enabled


def growth_window(recipe: dict[str, Any], divergence_window: int) -> int:
    """Steps whose amax the current scale was computed from, capped at `divergence_window`.

    Delayed scaling with ``"max"``: the history length; with ``"most_recent"``: the recompute interval
    (usually 1). Current scaling has no history, so the growth is judged over `divergence_window`.
    """
    _, history, interval, _ = _effective(recipe)
    if _mode(recipe) in JUST_IN_TIME:
        return divergence_window
    if str(recipe.get("amax_compute_algo", "max")) == "most_recent":
        return min(interval, divergence_window)
    return min(history, divergence_window)


def warmup_len(recipe: dict[str, Any], config: Any) -> int:
    """Steps (with a quantized, non-zero amax) a tensor is given before saturation and divergence alerts:
    `config.warmup_steps` when set, else until its amax history has filled once (``amax_history_len``) for
    delayed scaling, or until the growth window has (``divergence_window``) for current scaling, either
    capped at `config.warmup_max_steps`. Before that the scale is still the initial 1 or comes from a few
    early steps, and saturating then is the recipe starting up, not a fault."""
    if config.warmup_steps is not None:
        return int(config.warmup_steps)
    _, history, _, _ = _effective(recipe)
    if _mode(recipe) in JUST_IN_TIME:
        history = config.divergence_window
    return min(history, config.warmup_max_steps)


def _mode(recipe: dict[str, Any]) -> str:
    return str(recipe.get("scaling", recipe.get("type", recipe.get("scaling_mode", "delayed")))).lower()


def per_tensor(
    tensors: list[TensorInfo],
    base: dict[str, Any],
    overrides: dict[str, dict[str, Any]],
    config: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(margin (T,) float64, growth window (T,) int64, enabled (T,) bool, warm-up length (T,) int64) for
    tensors ordered by index; `config` is the engine's `DetectorConfig`."""
    n = len(tensors)
    margin = np.zeros(n)
    window = np.zeros(n, dtype=np.int64)
    enabled = np.ones(n, dtype=bool)
    warmup = np.zeros(n, dtype=np.int64)
    resolved: dict[str, tuple[float, int, bool, int]] = {}
    for i, meta in enumerate(tensors):
        if meta.layer not in resolved:
            recipe = {**DEFAULT_RECIPE, **base, **overrides.get(meta.layer, {})}
            m, _, _, on = _effective(recipe)
            resolved[meta.layer] = (
                m,
                growth_window(recipe, config.divergence_window),
                on,
                warmup_len(recipe, config),
            )
        margin[i], window[i], enabled[i], warmup[i] = resolved[meta.layer]
    return margin, window, enabled, warmup
