"""fp8scope FP8 training runtime: FP8 Linear layers with per-tensor or block scaling and health statistics."""

from fp8_kernels import STAT_COLUMNS

from . import recipe
from .autocast import fp8_autocast, is_fp8_enabled
from .convert import (
    convert_to_fp8,
    end_step,
    get_fp8_state,
    get_layer_recipes,
    ineligible_layers,
    set_layer_recipe,
    tensor_table,
)
from .linear import Conv1D, Linear
from .recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling
from .shadow import shadow, unshadow
from .state import TensorInfo
from .stats import StatsReader, step_stats
from .weight_cache import weights_changed

__all__ = [
    "STAT_COLUMNS",
    "Conv1D",
    "CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "Format",
    "Linear",
    "MXFP8BlockScaling",
    "Monitor",
    "StatsReader",
    "TensorInfo",
    "convert_to_fp8",
    "end_step",
    "fp8_autocast",
    "get_fp8_state",
    "get_layer_recipes",
    "ineligible_layers",
    "is_fp8_enabled",
    "recipe",
    "set_layer_recipe",
    "shadow",
    "step_stats",
    "tensor_table",
    "unshadow",
    "weights_changed",
]


def __getattr__(name: str):
    # the telemetry client (and its HTTP and JSON dependencies) loads only when asked for: the runtime
    # itself needs torch alone
    if name == "Monitor":
        from .monitor import Monitor

        return Monitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
