"""The answers of the read routes, as `schemas.py`'s models are: scalar series, heatmaps (JSON and the packed
head), per-tensor and per-layer health and block scale histograms.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from monitor_server.storage.schemas import HeatmapMetric, PublicModel, Role, TensorSpec, WireFloat


class SeriesPoints(PublicModel):
    """A scalar's points after min/max-preserving downsampling: each bucket of `bucket_width` steps keeps
    its min and its max point (a NaN point in place of the min when it holds one)."""

    bucket_width: int = Field(description="steps per bucket; 1 when no point was dropped")
    downsampled: bool = Field(description="whether points were dropped (more stored than max_points)")
    steps: list[int] = Field(description="steps of the kept points, ascending")
    values: list[WireFloat] = Field(description="the scalar at those steps")


class SeriesRange(PublicModel):
    """The step range a series answer covers: the request clipped to the stored steps."""

    model_config = ConfigDict(populate_by_name=True)

    from_step: int | None = Field(alias="from", description="first step (null: nothing stored in range)")
    to_step: int | None = Field(alias="to", description="last step (null: nothing stored in range)")


class SeriesName(PublicModel):
    """The scalar a series answer is of."""

    name: str = Field(description="the scalar's name, e.g. loss")


# fields come base by base from the last base to the first: name, from, to, then the points
class SeriesPublic(SeriesPoints, SeriesRange, SeriesName):
    """A downsampled scalar series: each bucket contributes its min and max points (NaN first if any)."""


class SeriesMulti(SeriesRange):
    """Several scalars over one step range, each downsampled as `GET /runs/{id}/series` does it."""

    series: dict[str, SeriesPoints] = Field(description="by scalar name, in the order asked (repeats once)")


HeatmapAggregation = Literal["max", "min", "sum"]


class HeatmapHead(PublicModel):
    """The heatmap's fields other than its values: the metrics, the tensors (rows of each metric) and the
    step buckets (columns)."""

    metric: HeatmapMetric = Field(description="the first of `metrics`")
    metrics: list[HeatmapMetric] = Field(description="the metrics, in the order of their blocks of rows")
    aggregation: HeatmapAggregation = Field(description="how a bucket folds the first metric's steps")
    aggregations: list[HeatmapAggregation] = Field(description="how a bucket folds each metric's steps")
    tensors: list[TensorSpec] = Field(description="the rows of each metric: the run's tensors or those asked")
    bucket_width: int = Field(description="steps per bucket (a multiple of a rollup block)")
    bucket_start: list[int] = Field(description="first step of each bucket")
    bucket_end: list[int] = Field(description="last step of each bucket")
    bucket_steps: list[int] = Field(
        description="stored steps in each bucket that gave the first metric (0: an empty bucket)"
    )
    metric_steps: list[list[int]] = Field(description="per metric, as `bucket_steps` is for the first")
    after_step: int | None = Field(
        description="the buckets are those holding steps after this one (null: the whole range)"
    )


class HeatmapPublic(HeatmapHead):
    """A (metrics x tensors) x buckets matrix; `values[m * R + r][c]` is metric m of the r-th of the R
    `tensors` in bucket c, null where that bucket holds no stored step of the metric."""

    values: list[list[WireFloat | None]] = Field(
        description="rows (each metric's block of tensors) of columns (buckets)"
    )


class HeatmapPackedHeader(HeatmapHead):
    """The JSON header of GET /runs/{id}/heatmap/packed, before its float64 matrix."""

    rows: int = Field(description="rows of the matrix (metrics x tensors, metric-major)")
    dtype: Literal["float64"] = Field(description="the matrix's cells: little-endian float64")
    cols: int = Field(description="columns of the matrix (buckets)")


class TensorHealth(PublicModel):
    """One tensor within a layer's health: its last statistics and running totals."""

    index: int
    name: str
    role: Role
    last_amax: WireFloat
    last_scale: WireFloat
    headroom_log2: WireFloat = Field(description="log2 of FP8 max / (amax * scale): room before overflow")
    saturation: str = Field(description="unknown, none, at_max, clipping or saturating (detectors.health)")
    warming_up: bool = Field(description="whether its amax history has not filled yet")
    amax_growth_log2: WireFloat = Field(description="log2 of the amax growth over the delayed-scaling window")
    overflow_total: WireFloat
    underflow_total: WireFloat
    nonfinite_total: WireFloat
    sqnr_db: WireFloat | None = Field(
        None,
        description="its latest SQNR in dB; NaN when that step had no finite element; null without quality"
        " statistics",
    )
    sqnr_level_db: WireFloat | None = Field(
        None,
        description="its recent SQNR level (median of recent steps) the sqnr_drop detector compares with",
    )
    block_range: WireFloat | None = Field(
        None,
        description="its worst block's dynamic range (binades) in the latest step with block statistics;"
        " null when the run sends none (0 for a per-tensor-scaled tensor)",
    )
    block_at_limit: WireFloat | None = Field(
        None,
        description="the share of its blocks with values to scale whose scale sat at a limit of its format"
        " in that step (values the format could not follow); null when the run sends no block statistics",
    )
    block_zero: WireFloat | None = Field(
        None,
        description="the share of its blocks with amax 0 (all zero, or NaN: nothing to scale, nothing lost)"
        " in that step; null when the run sends no block statistics or an older sender left the column out",
    )


