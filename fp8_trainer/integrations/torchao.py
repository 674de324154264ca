"""Watching a torchao FP8 model: the statistics of the scales torchao really uses.

A model converted by ``torchao.float8.convert_to_float8_training`` with the tensorwise recipe (dynamic
scaling, one scale per tensor) casts, in each ``Float8Linear``, the input and the weight in forward and
grad_output in backward, each with ``scale = FP8_MAX / amax`` of that very tensor. ``watch_torchao(model)``
hooks the same three tensors (``fp8_trainer.shadow.HookedState``: a forward hook for input and weight, a
tensor hook on the layer's output for grad_output) and records them with fp8scope's statistics call, using
the scale computed as torchao computes it (torchao 0.14-0.18, ``torchao/float8/float8_utils.py``,
``amax_to_scale`` and ``tensor_to_amax``; ``float8_linear.py`` for which tensor is cast where):

* ``amax = max(|x|)`` in the tensor's own dtype (a NaN element makes it NaN: no NaN-ignoring maximum);
* ``scale = float32(fp8_max / max(float64(amax), 1e-12))``: a zero amax gives a huge scale, not 1;
* with ``round_scales_to_power_of_2``, ``scale = exp2(floor(log2(scale)))``;
* so a NaN element makes the scale NaN and every element of torchao's FP8 tensor NaN. The row then shows
  ``amax`` with NaN ignored (as every fp8scope statistic), ``scale`` NaN (torchao's, flagged as it is),
  ``nonfinite`` = numel (the whole FP8 tensor), no overflow or underflow, and ``err_sq`` +inf (SQNR -inf dB);
* the input is first cast to the autocast dtype when CUDA autocast is on (torchao's ``forward`` does so).

The FP8 tensor is dropped: torchao makes its own. ``Monitor`` watches such a model by itself. Recipe
commands: ``fp8_enabled`` (a layer runs as a plain ``nn.Linear`` until turned back on) works; the others
are rejected with the reason (the scale comes from the tensor itself: no margin, history or interval).
Layers whose casts are not tensorwise and dynamic (rowwise recipes) are left out, with the reason logged.
"""

from __future__ import annotations

import logging
import math
import types

import torch
from torch import nn

from fp8_protocol.stats import ERR_SQ, NONFINITE, OVERFLOW, SCALE, STAT_COLUMNS, SUBNORMAL, UNDERFLOW

from ..block_linear import merge_block_row
from ..recipe import CurrentScaling, Format
from ..shadow import HookedState

__all__ = ["TorchaoState", "has_torchao_layers", "torchao_scale", "watch_torchao"]

log = logging.getLogger(__name__)

#: torchao's lower bound on an amax before the division (``torchao.float8.float8_utils.EPS``)
TORCHAO_EPS = 1e-12
_CASTS = ("cast_config_input", "cast_config_weight", "cast_config_grad_output")
#: the casts of the same tensors for the other backward GEMM (the same scale under the tensorwise recipe)
_GRAD_CASTS = (
    "cast_config_input_for_grad_weight",
    "cast_config_weight_for_grad_input",
    "cast_config_grad_output_for_grad_weight",
)


def _is_float8_linear(m: nn.Module) -> bool:
    cls = type(m)
    return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")


def has_torchao_layers(model: nn.Module) -> bool:
    """True if ``model`` has a torchao ``Float8Linear`` (checked without importing torchao)."""
    return any(_is_float8_linear(m) for m in model.modules())


def torchao_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype, round_to_power_of_2: bool = False
) -> torch.Tensor:
    """The float32 0-dim scale torchao's tensorwise recipe computes from ``amax`` (module docstring)."""
    fmax = float(torch.finfo(fp8_dtype).max)
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=TORCHAO_EPS)).to(torch.float32)
    if round_to_power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _all_nan_cast(row: torch.Tensor, numel: int) -> torch.Tensor:
    """The statistics row of a tensor torchao cast with a NaN scale: amax as fp8scope reads it (NaN ignored),
    scale NaN, every element non-finite in FP8 (``nonfinite`` = numel, nothing counted as overflow or
    underflow), the round trip's error +inf (SQNR -inf dB: nothing survived); ``sum_sq`` and ``min_abs`` of
    the tensor itself, which are the tensor's whatever the cast did."""
    out = row.clone()
    out[SCALE] = math.nan
    out[OVERFLOW] = out[UNDERFLOW] = 0.0
    out[NONFINITE] = float(numel)
    if out.shape[0] == len(STAT_COLUMNS):
        out[ERR_SQ] = math.inf
        out[SUBNORMAL] = 0.0
    return out


