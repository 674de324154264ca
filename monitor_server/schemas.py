"""Pydantic models of the HTTP API (request bodies and responses), families in the Base/Create/Public style.

Floats that may be non-finite travel as `WireFloat`: a JSON number or "NaN" / "Infinity" / "-Infinity".
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from fp8_protocol.runs import MAX_TAGS, RUN_STATUSES, TAG_PATTERN

WireFloat = float | Literal["NaN", "Infinity", "-Infinity"]
#: database ids are 32-bit
MAX_ID = 2**31 - 1


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _storable_json(value: dict[str, Any]) -> dict[str, Any]:
    try:
        orjson.dumps(value)
    except TypeError as exc:  # e.g. an integer beyond 64 bits
        raise ValueError(f"not storable as JSON: {exc}") from None
    return value


Text = Annotated[str, AfterValidator(_no_nul)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_storable_json)]
Tag = Annotated[str, Field(pattern=TAG_PATTERN)]


def _unique_tags(tags: list[str]) -> list[str]:
    return sorted(set(tags))


Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS), AfterValidator(_unique_tags)]
RunStatus = Literal[RUN_STATUSES]  # see fp8_protocol.runs
Role = Literal["input", "weight", "grad_output"]
Fp8Format = Literal["e4m3", "e5m2"]
# keep in step with monitor_server.detectors.types.EVENT_KINDS (a test checks)
EventKind = Literal["loss_spike", "nonfinite", "rank_amax", "custom"]
# keep in step with monitor_server.rollups.HEATMAP_METRICS (a test checks)
HeatmapMetric = Literal[
    "amax",
    "scale",
    "overflow",
    "underflow",
    "nonfinite",
    "headroom",
    "sqnr",
    "subnormal",
    "dynamic_range",
    "outlier_ratio",
]


class TensorSpec(BaseModel):
    """A quantized tensor as registered with a run."""

    model_config = ConfigDict(extra="forbid")

    index: StrictInt = Field(ge=0)
    name: Text = Field(min_length=1, max_length=300)
    layer: Text = Field(min_length=1, max_length=300)
    role: Role
    format: Fp8Format


class RunCreate(BaseModel):
    """Body of POST /runs. Tensor indices must be dense: 0..T-1, each once."""

    model_config = ConfigDict(extra="forbid")

    name: Text = Field(min_length=1, max_length=200)
    config: JsonObject = Field(default_factory=dict)
    recipe: JsonObject = Field(default_factory=dict)
    world_size: StrictInt = Field(default=1, ge=1, le=MAX_ID)
    host: Text = Field(default="", max_length=200)
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=65536)
    #: optional idempotency key of the registration: a run already created with it is returned (200)
    client_key: Text | None = Field(default=None, min_length=1, max_length=100)
    tags: Tags = Field(default_factory=list)

    @model_validator(mode="after")
    def _dense_indices(self) -> RunCreate:
        indices = sorted(t.index for t in self.tensors)
        if indices != list(range(len(indices))):
            raise ValueError(f"tensor indices must be dense 0..{len(indices) - 1}, each exactly once")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        return self


class RunUpdate(BaseModel):
    """Body of PATCH /runs/{id}: any of a new status, a new name, the run's tags (replacing them)."""

    model_config = ConfigDict(extra="forbid")

    status: RunStatus | None = None
    name: Text | None = Field(default=None, min_length=1, max_length=200)
    tags: Tags | None = None

    @model_validator(mode="after")
    def _something(self) -> RunUpdate:
        if self.status is None and self.name is None and self.tags is None:
            raise ValueError("nothing to change: give status, name or tags")
        return self


