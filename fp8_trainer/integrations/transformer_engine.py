"""Watching Transformer Engine 2.x modules from their own delayed-scaling state.

What TE keeps (read from its source, TE 2.x, ``transformer_engine/pytorch``):

* every GEMM module (``module/linear.py`` ``Linear``, ``module/layernorm_linear.py`` ``LayerNormLinear``,
  ``module/layernorm_mlp.py`` ``LayerNormMLP`` with ``num_gemms=2`` (fc1, fc2), ``module/grouped_linear.py``
  ``GroupedLinear`` with ``self.num_gemms``; ``TransformerLayer`` is built from them) derives from
  ``module/base.py`` ``TransformerEngineBaseModule``, whose ``fp8_meta`` dict holds, once the first FP8
  forward ran ``init_fp8_metadata``, ``fp8_meta["scaling_fwd"]`` and ``fp8_meta["scaling_bwd"]``:
  ``quantization.py`` ``DelayedScalingRecipeState`` objects with ``scale`` ``(n,)`` and ``amax_history``
  ``(amax_history_len, n)``, float32 on the GPU, ``fp8_meta["recipe"]`` the ``DelayedScaling`` in force;
* indices (``csrc/common.h`` ``FP8FwdTensors`` / ``FP8BwdTensors``): forward ``3g`` = GEMM g's input,
  ``3g + 1`` its weight (``3g + 2`` its output, unused); backward ``2g`` = GEMM g's grad_output;
* the quantizers write the amax of each cast into row 0 (``DelayedScalingRecipeState.make_quantizers``:
  ``amax_history[0][i]``); at each ``fp8_autocast`` exit (forward) and at the end of the backward pass
  (``reduce_and_update_fp8_tensors``), ``common/recipe/delayed_scaling.cu`` ``kernel_bulk`` rolls every
  history with a non-zero amax: ``new[i] = old[i + 1]`` for ``0 < i < L - 1``, ``new[L - 1] =`` the amax,
  ``new[0] = 0``, and sets ``scale = (fp8_max * 2**-margin) / amax`` over rows (``"max"``, NaN ignored) or the
  amax (``"most_recent"``), keeping the scale for a zero or non-finite amax, float32 max for an infinite one.

So at a step boundary, rows ``1 .. L-1`` of a history are a queue of the last amaxes, newest last, and
``scale`` is the scale of the next cast. ``TEStats`` copies every watched column (one device tensor, one
non-blocking copy per ``monitor.step``) and, a step later on the host, finds how far each queue moved since
the previous copy: the amaxes that entered are the step's casts (several under gradient accumulation: TE
rolls once per ``fp8_autocast``), reported as their max with the scale that cast used (the previous copy's
scale for the first, recomputed with TE's rule for the next ones). TE counts no overflow, underflow or
non-finite elements and keeps no element count: those columns are 0 (``numel`` 0 says "not counted").
A history of length 1 keeps no amax after the roll: ``amax_history_len >= 2`` is required. Only TE's
``DelayedScaling`` keeps such state; under its other recipes (current scaling, MXFP8, block scaling) there is
nothing to read and no statistics are reported.

Recipe commands: TE's recipe belongs to the ``fp8_autocast`` region, so changes are model-wide;
``margin`` and ``amax_compute_algo`` are set on the ``DelayedScaling`` object the modules hold (TE reads it
at every update); anything else, or a single layer, is rejected with the reason.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from fp8_protocol.stats import BASE_COLUMNS, FP8_MAX

from ..stats import LateReader

__all__ = ["TEStats", "has_te_layers", "new_amaxes", "te_layers", "te_step_row"]

log = logging.getLogger(__name__)

_GEMMS = {"Linear": 1, "LayerNormLinear": 1, "LayerNormMLP": 2}
_FP8_MAX = FP8_MAX  # fp8_protocol.stats
#: what a command may change in a running TE job (fields of TE's DelayedScaling read at every update)
_TE_SETTINGS = ("margin", "amax_compute_algo")


def te_layers(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """``(path, module, num_gemms)`` of every TE GEMM module of ``model`` (checked without importing TE)."""
    out = []
    for name, m in model.named_modules():
        cls = type(m)
        if not cls.__module__.startswith("transformer_engine.pytorch"):
            continue
        n = _GEMMS.get(cls.__name__)
        if cls.__name__ == "GroupedLinear":
            n = int(m.num_gemms)
        if n:
            out.append((name, m, n))
    return out


def has_te_layers(model: nn.Module) -> bool:
    return bool(te_layers(model))


def new_amaxes(prev: np.ndarray, cur: np.ndarray, expected: int | None = None) -> np.ndarray:
    """The amaxes that entered one TE history column between two step-boundary copies (oldest first).

    ``prev`` and ``cur`` are ``(L,)`` columns; rows ``1 .. L-1`` are the queue. The shift ``s`` is the number
    of rolls: ``cur[1 : L - s] == prev[1 + s :]``. ``expected`` (the forwards counted since ``prev``) is tried
    first; otherwise the smallest shift that fits (a zero-amax step rolls nothing: ``s = 0``).
    """
    wp, wc = prev[1:], cur[1:]
    n = len(wp)
    order = ([expected] if expected is not None and 0 <= expected <= n else []) + list(range(n + 1))
    for s in order:
        if np.array_equal(wc[: n - s], wp[s:], equal_nan=True):
            return wc[n - s :]
    return wc[-1:]  # the queue was rewritten (a resized history, a loaded checkpoint): its newest entry


def te_step_row(
    prev: np.ndarray, cur: np.ndarray, scale: np.float32, fmt: str, margin: float, algo: str, expected=None
) -> list[float]:
    """One tensor's statistics row for one step from two copies of its TE column: the max of the new
    amaxes and the scale that scaled it (TE's update rule replayed for the casts after the first)."""
    fresh = new_amaxes(prev, cur, expected)
    if fresh.size == 0:
        return [0.0, float(scale), 0.0, 0.0, 0.0, 0.0]
    scaled_max = np.float32(_FP8_MAX[fmt]) * np.float32(2.0**-margin)
    queue = [np.float32(v) for v in prev[1:]]
    best, best_scale, s = np.float32(0.0), np.float32(scale), np.float32(scale)
    for a in (np.float32(v) for v in fresh):
        if a > best:  # NaN compares false: ignored, as TE's fmaxf
            best, best_scale = a, s
        # kernel_bulk: the scale's amax is the max over the old queue and the new amax (NaN ignored)
        window = np.array([*queue, a], dtype=np.float32)
        ref = a if algo == "most_recent" else np.float32(np.fmax.reduce(window))
        queue = [*queue[1:], a]
        if np.isfinite(ref) and ref > 0:
            with np.errstate(over="ignore"):
                s = np.float32(scaled_max / ref)
            if np.isinf(s):
                s = np.float32(np.finfo(np.float32).max)
    return [float(best), float(best_scale), 0.0, 0.0, 0.0, 0.0]


class TEStats(LateReader):
    """Per-step statistics of a model's TE modules, read from TE's state (module docstring); the reader
    interface ``Monitor`` uses (``take``, ``poll``, ``flush``, ``read_now``, ``close``, ``merged``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.layers = te_layers(model)
        if not self.layers:
            raise ValueError(
                "model: no transformer_engine.pytorch GEMM module (Linear, LayerNormLinear, ...)"
            )
        self.tensors: list[dict[str, Any]] = []
        self._where: list[
            tuple[int, str, int]
        ] = []  # per tensor: (layer, "scaling_fwd"/"scaling_bwd", index)
        for k, (path, _, n) in enumerate(self.layers):
            for g in range(n):
                layer = path if n == 1 else f"{path}.{('fc1', 'fc2')[g] if n == 2 else f'gemm{g}'}"
                for role, key, idx in (
                    ("input", "scaling_fwd", 3 * g),
                    ("weight", "scaling_fwd", 3 * g + 1),
                    ("grad_output", "scaling_bwd", 2 * g),
                ):
                    fmt = "e5m2" if role == "grad_output" else "e4m3"  # HYBRID; E4M3 is read from the recipe
                    name = f"{layer}.{role}"
                    self.tensors.append(
                        {
                            "index": len(self.tensors),
                            "name": name,
                            "layer": layer,
                            "role": role,
                            "format": fmt,
                        }
                    )
                    self._where.append((k, key, idx))
        self._forwards = [0] * len(self.layers)
        self._hooks = [
            m.register_forward_pre_hook(self._counter(k)) for k, (_, m, _) in enumerate(self.layers)
        ]
        self._prev: tuple[np.ndarray, np.ndarray, list[int]] | None = None
        self._last: torch.Tensor | None = None
        self.merged = 1
        self.recipe = None
        self.source = "transformer_engine"

    def _counter(self, k: int):
        @torch.compiler.disable  # under torch.compile too: a count that changes every step is not traced
        def hook(module, args):
            if torch.is_grad_enabled() and getattr(module, "fp8", False):
                self._forwards[k] += 1

        return hook

    def _snapshot(self) -> torch.Tensor | None:
        """``(L + 1, T)``: every watched history column, then the scales (device ops only)."""
        cols, scales, length = [], [], None
        for k, key, idx in self._where:
            meta = self.layers[k][1].fp8_meta
            state = meta.get(key)
            if state is None or not hasattr(state, "amax_history"):
                return None  # before the first FP8 forward (or not delayed scaling)
            self.recipe = meta.get("recipe", self.recipe)
            hist = state.amax_history[:, idx]
            length = hist.shape[0] if length is None else min(length, hist.shape[0])
            cols.append(hist)
            scales.append(state.scale[idx])
        hist = torch.stack([c[-length:] if c.shape[0] > length else c for c in cols], dim=1)
        return torch.cat([hist, torch.stack(scales).reshape(1, -1)]).to(torch.float32)

    def _rows(self, prev: np.ndarray, cur: np.ndarray, counted: list[int]) -> np.ndarray:
        r = self.recipe
        margin = float(getattr(r, "margin", 0))
        algo = str(getattr(r, "amax_compute_algo", "max"))
        e4m3_only = "E4M3" in str(getattr(r, "fp8_format", "")) and "HYBRID" not in str(
            getattr(r, "fp8_format", "")
        )
        out = np.zeros((len(self.tensors), len(BASE_COLUMNS)))  # no quality statistics from TE's state
        for j, (k, _, _) in enumerate(self._where):
            fmt = "e4m3" if e4m3_only else self.tensors[j]["format"]
            # a resized history: compare against an empty queue (its newest entries count as new)
            prev_col = prev[:-1, j] if prev.shape[0] == cur.shape[0] else np.zeros(cur.shape[0] - 1)
            out[j] = te_step_row(
                prev_col, cur[:-1, j], np.float32(prev[-1, j]), fmt, margin, algo, counted[k]
            )
        return out

    def take(self):
        snap = self._snapshot()
        if snap is None:
            return None
        counted, self._forwards = self._forwards, [0] * len(self.layers)
        self._last = snap
        return snap, counted

    # poll, advance (as ``StatsReader.advance``: whether TE cast anything since the last call, the previous
    # copy) and flush: ``LateReader``'s, each copy tagged with the forwards counted in its step

    def _hand_out(self, counted: list[int], host: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The step whose end ``host`` holds, against the copy before it (one step late: ready by now)."""
        cur = host.numpy()
        prev = self._prev
        if prev is None:  # TE's initial state: an empty history, scales of 1
            prev = np.zeros_like(cur)
            prev[-1] = 1.0
        self._prev = cur
        return 0, torch.from_numpy(self._rows(prev, cur, counted))

    def read_now(self):
        return None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def apply_commands(self, commands: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """Model-wide ``margin`` / ``amax_compute_algo`` on TE's recipe object; the rest rejected."""
        acks = []
        for c in commands:
            cid, target, changes = c.get("id"), c.get("target") or "model", c.get("changes")
            reason = None
            if target != "model":
                reason = (
                    "Transformer Engine's recipe belongs to the fp8_autocast region: only model-wide changes"
                )
            elif not isinstance(changes, dict) or not changes:
                reason = f"changes: expected a non-empty object, got {changes!r}"
            elif set(changes) - set(_TE_SETTINGS):
                bad = sorted(set(changes) - set(_TE_SETTINGS))[0]
                reason = f"{bad}: not changeable in a running Transformer Engine job ({_TE_SETTINGS} are)"
            elif changes.get("amax_compute_algo", "max") not in ("max", "most_recent"):
                algo = changes["amax_compute_algo"]
                reason = f"amax_compute_algo: expected 'max' or 'most_recent', got {algo!r}"
            elif "margin" in changes and (
                isinstance(changes["margin"], bool)
                or not isinstance(changes["margin"], (int, float))
                or not 0 <= changes["margin"] <= 64
            ):
                reason = f"margin: expected a number from 0 to 64, got {changes['margin']!r}"
            elif self.recipe is None:
                reason = "no FP8 step has run yet: Transformer Engine has no recipe to change"
            if reason is not None:
                acks.append({"command_id": cid, "state": "rejected", "reason": reason})
                continue
            for key, value in changes.items():
                setattr(self.recipe, key, value)  # TE reads it at its next scale update
            acks.append({"command_id": cid, "state": "applied", "step": step + 1})
        return acks
