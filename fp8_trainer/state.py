"""The per-model scaling state: tensor registry, amax history, scales, the step statistics buffer.

One ``FP8State`` belongs to one converted model and is shared by all its FP8 ``Linear`` layers. Layer ``k``
(the k-th FP8 Linear in ``model.named_modules()`` order) owns tensor indices ``3k`` (input), ``3k+1``
(weight) and ``3k+2`` (grad_output); these indices and the names ``<module path>.<role>`` never change.

Device tensors (``n`` = number of quantized tensors):

* ``amax_history`` ``(L, n)`` float32, newest entry in row 0; ``scale`` and ``scale_inv`` ``(n,)`` float32
  in the ``fp8_kernels.aligned_scales`` layout (stride 4: every tensor's scale on a 16-byte boundary, so a
  0-dim view ``scale_inv[i]`` can go to ``torch._scaled_mm`` as it is, which cuBLASLt requires);
* ``stats`` ``(n, 10)`` float64, the statistics of the step in progress (columns ``STAT_COLUMNS``, the
  quality columns included; ``(n, 6)``, the base columns alone, where ``quality_stats`` is off);
  ``last_stats`` the buffer of the last completed step. Each step gets a fresh buffer, so a
  ``last_stats`` handed out earlier is a snapshot that later steps never overwrite;
* per-tensor recipe settings (``fp8_max``, ``margin``, ``history_len``, ``interval``, algorithm,
  enabled), rebuilt only when a recipe changes, never on the hot path;
* ``block_stats`` ``(n, BLOCK_WIDTH)`` float64, the block-scaling part of the step's statistics (the six
  ``BLOCK_COLUMNS`` and the scale exponent histogram, ``fp8_trainer.block_linear``), made once a layer of
  the model has been block-scaled and kept from then on (zeros for per-tensor-scaled tensors). Readers then
  get each step as one ``(n, C + BLOCK_WIDTH)`` block (``split_block_stats`` parts it); ``last_stats``
  stays the ``(n, C)`` statistics and ``last_block_stats`` holds the block part.

Block-scaled layers (``scaling`` ``"mxfp8"`` or ``"block"``) take their scales from each block in each
step; their rows' amaxes still enter the amax history, so a layer switched back to delayed scaling starts
from a scale that follows its tensors.

Step boundary (see ``end_step``): the statistics of a step are folded into the history once, by
``end_step``. It runs automatically at the end of the backward pass of a forward made in an
``fp8_autocast`` region with ``step_boundary=True`` (the default), or lazily at the next recorded forward
of another region if no backward came; gradient-accumulation micro-batches use ``step_boundary=False``.

Layers with FP8 turned off keep their rows: amax, counts and numel are zero, ``scale`` is the last scale,
and neither their history nor their scale changes until FP8 is turned back on.

Checkpoints (``layer_extra_state``, ``load_layer_extra_state``): every FP8 ``Linear`` saves its slice of
this state as its module extra state; the format, its checks and the restore are ``fp8_trainer.extra_state``.
The FP8 copies of the weights held within a step are ``fp8_trainer.weight_cache``'s (``quantized_weight``).
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch

from fp8_kernels import (
    aligned_scales,
    as_aligned_scales,
    fused_scale_update,
    new_stats,
    quantize_current,
    quantize_current_transposed,
    quantize_with_stats,
    quantize_with_stats_transposed,
)
from fp8_protocol.stats import AMAX, MIN_ABS, SCALE
from fp8_protocol.tensors import TensorInfo

from . import extra_state
from .block_linear import block_specs, new_block_stats
from .distributed import all_reduce_amax
from .extra_state import EXTRA_STATE_VERSION
from .formats import ROLES
from .linear_ops import register_state
from .merge import merge_step_stats
from .recipe import BLOCK_SCALINGS, LAYER_SETTINGS, DelayedScaling, Recipe, base_settings, validate_setting
from .scaling import scale_update_reference
from .step import StepTracker
from .weight_cache import WeightCache

__all__ = [
    "EXTRA_STATE_VERSION",
    "FP8State",
    "LAYER_SETTINGS",
    "StepTracker",
    "TensorInfo",
    "merge_step_stats",
]


def _move_into(held: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in ``held`` (made anew only where missing or of another shape, so its address stays
    from step to step), and ``t`` zeroed in place: a capturable step's hand-over of its statistics."""
    if held is None or held.shape != t.shape:
        held = torch.empty_like(t)
    held.copy_(t)
    t.zero_()
    return held