def _unsupported(m: nn.Module) -> str | None:
    """Why torchao layer ``m`` cannot be watched (``None``: tensorwise dynamic casts throughout)."""
    c = m.config
    for name in (*_CASTS, *_GRAD_CASTS):
        cast = getattr(c, name, None)
        if cast is None:
            continue
        kind = getattr(cast.scaling_type, "value", str(cast.scaling_type))
        gran = getattr(cast.scaling_granularity, "value", str(cast.scaling_granularity))
        if kind != "dynamic" or gran != "tensorwise":
            return f"{name} is {kind}/{gran}; only tensorwise dynamic scaling is watched"
    if getattr(c, "enable_fsdp_float8_all_gather", False):
        return "enable_fsdp_float8_all_gather casts the weight before the layer runs; not watched"
    return None


class TorchaoState(HookedState):
    """Statistics of a torchao model's ``Float8Linear`` layers with torchao's own scales."""

    source = "torchao"
    weight_once_per_step = False  # torchao casts the weight at every forward, micro-batches included

    def __init__(self, layers: list[tuple[str, nn.Module]], device=None):
        self.modules = [m for _, m in layers]
        self._role_dtypes = []
        for m in self.modules:
            c = m.config
            self._role_dtypes += [getattr(c, n).target_dtype for n in _CASTS]
        pow2 = {bool(m.config.round_scales_to_power_of_2) for m in self.modules}
        e4m3_grad = any(
            m.config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn for m in self.modules
        )
        recipe = CurrentScaling(Format.E4M3 if e4m3_grad else Format.HYBRID, power_2_scale=True in pow2)
        self._pow2 = [bool(m.config.round_scales_to_power_of_2) for m in self.modules]
        super().__init__(layers, recipe, device=device)

    def _rebuild(self) -> None:
        super()._rebuild()
        if getattr(self, "_role_dtypes", None):  # each layer's own config, whatever the summary recipe says
            self.dtypes = list(self._role_dtypes)

    def layer_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Float8Linear.forward casts to the CUDA autocast dtype when (CUDA) autocast is on
        if torch.is_autocast_enabled():
            return x.to(torch.get_autocast_dtype("cuda"))
        return x

    def record(self, i: int, x: torch.Tensor) -> None:
        from fp8_kernels import new_stats, quantize_with_stats

        dtype = self.dtypes[i]
        amax = (
            torch.max(torch.abs(x)).to(torch.float32) if x.numel() else x.new_zeros((), dtype=torch.float32)
        )
        scale = torchao_scale(amax, dtype, self._pow2[i // 3])
        stats = self.stats[i]
        # a NaN in x makes torchao's amax NaN, its scale NaN and so every element of its FP8 tensor NaN:
        # the row says so (below); the statistics are taken with a stand-in scale, no host read deciding
        lost = torch.isnan(scale)
        fresh = new_stats(device=stats.device, quality=stats.shape[0] == len(STAT_COLUMNS))
        _, row = quantize_with_stats(x, torch.where(lost, 1.0, scale), dtype, fresh, amax=amax)
        row = torch.where(lost, _all_nan_cast(row, x.numel()), row)
        merge_block_row(stats, row, None, None)  # as the quantize call would have accumulated it

    def apply_settings(self, layer: int | None, changes: dict) -> dict:
        other = sorted(set(changes) - {"fp8_enabled"})
        if other:
            raise ValueError(
                f"{other[0]}: torchao's tensorwise recipe computes each scale from the tensor's own amax in "
                "the same step, so there is no margin, amax history, algorithm or interval to change; only "
                "fp8_enabled (FP8 off/on per layer or for the model) applies to a torchao model"
            )
        previous = super().apply_settings(layer, changes)
        for k, m in enumerate(self.modules):
            if self.enabled[k]:
                m.__dict__.pop("forward", None)  # torchao's Float8Linear.forward again
            else:
                m.forward = types.MethodType(nn.Linear.forward, m)  # a plain high-precision linear
        return previous


def watch_torchao(model: nn.Module) -> TorchaoState:
    """Record the statistics of every tensorwise torchao ``Float8Linear`` of ``model`` (see the module
    docstring); afterwards ``step_stats``, ``StatsReader`` and ``Monitor`` read them like an FP8 model's.

    Raises:
        ValueError: no torchao layer can be watched.
    """
    state = getattr(model, "_fp8_state", None)
    if isinstance(state, TorchaoState):
        return state
    layers, left = [], {}
    for name, m in model.named_modules():
        if _is_float8_linear(m):
            why = _unsupported(m)
            if why:
                left[name] = why
            else:
                layers.append((name, m))
    if left:
        log.warning(
            "watch_torchao: %d layer(s) not watched: %s",
            len(left),
            "; ".join(f"{k}: {v}" for k, v in left.items()),
        )
    if not layers:
        raise ValueError("model: no torchao Float8Linear layer with tensorwise dynamic scaling to watch")
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    state = TorchaoState(layers, device=device)
    state.ineligible = left
    model._fp8_state = state
    log.info("watch_torchao: %d torchao Float8Linear layer(s) watched", len(layers))
    return state