class RunPublic(BaseModel):
    """A run as the API returns it."""

    id: int
    name: str
    config: dict[str, Any]
    recipe: dict[str, Any]
    recipe_overrides: dict[str, Any]
    effective_recipe: dict[str, Any]
    world_size: int
    host: str
    status: str
    num_tensors: int
    created_at: datetime
    updated_at: datetime
    first_step: int | None
    last_step: int | None
    last_loss: WireFloat | None
    steps_stored: int
    last_telemetry_at: datetime | None
    open_alerts: int
    open_incidents: int = 0
    tags: list[str] = Field(default_factory=list)
    scalar_names: list[str] = Field(default_factory=list, description="the scalars the run has sent")


class PackedColumn(BaseModel):
    """A statistic column packed as base64 of little-endian float32/float64 values (length T)."""

    dtype: Literal["float32", "float64"]
    b64: str


Column = list[WireFloat] | PackedColumn


class StepStats(BaseModel):
    """The six per-tensor statistics of one step, each a column of length T indexed by tensor index."""

    model_config = ConfigDict(extra="forbid")

    amax: Column
    scale: Column
    overflow: Column
    underflow: Column
    nonfinite: Column
    numel: Column


class StepIn(BaseModel):
    """One step of a telemetry batch."""

    model_config = ConfigDict(extra="forbid")

    step: StrictInt = Field(ge=0)
    scalars: dict[str, WireFloat] = Field(default_factory=dict)
    stats: StepStats | None = Field(
        default=None, description="left out for a step in which no FP8 layer ran (its scalars only)"
    )


class EventIn(BaseModel):
    """A client-reported event."""

    model_config = ConfigDict(extra="forbid")

    kind: EventKind
    step: StrictInt = Field(ge=0)
    details: dict[str, Any] = Field(default_factory=dict)


class EventPublic(BaseModel):
    """A stored client event. In lists (and on the stream) `details` is whole only up to 4 KiB of JSON,
    else its summary (top-level numbers and texts) with `details_complete` false."""

    id: int
    run_id: int
    kind: EventKind
    step: int
    details: dict[str, Any]
    #: size of the whole details as JSON, and whether `details` here is all of it
    details_bytes: int
    details_complete: bool
    created_at: datetime


class AckIn(BaseModel):
    """Acknowledgement of a command: applied (with the step) or rejected (with the reason)."""

    model_config = ConfigDict(extra="forbid")

    command_id: StrictInt = Field(ge=1, le=MAX_ID)
    state: Literal["applied", "rejected"]
    step: StrictInt | None = Field(default=None, ge=0)
    reason: str | None = None


class TelemetryBatch(BaseModel):
    """Body of POST /runs/{id}/telemetry (decoded by hand on the hot path; this model documents it)."""

    model_config = ConfigDict(extra="forbid")

    idempotency_key: str = Field(min_length=1, max_length=200)
    steps: list[StepIn] = Field(default_factory=list)
    events: list[EventIn] = Field(default_factory=list)
    acks: list[AckIn] = Field(default_factory=list)