class _RowViewed:
    """A per-tensor vector of ``FP8State`` (``stats``, ``scale``, ``scale_inv``) whose row views
    ``FP8State._rows`` caches: the vector is kept as ``_<name>``, its views as ``_<name>_rows``, and assigning
    a new vector drops the views of the old one, so they are made again, once, at their next use."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._value, self._views = f"_{name}", f"_{name}_rows"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self._value)

    def __set__(self, obj: Any, value: torch.Tensor) -> None:
        setattr(obj, self._value, value)
        setattr(obj, self._views, None)


class FP8State:
    """Scaling state and statistics of every quantized tensor of one model."""

    def __init__(
        self,
        layer_names: list[str],
        recipe: Recipe | None = None,
        device=None,
        layer_shapes: list[tuple[int, int]] | None = None,
    ):
        self.layer_names = list(layer_names)
        # (out_features, in_features) per layer where known (convert_to_fp8): checked against MXFP8's 32
        self.layer_shapes = list(layer_shapes) if layer_shapes is not None else None
        self.n_layers = len(self.layer_names)
        self.n_tensors = 3 * self.n_layers
        self.recipe: Recipe = recipe if recipe is not None else DelayedScaling()
        self.model_overrides: dict[str, Any] = {}
        self.layer_overrides: list[dict[str, Any]] = [{} for _ in self.layer_names]
        self.ineligible: dict[str, str] = {}
        self.device = torch.device(device if device is not None else "cpu")
        n = self.n_tensors
        self.amax_history = torch.zeros(self._base()["amax_history_len"], n, device=self.device)
        self.scale = aligned_scales(n, self.device).fill_(1.0)
        self.scale_inv = aligned_scales(n, self.device).fill_(1.0)
        self.step_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self.last_stats: torch.Tensor | None = None
        self.block_stats: torch.Tensor | None = None  # made once a layer is block-scaled (module docstring)
        self.last_block_stats: torch.Tensor | None = None
        self.steps = 0  # completed steps (host-side bookkeeping, never read from a tensor)
        self.tracker = StepTracker()  # the step in progress: pending, region, recorded forwards
        self.linear_plans: dict = {}  # per layer and input shape: fp8_trainer.linear_ops.LayerPlan
        # called with the state as a step closes, before its amaxes are reduced (fp8_trainer.tensor_parallel
        # merges the rows of sharded tensors there)
        self.before_step_end: list[Callable[[FP8State], None]] = []
        # tensor index -> a function to call once with that tensor's next training value (capture_once)
        self.captures: dict[int, Any] = {}
        self.handle = register_state(self)  # how the custom operators find it (fp8_trainer.linear_ops)
        self.group = None
        self.version = 0  # set before _rebuild (below), which bumps it
        # capturable: end_step updates the scaling state in place (fixed buffers, what a CUDA graph replays;
        # see fp8_trainer.graphs); version: bumped whenever buffers are replaced outside a step (recipe
        # change, checkpoint load, move), which a captured graph must be re-captured for
        self.capturable = False
        # per layer, its weight quantized by the step's first recording forward: the later micro-batches
        # of the step reuse it (fp8_trainer.weight_cache); emptied when a step closes
        self.weight_cache = WeightCache()
        # one [statistics of the FP8 steps closed since the reader last took them, how many] per reader
        self._inboxes: list[list] = []
        # steps to run again that the readers have had already (fp8_trainer.rewind): not handed out twice
        self.reruns = 0
        # the quality statistics (sum_sq, err_sq, subnormal, min_abs) in the same quantize pass; off only
        # to measure what they cost (set_quality_stats, bench/quality_overhead.py)
        self.quality_stats = True
        # the quality columns in every ``quality_every``-th step only (0, N, 2N, ...; set_quality_schedule):
        # the other steps' quantize passes run the leaner kernels and record the base columns
        self.quality_every = 1
        self._new_stats_buffer()
        self._check_shapes(self.layer_settings)
        self._rebuild()

    @property
    def pending(self) -> bool:
        """Statistics were recorded since the last ``end_step`` (``tracker.pending``)."""
        return self.tracker.pending

    @pending.setter
    def pending(self, value: bool) -> None:
        self.tracker.pending = value

    # ----- recipe and settings (host side; never on the hot path) -----
    def _base(self) -> dict[str, Any]:
        return {**base_settings(self.recipe), **self.model_overrides}

    def layer_settings(self, k: int) -> dict[str, Any]:
        """Effective settings of layer ``k``: recipe, then model-wide overrides, then the layer's own."""
        return {**self._base(), **self.layer_overrides[k]}

    def layer_index(self, name: str) -> int:
        try:
            return self.layer_names.index(name)
        except ValueError:
            raise ValueError(f"layer_name: unknown FP8 layer {name!r}") from None

    def set_recipe(self, recipe: Recipe) -> None:
        """Make ``recipe`` the base recipe (layer overrides stay on top of it)."""
        if recipe is not self.recipe and recipe != self.recipe:  # identity first: the usual case, per layer
            base = {**base_settings(recipe), **self.model_overrides}
            self._check_shapes(lambda k: {**base, **self.layer_overrides[k]})
            self.recipe = recipe
            self._rebuild()

    def _check_shapes(self, settings) -> None:
        """Refuse MXFP8 for a layer whose dimensions are not multiples of 32 (``settings(k)``: the layer's
        settings as they would be), before anything changes."""
        if self.layer_shapes is None:
            return
        for k, (out_f, in_f) in enumerate(self.layer_shapes):
            if settings(k)["scaling"] == "mxfp8" and (out_f % 32 or in_f % 32):
                raise ValueError(
                    f"scaling: MXFP8 needs in_features and out_features divisible by 32; layer "
                    f"{self.layer_names[k] or '<root>'!r} is {in_f} -> {out_f} (Transformer Engine refuses "
                    "it too)"
                )

    def apply_settings(self, layer: int | None, changes: dict[str, Any]) -> dict[str, Any]:
        """Validate and apply ``changes`` to one layer (``None``: model-wide); return the previous values."""
        clean = {}
        for key, value in changes.items():
            if key not in LAYER_SETTINGS:
                raise ValueError(f"{key}: not a per-layer recipe setting; expected one of {LAYER_SETTINGS}")
            clean[key] = validate_setting(key, value)
        current = self._base() if layer is None else self.layer_settings(layer)
        previous = {key: current[key] for key in clean}
        target = self.model_overrides if layer is None else self.layer_overrides[layer]
        if layer is None:
            self._check_shapes(lambda k: {**self._base(), **clean, **self.layer_overrides[k]})
        else:
            self._check_shapes(lambda k: {**self.layer_settings(k), **(clean if k == layer else {})})
        target.update(clean)
        self._rebuild()
        return previous

    def _rebuild(self) -> None:
        """Recompute the per-tensor settings tensors; resize the history keeping the newest entries."""
        fp8_max, margin, recent, hist, interval, enabled = [], [], [], [], [], []
        self.dtypes, self.current, self.enabled = [], [], []
        self.block_specs: list = []  # per layer: (input, weight, grad_output) BlockSpecs, or None
        self.power_2_scale = bool(self._base()["power_2_scale"])
        for k in range(self.n_layers):
            s = self.layer_settings(k)
            self.current.append(s["scaling"] == "current")
            block = s["scaling"] in BLOCK_SCALINGS
            self.block_specs.append(block_specs(s["scaling"], self.recipe) if block else None)
            self.enabled.append(bool(s["fp8_enabled"]))
            for role in ROLES:
                fmt = s["fp8_format"].for_role(role)
                self.dtypes.append(fmt.dtype)
                fp8_max.append(fmt.max)
                margin.append(float(s["margin"]))
                recent.append(s["amax_compute_algo"] == "most_recent")
                hist.append(s["amax_history_len"])
                interval.append(s["interval"])
                enabled.append(bool(s["fp8_enabled"]))
        dev = self.device
        self.fp8_max = torch.tensor(fp8_max, dtype=torch.float32, device=dev)
        self.margin = torch.tensor(margin, dtype=torch.float32, device=dev)
        self.most_recent = torch.tensor(recent, dtype=torch.bool, device=dev)
        self.history_len = torch.tensor(hist, dtype=torch.int64, device=dev)
        self.interval = torch.tensor(interval, dtype=torch.int64, device=dev)
        self.enabled_t = torch.tensor(enabled, dtype=torch.bool, device=dev)
        length = max(hist) if hist else 1
        h = self.amax_history
        if h.shape[0] < length:
            h = torch.cat([h, h.new_zeros(length - h.shape[0], h.shape[1])])
        elif h.shape[0] > length:
            h = h[:length].clone()
        rows = torch.arange(length, device=dev).unsqueeze(1)
        self.amax_history = torch.where(rows < self.history_len, h, torch.zeros((), device=dev))
        self.reduce_amax = any(self.layer_settings(k)["reduce_amax"] for k in range(self.n_layers))
        if self.block_stats is None and any(spec is not None for spec in self.block_specs):
            self.block_stats = new_block_stats(self.n_tensors, self.device)  # from now on, every step
        self.version += 1

    def __deepcopy__(self, memo: dict) -> FP8State:
        """A copy with its own handle (the custom operators find a state by it) and no layer plans (caches,
        holding prepared kernel launches; the copy makes its own)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "linear_plans":
                setattr(new, name, deepcopy(value, memo))
        new.linear_plans = {}
        new.handle = register_state(new)
        return new

    def to(self, device) -> FP8State:
        """Move every tensor to ``device`` (done automatically at the first forward on a new device)."""
        device = torch.device(device)
        self.scale = aligned_scales(self.scale, device)  # .to() would drop the aligned layout
        self.scale_inv = aligned_scales(self.scale_inv, device)
        for name in (
            "amax_history",
            "step_t",
            "stats",
            "fp8_max",
            "margin",
            "most_recent",
            "history_len",
            "interval",
            "enabled_t",
        ):
            setattr(self, name, getattr(self, name).to(device))
        if self.last_stats is not None:
            self.last_stats = self.last_stats.to(device)
        if self.block_stats is not None:
            self.block_stats = self.block_stats.to(device)
        if self.last_block_stats is not None:
            self.last_block_stats = self.last_block_stats.to(device)
        for box in self._inboxes:
            if box[0] is not None:
                box[0] = box[0].to(device)
        self.device = device
        self.version += 1
        return self

    # ----- registry -----
    def tensor_table(self) -> list[TensorInfo]:
        out = []
        for k, layer in enumerate(self.layer_names):
            fmt = self.layer_settings(k)["fp8_format"]
            for r, role in enumerate(ROLES):
                name = f"{layer}.{role}" if layer else role
                out.append(TensorInfo(3 * k + r, name, layer, role, fmt.for_role(role).name))
        return out

    # ----- per-tensor views -----
    # The hot path takes tensor i's statistics row and scales as views; indexing a tensor costs an op
    # dispatch each time (a few microseconds of host time, three times per quantize), so each vector's
    # views are made once, in one unbind, when the vector is replaced (once per step).
    stats = _RowViewed()
    scale = _RowViewed()
    scale_inv = _RowViewed()

    def _rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tensor ``i``'s ``(stats row, scale, scale_inv)`` as views of the current vectors."""
        if self._stats_rows is None:
            self._stats_rows = self._stats.unbind(0)
        if self._scale_rows is None:
            self._scale_rows = self._scale.unbind(0)
        if self._scale_inv_rows is None:
            self._scale_inv_rows = self._scale_inv.unbind(0)
        return self._stats_rows[i], self._scale_rows[i], self._scale_inv_rows[i]

    def scale_inv_row(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s ``scale_inv``, a 0-dim view of the current vector."""
        return self._rows(i)[2]

    def capture_once(self, i: int, fn) -> None:
        """Call ``fn(t)`` once with tensor ``i``'s value in the next training forward (input) or backward
        (grad_output) of its layer: the FP8 layer does it where it sees the tensor (in its custom operator
        under ``torch.compile``, where a module hook added later would never run). ``fn`` must not raise."""
        self.captures[i] = fn

    def run_capture(self, i: int, t: torch.Tensor) -> None:
        """``capture_once``'s call for tensor ``i``, if one is waiting."""
        fn = self.captures.pop(i, None)
        if fn is not None:
            fn(t)

    # ----- hot path -----
    def quantize(
        self, i: int, x: torch.Tensor, record: bool, dbias: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Quantize tensor ``i``'s value ``x`` -> ``(q, scale_inv)``; stats go to row ``i`` if recording.
        ``dbias`` (a 2-D ``x``): also its column sums, taken by the same pass, ``(q, scale_inv, dbias)``."""
        stats, scale, scale_inv = self._rows(i)
        stats = stats if record else None
        extra = {"dbias": True} if dbias else {}
        if self.current[i // 3]:
            # one dispatch entry: amax pass, scale and quantize pass (fused Triton kernels on CUDA)
            q, _, scale_inv, _, *column_sums = quantize_current(
                x, self.dtypes[i], stats, power_2_scale=self.power_2_scale, return_scale_inv=True, **extra
            )
            return (q, scale_inv, *column_sums)
        q, _, *column_sums = quantize_with_stats(x, scale, self.dtypes[i], stats, **extra)
        return (q, scale_inv, *column_sums)

    def quantize_transposed(self, i: int, x: torch.Tensor, record: bool, dbias: bool = False) -> tuple:
        """As ``quantize`` for a 2-D ``x``, also returning ``q.t().contiguous()`` (written by the same pass
        where a kernel is registered): ``(q, qt, scale_inv)``, and the column sums last with ``dbias``."""
        stats, scale, scale_inv = self._rows(i)
        stats = stats if record else None
        extra = {"dbias": True} if dbias else {}
        if self.current[i // 3]:
            q, qt, _, scale_inv, _, *column_sums = quantize_current_transposed(
                x, self.dtypes[i], stats, power_2_scale=self.power_2_scale, return_scale_inv=True, **extra
            )
            return (q, qt, scale_inv, *column_sums)
        q, qt, _, *column_sums = quantize_with_stats_transposed(x, scale, self.dtypes[i], stats, **extra)
        return (q, qt, scale_inv, *column_sums)

    def block_rows(self, i: int, record: bool) -> dict[str, torch.Tensor]:
        """Tensor ``i``'s statistics row and block row as ``quantize_block_tensor``'s keyword arguments
        (none when not recording)."""
        if not record:
            return {}
        return {"stats": self._rows(i)[0], "block_stats_row": self.block_stats[i]}

    def quantized_weight(self, k: int, weight: torch.Tensor, variant: Any, record: bool, quantize):
        """Layer ``k``'s weight as ``quantize(record)`` makes it, quantized once per step while the weight
        stays as it was (``WeightCache.quantized``, which also says when its statistics are recorded)."""
        return self.weight_cache.quantized(self, k, weight, variant, record, quantize)

    def quality_step(self, step: int) -> bool:
        """Whether the step of index ``step`` (0-based, ``steps`` before it completes) records the quality
        columns."""
        return self.quality_stats and step % self.quality_every == 0

    def _new_stats_buffer(self, step: int | None = None) -> None:
        """A fresh statistics buffer for step ``step`` (default: the next one, ``steps``)."""
        quality = self.quality_step(self.steps if step is None else step)
        if self.capturable:  # a captured step keeps its buffer's width (set_quality_schedule)
            quality = self.quality_stats
        self.stats = new_stats(self.n_tensors, device=self.device, quality=quality)
        self.stats[:, SCALE] = self.scale
        if self.block_stats is not None:
            self.block_stats = new_block_stats(self.n_tensors, self.device)

    def end_step(self) -> None:
        """Close the step in progress: reduce amaxes, push them into the history, update the scales.

        Does nothing when nothing was recorded since the last call. Never reads a tensor on the host.
        """
        if not self.tracker.pending:
            return
        for hook in self.before_step_end:
            hook(self)
        self.tracker.closed()
        self.weight_cache.clear()  # the optimizer moves the weights, and the scales change, after a step
        stats = self.stats
        amax = stats[:, AMAX].to(torch.float32)
        if self.group is not None:
            amax = all_reduce_amax(amax, self.group)
        if self.capturable:
            self.step_t.add_(1)
        else:
            self.step_t = self.step_t + 1
        # one launch for all tensors where a kernel is registered (Triton on CUDA), the reference elsewhere
        update = fused_scale_update(self.device) or scale_update_reference
        history, scale, scale_inv = update(
            self.amax_history,
            amax,
            self.scale,
            fp8_max=self.fp8_max,
            margin=self.margin,
            most_recent=self.most_recent,
            history_len=self.history_len,
            interval=self.interval,
            step=self.step_t,
            enabled=self.enabled_t,
        )
        if not self.capturable:
            self.amax_history = history
            self.scale, self.scale_inv = as_aligned_scales(scale), as_aligned_scales(scale_inv)
            self.last_stats, self.last_block_stats = stats, self.block_stats
            self._new_stats_buffer(self.steps + 1)  # _deliver counts this step
            self._deliver(self._with_block(stats, self.last_block_stats))
            return
        # the same values into the same buffers: a replayed graph reads and writes these addresses
        self.amax_history.copy_(history)
        self.scale.copy_(scale)
        self.scale_inv.copy_(scale_inv)
        self.last_stats = _move_into(self.last_stats, stats)
        if self.block_stats is not None:  # zeroed: new_block_stats' zeros, in place
            self.last_block_stats = _move_into(self.last_block_stats, self.block_stats)
        stats[:, SCALE] = self.scale
        if stats.shape[1] > MIN_ABS:
            stats[:, MIN_ABS] = torch.inf  # the neutral element of its min
        self.replayed()

    @staticmethod
    def _with_block(stats: torch.Tensor, block: torch.Tensor | None) -> torch.Tensor:
        return stats if block is None else torch.cat([stats, block], 1)

    def newest_stats(self) -> torch.Tensor | None:
        """The last completed step as readers get it: ``last_stats`` with the block part, if any."""
        if self.last_stats is None:
            return None
        return self._with_block(self.last_stats, self.last_block_stats)

    def replayed(self) -> None:
        """The host side of a step whose device side ran in place (``capturable``): count it and hand its
        statistics to the readers, as a copy (the buffer is overwritten by the next step). ``end_step``
        calls it; after a CUDA graph replay, nothing runs ``end_step`` and ``GraphedStep`` calls this."""
        self._deliver(self._with_block(self.last_stats.clone(), self.last_block_stats))  # with a block: cat

    def _deliver(self, stats: torch.Tensor) -> None:
        if self.reruns:  # a step run again (fp8_trainer.rewind): its readers had its first run
            self.reruns -= 1
            self.steps += 1
            return
        for box in self._inboxes:
            # a reader that did not take the last step (a step per micro-batch) gets both, merged
            box[0] = stats if box[0] is None else merge_step_stats(box[0], stats)
            box[1] += 1
        self.steps += 1

    def set_capturable(self, enabled: bool = True) -> None:
        """Switch in-place step updates on or off (see ``capturable``). Off again, ``last_stats`` handed out
        from now on are fresh buffers once more."""
        if self.pending:
            raise RuntimeError("set_capturable: a step is pending; switch between steps")
        self.capturable = bool(enabled)
        self._new_stats_buffer()  # captured, the width stays: every step's, or none (set_quality_schedule)
        if self.capturable:
            # the scale vectors must be the aligned layout, which the in-place copies then keep
            self.scale, self.scale_inv = as_aligned_scales(self.scale), as_aligned_scales(self.scale_inv)
            self.amax_history = self.amax_history.contiguous()
            self.step_t = self.step_t.clone()
            self.version += 1

    def set_quality_stats(self, enabled: bool = True) -> None:
        """Record the quality columns (the default) or the base columns alone (``(n, 6)`` blocks from the
        next step on, for a benchmark's comparison); between steps only."""
        if self.pending:
            raise RuntimeError("set_quality_stats: a step is pending; switch between steps")
        self.quality_stats = bool(enabled)
        self._new_stats_buffer()
        self.last_stats = None
        self.version += 1

    def set_quality_schedule(self, every: int) -> None:
        """Record the quality columns in every ``every``-th step (steps 0, every, 2 every, ...) and the base
        columns alone in the others, whose quantize passes then run the kernels without the quality terms
        (``fp8_kernels``: about 40% fewer instructions per element on sm_90). ``1`` (the default): every
        step. The step in progress keeps the width it began with; a CUDA-graph-captured step (``capturable``)
        keeps the width it was captured with."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"quality_every: expected an integer >= 1, got {every!r}")
        self.quality_every = every
        if not self.pending:
            self._new_stats_buffer()

    def open_inbox(self) -> list:
        """A reader's inbox ``[stats or None, n_steps]``: every step closed from now on lands in it, merged
        (``merge_step_stats``) with those the reader has not taken yet. ``close_inbox`` when done."""
        box = [None, 0]
        self._inboxes.append(box)
        return box

    def close_inbox(self, box: list) -> None:
        self._inboxes = [b for b in self._inboxes if b is not box]

    def on_backward_end(self) -> None:
        self.tracker.callback_queued = False
        if self.tracker.step_complete:
            self.end_step()

    # ----- checkpoint (host side; copies to the CPU, never on the hot path; fp8_trainer.extra_state) -----
    def layer_extra_state(self, k: int) -> dict[str, Any]:
        """Layer ``k``'s slice of the scaling state as the last completed step left it, tensors and plain
        values only (``weights_only``-safe; ``extra_state.save``)."""
        return extra_state.save(self, k)

    def load_layer_extra_state(self, k: int, extra: dict[str, Any]) -> None:
        """Restore layer ``k``'s slice saved by ``layer_extra_state``: overrides, history, scales, step.

        A saved history of another length than the layer's effective ``amax_history_len`` keeps its newest
        entries and is padded with zeros (as ``set_layer_recipe`` does when the length changes).

        Raises:
            RuntimeError: a step is pending (loading between forward and backward is not supported).
            ValueError: the slice is malformed (naming the layer); nothing is changed then.
        """
        name = self.layer_names[k] or "<root>"
        self.check_not_pending(name)
        saved = extra_state.parse(name, extra)
        self.layer_overrides[k] = saved.layer_overrides
        self.model_overrides = saved.model_overrides
        self._rebuild()  # effective history lengths first: the saved history is fitted to them
        self.amax_history, self.scale, self.scale_inv = extra_state.restored(self, k, saved)
        self.steps = saved.step
        self.step_t = torch.full((), saved.step, dtype=torch.int64, device=self.device)
        self._new_stats_buffer()  # its scale column must show the restored scales
        self.version += 1

    def check_not_pending(self, where: str) -> None:
        """Raise if a step is pending: loading a checkpoint then is not supported."""
        if self.pending:
            raise RuntimeError(
                f"load_state_dict: FP8 layer {where!r}: a step is pending (a recorded forward without its "
                "backward, or an unfinished gradient accumulation); finish the step or call "
                "fp8_trainer.end_step(model) before loading"
            )
