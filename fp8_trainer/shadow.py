"""Shadow mode: FP8 what-if statistics for a model that is not (yet) in FP8, without changing its numerics.

``shadow(model, recipe)`` registers every ``nn.Linear`` (and transformers ``Conv1D``) of a bf16/fp32 model
the way ``convert_to_fp8`` registers FP8 layers (same tensor table, ``<module path>.<role>``), but leaves
the layers as they are. Hooks read the three tensors an FP8 layer would quantize:

    input        forward hook: the layer's input (in the autocast dtype where autocast is on, as an FP8
                 ``Linear`` would see it)
    weight       the same forward hook: the layer's weight
    grad_output  a tensor hook on the layer's output: the gradient flowing into the layer in backward

and records their statistics under the recipe's scaling state (delayed scaling with its amax history, or
current scaling): on a GPU with the runtime's own quantize-with-statistics call (the fused kernel; the FP8
tensor is dropped, nothing is read on the host), on the CPU with ``cpu_stats_row``, which gives the same
row bit for bit without making the FP8 tensor. The step's amaxes enter the history when backward ends,
exactly as for an FP8 model, so ``step_stats``, ``StatsReader``, ``set_layer_recipe`` and ``Monitor`` work
unchanged: the statistics say what each tensor's amax, scale, overflow and underflow *would be* under the
recipe, while the model trains in its own precision. The hooks return nothing, so forward and backward
values are bit for bit those of the model without shadow. Activation checkpointing's recompute is not
counted twice.

The hook machinery (``HookedState``) is shared with the torchao watcher (``integrations/torchao.py``),
which reads the same three tensors of torchao's ``Float8Linear`` layers and records them with the scales
torchao computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from fp8_kernels import current_scale_reference, fp8_max, overflow_threshold, underflow_threshold
from fp8_kernels.reference.block_quantize import MXFP8_BLOCK
from fp8_kernels.reference.quantize import min_nonzero_reference, quality_row_reference
from fp8_protocol.stats import AMAX, BASE_COLUMNS, MERGE, OVERFLOW, SCALE, STAT_COLUMNS

from .block_linear import quantize_block_tensor
from .distributed import resolve_amax_group
from .linear import Linear, is_conv1d
from .recipe import DelayedScaling, Recipe
from .state import FP8State
from .step import in_backward

__all__ = ["HookedState", "ShadowState", "is_conv1d", "shadow", "unshadow"]

log = logging.getLogger(__name__)


class HookedState(FP8State):
    """An ``FP8State`` fed by hooks on layers that stay as they are (see the module docstring).

    ``step_boundary`` (default True) closes the step when a backward pass ends; the trainer integrations set
    it False and call ``fp8_trainer.end_step(model)`` at each optimizer step, so micro-batches of one step
    accumulate (amax max, counts summed) into one history entry.
    """

    #: what the monitor registers the run as (its ``config["fp8_source"]``)
    source = "hooked"

    #: a weight's statistics are recorded once per optimizer step, when an FP8 runtime would quantize it
    #: (``fp8_trainer.weight_cache``); False where the watched runtime casts it at every forward (torchao)
    weight_once_per_step = True

    def __init__(self, layers: list[tuple[str, nn.Module]], recipe: Recipe, device=None):
        self._host_rows: dict[int, list[float]] = {}  # CPU rows of the step in progress (record)
        self._scale_view = None
        # a Conv1D stores its weight (in, out): the FP8 weight, whose blocks run along `in`, is its transpose
        self._weight_transposed = [is_conv1d(m) for _, m in layers]
        self._short_tokens_warned = False
        super().__init__(
            [name for name, _ in layers], recipe, device=device, layer_shapes=_layer_shapes(layers)
        )
        self.step_boundary = True
        self.handles = [
            m.register_forward_hook(partial(_forward_hook, self, k)) for k, (_, m) in enumerate(layers)
        ]

    def layer_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input the layer's FP8 cast sees (overridden where a runtime casts first)."""
        if torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def layer_weight(self, k: int, weight: torch.Tensor) -> torch.Tensor:
        """Layer ``k``'s weight as an FP8 ``Linear`` holds it, ``(out_features, in_features)``."""
        return weight.t() if self._weight_transposed[k] else weight

    def record(self, i: int, x: torch.Tensor) -> None:
        """Tensor ``i``'s statistics into this step's row (the FP8 tensor itself is dropped)."""
        specs = self.block_specs[i // 3]
        if specs is not None:
            self._record_blocks(i, x, specs[i % 3])
            return
        if x.device.type != "cpu":
            self.quantize(i, x, True)  # the fused kernel: statistics in the pass that casts
            return
        dtype = self.dtypes[i]
        # a CPU tensor: reading the delayed scale waits for nothing (None: current scaling)
        scale = None if self.current[i // 3] else np.float32(self.scale_host()[i])
        quality = self.stats.shape[1] > len(BASE_COLUMNS)
        row = cpu_stats_row(x, scale, dtype, power_2_scale=self.power_2_scale, quality=quality)
        old = self._host_rows.get(i)
        if old is None:
            self._host_rows[i] = row
        else:  # as accumulate_stats: amax the max with the scale that scaled it, the rest per MERGE
            if row[AMAX] >= old[AMAX] or old[AMAX] != old[AMAX]:
                old[AMAX], old[SCALE] = row[AMAX], row[SCALE]
            for c in range(OVERFLOW, len(row)):  # the counts, numel, sums of squares; min_abs the min
                old[c] = min(old[c], row[c]) if MERGE[STAT_COLUMNS[c]] == "min" else old[c] + row[c]

    def _record_blocks(self, i: int, x: torch.Tensor, spec) -> None:
        """A block-scaled tensor's statistics, per element and per block, of the row-wise copy an FP8
        ``Linear`` makes (square blocks for a 2-D-scaled weight), as ``block_linear`` records them."""
        if spec.scale_format == "e8m0" and x.shape[0] % MXFP8_BLOCK and not self._short_tokens_warned:
            # the row-wise copy has whole blocks (features are multiples of 32), the column-wise one would not
            self._short_tokens_warned = True
            log.warning(
                "shadow: %s has %d rows (tokens), not a multiple of %d: an MXFP8 run would refuse it "
                "(Transformer Engine does); its statistics are recorded all the same",
                self.tensor_table()[i].name,
                x.shape[0],
                MXFP8_BLOCK,
            )
        quantize_block_tensor(
            x, self.dtypes[i], spec, rowwise=False, columnwise=False, **self.block_rows(i, True)
        )

    def scale_host(self) -> np.ndarray:
        """The scales as a numpy view (CPU state only), refreshed when the scale tensor is replaced."""
        if self._scale_view is None or self._scale_view[0] is not self.scale:
            self._scale_view = (self.scale, self.scale.numpy())
        return self._scale_view[1]

    def _flush_host_rows(self) -> None:
        """The step's CPU rows into the statistics buffer, in one write (before anyone reads it)."""
        if self._host_rows:
            idx = list(self._host_rows)
            # the buffer's rows are untouched this step (amax 0, counts 0): accumulating is assigning
            self.stats[idx] = torch.tensor([self._host_rows[i] for i in idx], dtype=torch.float64)
            self._host_rows = {}

    def end_step(self) -> None:
        self._flush_host_rows()
        super().end_step()

    def remove(self) -> None:
        """Remove the hooks (the statistics recorded so far stay readable)."""
        for h in self.handles:
            h.remove()
        self.handles = []


def cpu_stats_row(
    x: torch.Tensor,
    scale: np.float32 | None,
    fp8_dtype: torch.dtype,
    *,
    power_2_scale: bool = False,
    quality: bool = True,
) -> list[float]:
    """The statistics row ``quantize_with_stats`` records for ``x`` on the CPU, without making the FP8 tensor.

    Shadow mode needs only the row, and on the CPU it can look at values (nothing to synchronise with), so
    the counting passes run only where the maximum and minimum say they can find something: most tensors
    of a healthy step need an absolute value, a max and a min. ``scale=None``: current scaling's scale from
    this tensor's amax. Bit for bit the reference's row (``tests/trainer/test_shadow.py`` checks edge cases);
    with ``quality`` the quality columns too, from the reference's own functions on the same values (the
    base columns alone, 6, without).
    """
    with np.errstate(over="ignore", invalid="ignore"):  # Inf products are what the counts are about
        return _cpu_stats_row(x, scale, fp8_dtype, power_2_scale, quality)


def _cpu_stats_row(
    x: torch.Tensor, scale, fp8_dtype: torch.dtype, power_2_scale: bool, quality: bool
) -> list[float]:
    xf = x.detach() if x.dtype == torch.float32 else x.detach().to(torch.float32)
    a = np.abs(xf.contiguous().numpy())
    numel = a.size
    if numel == 0:
        base = [0.0, float(1.0 if scale is None else scale), 0.0, 0.0, 0.0, 0.0]
        return base + ([0.0, 0.0, 0.0, math.inf] if quality else [])
    top = a.max()  # propagates NaN: finite means no NaN and no Inf
    n_nan = n_inf = 0
    if not np.isfinite(top):
        n_nan = int(np.count_nonzero(np.isnan(a)))
        n_inf = int(np.count_nonzero(np.isinf(a)))
        top = np.fmax.reduce(a, axis=None)  # NaN ignored, as the kernels' amax
        top = np.float32(0.0) if np.isnan(top) else top
    amax = np.float32(top)
    if scale is None:
        scale_t = current_scale_reference(torch.tensor(amax), fp8_dtype, power_2_scale=power_2_scale)
        scale = np.float32(scale_t.item())
    threshold, inclusive = overflow_threshold(fp8_dtype)
    zero_at = np.float32(underflow_threshold(fp8_dtype))
    scale = np.float32(scale)
    # |x|*scale (float32) is monotonic in |x|: the max decides whether the overflow pass can find anything,
    # and each count compares |x| with the float32 bound that is exactly equivalent to the product's test
    over = 0
    scaled_top = amax * scale
    if n_inf or (scaled_top >= threshold if inclusive else scaled_top > threshold):
        keeps = _largest_factor(scale, np.float32(threshold), strict=inclusive)  # largest |x| not saturating
        over = int(np.count_nonzero(a > keeps)) - n_inf  # Inf inputs are non-finite, not overflow
    # one counting pass finds the elements at or below the bound; zeros (no underflow) only if it found any
    vanishes = _largest_factor(scale, zero_at, strict=False)  # largest |x| that quantizes to zero
    under = int(np.count_nonzero(a <= vanishes))  # NaN compares false
    if under:
        under -= int(np.count_nonzero(a == 0))
    row = [float(amax), float(scale), float(over), float(under), float(n_nan + n_inf), float(numel)]
    if quality:
        row += _quality_columns(
            a if not (n_nan or n_inf) else np.where(np.isfinite(a), a, 0), scale, fp8_dtype
        )
    return row


def _quality_columns(finite_abs: np.ndarray, scale: np.float32, fp8_dtype: torch.dtype) -> list[float]:
    """``(sum_sq, err_sq, subnormal, min_abs)`` of ``|x|`` with the non-finite elements as 0, with the
    reference's own function on the same float32 values (``|x * scale|`` and its FP8 codes), so the same
    bits."""
    ax = torch.from_numpy(np.ascontiguousarray(finite_abs, dtype=np.float32))
    scale_t = torch.tensor(scale, dtype=torch.float32)
    a = ax * scale_t  # |x * scale|, as the reference's
    q = a.clamp(max=fp8_max(fp8_dtype)).to(fp8_dtype)  # |q|: the codes of the reference's q, sign aside
    row = quality_row_reference(a, q, scale_t, min_nonzero_reference(ax), fp8_dtype, mask_codes=False, x=ax)
    return row.tolist()


def _largest_factor(scale: np.float32, bound: np.float32, *, strict: bool) -> np.float32:
    """The largest float32 ``a >= 0`` with ``float32(a * scale) <= bound`` (``< bound`` if ``strict``).

    The products are monotonic in ``a``, so ``float32(|x| * scale) <= bound`` holds exactly for
    ``|x| <= a``: one comparison instead of a multiplication pass and a comparison.
    """

    def ok(a: np.float32) -> bool:
        p = np.float32(a * scale)
        return p < bound if strict else p <= bound

    inf = np.float32(np.inf)
    a = np.float32(bound / scale)  # within an ulp or two of the answer
    while a > 0 and not ok(a):
        a = np.nextafter(a, np.float32(0))
    while a < inf and ok(np.nextafter(a, inf)):
        a = np.nextafter(a, inf)
    return a


@torch.compiler.disable  # under torch.compile: a graph break, the hook runs as it does eagerly
def _forward_hook(state: HookedState, k: int, module: nn.Module, args, output) -> None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not state.enabled[k]:
        return
    weight = module.weight
    recompute = in_backward()  # activation checkpointing's recompute, inside backward
    tracker = state.tracker
    if not recompute:
        tracker.original_forward(k)  # reentrant checkpointing's original forward runs under no_grad
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return  # evaluation: nothing to record (as an FP8 layer under no_grad)
    if recompute and tracker.was_recorded(k):
        return  # non-reentrant mode: the original forward was counted, and its graph gets the gradient
    x = state.layer_input(module, x)
    if state.device != x.device:
        state.to(x.device)
    if not tracker.pending:  # the step's first recorded forward
        tracker.pending = True
        state.group = resolve_amax_group(None, state.reduce_amax)
    tracker.step_complete = state.step_boundary
    tracker.mark_recorded(k)
    # detached: the statistics build no graph
    state.record(3 * k, x.detach().reshape(-1, x.shape[-1]))
    if state.weight_once_per_step:
        cache = state.weight_cache  # holds no copy here: whether this weight was recorded in this step
        key = cache.key(weight, state.version, "recorded")
        if cache.lookup(k, key) is None:
            state.record(3 * k + 1, state.layer_weight(k, weight.detach()))
            cache.store(k, key, weight, True)
    else:
        state.record(3 * k + 1, state.layer_weight(k, weight.detach()))
    if recompute:
        # reentrant mode: the gradients flow through a nested backward pass; queue the end of the step on
        # the outer one, which is running now, so that the step closes once, when the whole backward ends
        _queue_end(state)
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(partial(_grad_hook, state, k))


def _grad_hook(state: HookedState, k: int, grad: torch.Tensor) -> None:
    # returns None: the gradient flows on unchanged
    if not state.enabled[k]:
        return
    state.record(3 * k + 2, grad.detach().reshape(-1, grad.shape[-1]))
    _queue_end(state)


def _queue_end(state: HookedState) -> None:
    """Close the step when the running backward pass ends (once per pass)."""
    state.tracker.queue_end_of_backward(state.on_backward_end)


class ShadowState(HookedState):
    """Scaling state and what-if statistics of a model in shadow mode."""

    source = "shadow"


def _layer_shapes(layers: list[tuple[str, nn.Module]]) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of each watched layer (what MXFP8's multiples of 32 are checked on)."""
    shapes = []
    for _, m in layers:
        w = m.weight
        shapes.append((w.shape[1], w.shape[0]) if is_conv1d(m) else (w.shape[0], w.shape[1]))
    return shapes


def _shadow_layers(model: nn.Module, module_filter_fn) -> list[tuple[str, nn.Module]]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            raise ValueError(
                f"model: {name or '<root>'} is already an FP8 layer; shadow mode is for models not in FP8 "
                "(monitor an FP8 model with Monitor(..., recipe) instead)"
            )
        if (isinstance(m, nn.Linear) or is_conv1d(m)) and (
            module_filter_fn is None or module_filter_fn(m, name)
        ):
            out.append((name, m))
    return out


def shadow(
    model: nn.Module,
    recipe: Recipe | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> ShadowState:
    """Attach FP8 what-if statistics to every ``nn.Linear`` and transformers ``Conv1D`` of ``model``.

    The model's numerics do not change. Afterwards ``tensor_table(model)``, ``step_stats(model)``,
    ``StatsReader(model)`` and ``Monitor(url, name, model, recipe)`` see the shadow statistics as they
    would an FP8 model's, and ``set_layer_recipe`` changes the what-if recipe (a margin, a history length,
    current scaling, a layer left out).

    Args:
        model: a model in bf16 / fp32 (no FP8 layers).
        recipe: the FP8 recipe to evaluate (default ``DelayedScaling()``).
        module_filter_fn: ``(module, fqn) -> bool``; only layers it accepts are watched.
    Returns:
        The model's ``ShadowState`` (``.remove()`` detaches the hooks).
    Raises:
        ValueError: the model has FP8 layers, is shadowed already, or has no linear layer.
    """
    old = getattr(model, "_fp8_state", None)
    if old is not None and old.n_layers:
        raise ValueError("model: already has an FP8 scaling state (converted, watched or shadowed)")
    layers = _shadow_layers(model, module_filter_fn)
    if not layers:
        raise ValueError("model: no nn.Linear or Conv1D layer to shadow")
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    state = ShadowState(layers, recipe if recipe is not None else DelayedScaling(), device=device)
    model._fp8_state = state
    log.info("shadow: FP8 what-if statistics on %d layer(s)", len(layers))
    return state


def unshadow(model: nn.Module) -> None:
    """Detach shadow mode from ``model`` (hooks removed, scaling state dropped)."""
    state = getattr(model, "_fp8_state", None)
    if isinstance(state, ShadowState):
        state.remove()
        del model._fp8_state