class LayerHealth(PublicModel):
    """One layer's health as ranked by the detector engine, worst first."""

    layer: str
    severity: str = Field(description="the worst of its reasons: ok, info, warning or critical")
    score: float = Field(description="sum of its reasons' weights plus a small term for the least headroom")
    diverging: bool = Field(description="an open alert on one of its tensors, or a saturating/growing amax")
    reasons: list[str] = Field(description="why it is flagged, worst first")
    sqnr_db: WireFloat | None = Field(
        None,
        description="the worst latest SQNR (dB) of its tensors; NaN when one of them had no finite element in"
        " its latest step; null when the run sends no quality columns",
    )
    block_range: WireFloat | None = Field(
        None,
        description="the widest latest block range (binades) of its tensors; null when the run sends no"
        " block statistics",
    )
    block_at_limit: WireFloat | None = Field(
        None,
        description="the largest latest share of blocks at a scale limit among its tensors; null when the"
        " run sends no block statistics",
    )
    block_zero: WireFloat | None = Field(
        None,
        description="the largest latest share of all-zero blocks among its tensors (harmless: sparsity,"
        " padding); null when the run sends no block statistics or no blocks_zero column",
    )
    tensors: list[TensorHealth]


class BlockHistogramPublic(PublicModel):
    """A tensor's block scale exponent histograms over steps, summed per aligned bucket of steps (only the
    buckets that hold one): `counts[c][j]` blocks of bucket c had a scale_inv of biased exponent
    `exponent_lo` + j (unbiased: that minus `exponent_bias`)."""

    model_config = ConfigDict(populate_by_name=True)

    tensor: TensorSpec
    from_step: int | None = Field(
        alias="from", description="first step asked (null: nothing stored in range)"
    )
    to_step: int | None = Field(alias="to", description="last step asked (null: nothing stored in range)")
    bucket_width: int = Field(description="steps per bucket (8 or more where the steps were compacted)")
    bucket_start: list[int] = Field(description="first step of each bucket (clipped to the range)")
    bucket_end: list[int] = Field(description="last step of each bucket (clipped to the range)")
    bucket_steps: list[int] = Field(description="steps with a histogram summed into each bucket")
    exponent_bias: int = Field(description="127: an unbiased exponent is the biased one minus this")
    exponent_lo: int | None = Field(description="biased exponent of the first row of counts (null: none)")
    exponent_hi: int | None = Field(description="biased exponent of the last row of counts (null: none)")
    counts: list[list[int]] = Field(
        description="per bucket, its blocks at each exponent exponent_lo..exponent_hi, summed over its steps"
    )