class RecipeChanges(BaseModel):
    """The recipe fields a command may change (at least one)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    margin: int | None = Field(default=None, ge=0, le=1024)
    amax_history_len: int | None = Field(default=None, ge=1, le=1 << 20)
    amax_compute_algo: Literal["max", "most_recent"] | None = None
    interval: int | None = Field(default=None, ge=1, le=1 << 30)
    scaling: Literal["delayed", "current"] | None = None
    fp8_enabled: StrictBool | None = None

    @model_validator(mode="after")
    def _at_least_one(self) -> RecipeChanges:
        if not self.model_dump(exclude_none=True):
            raise ValueError("changes must set at least one of: " + ", ".join(RecipeChanges.model_fields))
        return self


class CommandCreate(BaseModel):
    """Body of POST /runs/{id}/commands: a recipe change `{target, changes}` or `{rollback: command_id}`."""

    model_config = ConfigDict(extra="forbid")

    target: Text | None = Field(default=None, min_length=1, max_length=300)
    changes: RecipeChanges | None = None
    rollback: StrictInt | None = Field(default=None, ge=1, le=MAX_ID)

    @model_validator(mode="after")
    def _one_kind(self) -> CommandCreate:
        if (self.rollback is None) == (self.changes is None):
            raise ValueError("give either 'changes' (with 'target') or 'rollback', not both or neither")
        if self.rollback is not None and self.target is not None:
            raise ValueError("a rollback takes its target from the command it rolls back")
        return self


class CommandPublic(BaseModel):
    """A command and its audit trail."""

    id: int
    run_id: int
    kind: Literal["recipe_change", "rollback"]
    target: str
    changes: dict[str, Any]
    previous: dict[str, Any] | None
    rollback_of: int | None
    state: Literal["pending", "delivered", "applied", "rejected"]
    applied_step: int | None
    reason: str | None
    created_by: str
    created_at: datetime
    delivered_at: datetime | None
    resolved_at: datetime | None


class TelemetryResult(BaseModel):
    """Response of POST /runs/{id}/telemetry."""

    stored_steps: int
    duplicate: bool
    commands: list[CommandPublic]


class IncidentAlert(BaseModel):
    """An alert as listed in its incident (no evidence: read the alert for that)."""

    id: int
    kind: str
    tensor_index: int | None
    tensor_name: str | None
    layer: str | None
    state: Literal["open", "acknowledged"]
    severity: str
    message: str
    #: the step its condition began (before first_step when a rule waited for consecutive steps)
    onset_step: int
    first_step: int
    last_step: int
    count: int


class AlertPublic(IncidentAlert):
    """An alert (one open alert per run, kind and tensor): its summary within an incident and the rest."""

    run_id: int
    #: the incident it belongs to (null for alerts stored before incidents existed)
    incident_id: int | None
    evidence: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    acknowledged_at: datetime | None
    acknowledged_by: str | None


class IncidentPublic(BaseModel):
    """Alerts that share a cause, root cause first (see monitor_server.incidents)."""

    id: int
    run_id: int
    state: Literal["open", "acknowledged"]
    severity: str
    #: the root cause's kind, and a one-line description of the incident
    kind: str | None
    title: str
    root_alert_id: int | None
    root: IncidentAlert | None
    first_step: int
    last_step: int
    alert_count: int
    open_alerts: int
    #: tensor names and layers of its alerts, root cause first (forward-then-backward order)
    tensors: list[str]
    layers: list[str]
    created_at: datetime
    updated_at: datetime
    notified_at: datetime | None
    acknowledged_at: datetime | None
    acknowledged_by: str | None
    #: the run's dashboard page with this incident open, under the configured public URL
    url: str | None
    alerts: list[IncidentAlert]


class IncidentDetail(IncidentPublic):
    """An incident with its alerts in full (evidence included), root cause first."""

    alerts_full: list[AlertPublic]


class AckAllResult(BaseModel):
    """What POST /runs/{id}/incidents/ack acknowledged."""

    incidents: list[int]
    alerts: int


class SeriesPublic(BaseModel):
    """A downsampled scalar series: each bucket contributes its min and max points (NaN first if any)."""

    name: str
    from_step: int | None = Field(alias="from")
    to_step: int | None = Field(alias="to")
    bucket_width: int
    downsampled: bool
    steps: list[int]
    values: list[WireFloat]


class HeatmapPublic(BaseModel):
    """A tensors x buckets matrix; `values[t][c]` is null where bucket c holds no stored step."""

    metric: HeatmapMetric
    aggregation: Literal["max", "min", "sum"]
    tensors: list[TensorSpec]
    bucket_width: int
    bucket_start: list[int]
    bucket_end: list[int]
    bucket_steps: list[int]
    values: list[list[WireFloat | None]]


class LayerHealth(BaseModel):
    """One layer's health as ranked by the detector engine (fields beyond these pass through)."""

    model_config = ConfigDict(extra="allow")

    layer: str
    #: the worst latest SQNR (dB) of the layer's tensors; null when the run sends no quality statistics
    sqnr_db: WireFloat | None = None
