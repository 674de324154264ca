"""Detector thresholds: one validated, JSON-serialisable pydantic model with every default in one place."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fp8_protocol.loss_spike import LossSpikeParams


class DetectorConfig(BaseModel):
    """Thresholds of every detector. Defaults are deliberately conservative: an alert should mean something.

    Loss spike (run-level): robust z-score of each new finite loss against its trend: the residual
    ``r = loss - baseline`` (an exponential moving average of span `loss_ema_span`) against the residuals R
    of the previous `loss_window` finite losses,
    ``z = (r - median(R)) / max(1.4826 * MAD(R), loss_rel_floor * |baseline|, 1e-12)``; fires when
    ``z >= loss_z_threshold`` once `loss_min_history` residuals are in the window; critical when
    ``z >= loss_z_critical`` (see `loss.LossSpikeDetector`).

    Overflow burst (per tensor): ``frac = overflow / numel``; a step is overflowing when
    ``frac > overflow_frac``; fires (warning) after `overflow_consecutive` consecutive overflowing steps, or
    at once (critical) on a jump ``frac >= overflow_jump_frac`` (`overflow_jump_frac_grad` for grad_output:
    the gradients of a hard batch outgrow a delayed-scaling history by 10-30x for one step and clip a few
    percent of their elements, after which the scale has caught up).

    Underflow excess (per tensor): ``frac = underflow / numel`` above `underflow_frac` (input, weight) or
    `underflow_frac_grad` (grad_output, whose small values underflow routinely) for `underflow_consecutive`
    consecutive steps; severity info.

    Amax divergence (per tensor): ``growth = log2(amax) - mean(log2 amax over the previous W steps)`` with
    ``W = min(amax_history_len, divergence_window)`` (the recompute interval, usually 1, for
    ``amax_compute_algo="most_recent"``; `divergence_window` for current scaling); a step
    diverges when ``growth > margin + tol`` with ``tol = divergence_log2`` (`divergence_log2_grad` for
    grad_output, whose amax follows the loss of the batch and moves several-fold for a few hard batches);
    fires after `divergence_consecutive` such steps; critical when ``growth > margin + 2 * tol``.

    Scale collapse (per tensor): ``log2(scale)`` more than `scale_drop_log2` below its maximum over the
    previous `scale_window` steps (warning), or a scale that is non-finite, <= 0 or below `scale_min`
    (critical).

    Rank divergence (per tensor, from the client's sampled per-rank amaxes): one rank's log2 amax more than
    `rank_divergence_log2` from the median of the other ranks' (warning; critical beyond twice that).

    SQNR drop (per tensor, from the quality columns ``sum_sq`` and ``err_sq``): the SQNR in dB more than
    `sqnr_drop_db` below the tensor's own recent level, the median over its previous `sqnr_window` usable
    steps (at least `sqnr_min_history` of them), for `sqnr_consecutive` consecutive steps (warning;
    critical beyond twice `sqnr_drop_db`; see `quality.SqnrDropDetector`).

    Stalled (run-level): no telemetry for `stall_seconds` (warning; critical after 10x that).

    Incidents: a new alert joins the run's open incident when its onset is within `incident_window_steps`
    of the incident's steps (see `monitor_server.services.incidents`).

    Layer health: a layer saturates (warning, diverging) when a tensor's headroom
    ``log2(FP8_MAX / (amax * scale))`` is below ``-saturation_log2``.

    Warm-up grace (per tensor): no overflow, underflow, divergence or scale-drop finding for a tensor until it
    has reported `warmup_steps` steps with a non-zero finite amax; by default (None) until its amax history
    has filled once (``amax_history_len`` of its recipe; `divergence_window` for current scaling), at most
    `warmup_max_steps`. Non-finite values, and a non-finite or non-positive scale, alert from the first step.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the loss-spike rule's defaults are the rule's own (the training client uses them too)
    loss_window: int = Field(LossSpikeParams.window, ge=5, le=10_000)
    loss_min_history: int = Field(LossSpikeParams.min_history, ge=3)
    loss_z_threshold: float = Field(LossSpikeParams.z_threshold, gt=0)
    loss_z_critical: float = Field(12.0, gt=0)
    loss_rel_floor: float = Field(LossSpikeParams.rel_floor, ge=0)
    loss_ema_span: int = Field(LossSpikeParams.ema_span, ge=1, le=10_000)

    overflow_frac: float = Field(1e-3, ge=0, lt=1)
    overflow_consecutive: int = Field(3, ge=1)
    overflow_jump_frac: float = Field(1e-2, gt=0, le=1)
    overflow_jump_frac_grad: float = Field(0.25, gt=0, le=1)

    underflow_frac: float = Field(0.05, ge=0, lt=1)
    underflow_frac_grad: float = Field(0.25, ge=0, lt=1)
    underflow_consecutive: int = Field(10, ge=1)

    divergence_window: int = Field(32, ge=1, le=1024)
    divergence_log2: float = Field(2.0, gt=0)
    divergence_log2_grad: float = Field(3.0, gt=0)
    divergence_consecutive: int = Field(3, ge=1)

    scale_window: int = Field(8, ge=1, le=256)
    scale_drop_log2: float = Field(8.0, gt=0)
    scale_min: float = Field(2.0**-40, gt=0)

    saturation_log2: float = Field(0.5, ge=0)

    # a healthy tensor's SQNR moves by a dB or two from step to step; 10 dB is a tenfold rise in the error
    sqnr_drop_db: float = Field(10.0, gt=0)
    sqnr_window: int = Field(32, ge=2, le=1024)
    sqnr_min_history: int = Field(16, ge=1, le=1024)
    sqnr_consecutive: int = Field(3, ge=1)

    stall_seconds: float = Field(120.0, gt=0)

    incident_window_steps: int = Field(50, ge=0, le=1_000_000)

    warmup_steps: int | None = Field(None, ge=0, le=1_000_000)
    warmup_max_steps: int = Field(100, ge=0, le=1_000_000)

    # 3 binades (8x): healthy ranks on different data differ by up to 4x in a grad_output's amax (measured:
    # 4.02x at one sample of bench/alerts.py's two-rank run), so 2 binades cried wolf
    rank_divergence_log2: float = Field(3.0, gt=0)

    @model_validator(mode="after")
    def _check_orders(self) -> DetectorConfig:
        if self.loss_min_history > self.loss_window:
            raise ValueError("loss_min_history must be <= loss_window")
        if self.loss_z_critical < self.loss_z_threshold:
            raise ValueError("loss_z_critical must be >= loss_z_threshold")
        if self.sqnr_min_history > self.sqnr_window:
            raise ValueError("sqnr_min_history must be <= sqnr_window")
        if min(self.overflow_jump_frac, self.overflow_jump_frac_grad) <= self.overflow_frac:
            raise ValueError("overflow_jump_frac and overflow_jump_frac_grad must be > overflow_frac")
        return self
