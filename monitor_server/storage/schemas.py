"""Pydantic models of the HTTP API (request bodies and responses), families in the Base/Create/Public style.

Floats that may be non-finite travel as `WireFloat`: a JSON number or "NaN" / "Infinity" / "-Infinity".
Every response is built from a `PublicModel`, which refuses a field it does not declare: an answer and its
documented schema cannot drift apart (an undeclared key is an error, not a key silently dropped). The read
routes' answers (series, heatmaps, health, block histograms) are `query_schemas.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from fp8_protocol.runs import MAX_TAGS, RUN_STATUSES, TAG_PATTERN

WireFloat = float | Literal["NaN", "Infinity", "-Infinity"]
#: database ids are 32-bit
MAX_ID = 2**31 - 1
#: the longest notes a run keeps (characters)
MAX_NOTES = 10_000


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


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


Text = Annotated[str, AfterValidator(_no_nul)]
#: a stored time: SQLite hands back naive datetimes, written as UTC (a response model validated from a row's
#: attributes, `model_validate(row, from_attributes=True)`, says so)
UtcDatetime = Annotated[datetime, AfterValidator(_utc)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_storable_json)]
Tag = Annotated[str, Field(pattern=TAG_PATTERN)]


def _unique_tags(tags: list[str]) -> list[str]:
    return sorted(set(tags))


Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS), AfterValidator(_unique_tags)]
RunStatus = Literal[RUN_STATUSES]  # see fp8_protocol.runs
Role = Literal["input", "weight", "grad_output"]
Fp8Format = Literal["e4m3", "e5m2"]
# keep in step with fp8_protocol.client_events.EVENT_KINDS (a test checks)
EventKind = Literal["loss_spike", "nonfinite", "rank_amax", "custom"]
# keep in step with monitor_server.storage.rollups.HEATMAP_METRICS (a test checks)
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
    "block_at_limit",
    "block_overflow",
    "block_underflow",
    "block_range",
]
AlertState = Literal["open", "acknowledged"]
#: the verdicts of an incident replay (`fp8-train replay`)
ReplayVerdict = Literal["fp8-caused", "not-fp8", "not-reproducible"]


class PublicModel(BaseModel):
    """Base of the response models: an undeclared field is an error, so the answer is what the schema says."""

    model_config = ConfigDict(extra="forbid")


def attributes(row: object, names: Iterable[str]) -> dict[str, Any]:
    """The named attributes of `row` (a database record), for the fields a response model shows as stored."""
    return {name: getattr(row, name) for name in names}


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
    """Body of PATCH /runs/{id}: any of a new status, a new name, the run's tags (replacing them), its notes
    (replacing them; "" clears them)."""

    model_config = ConfigDict(extra="forbid")

    status: RunStatus | None = None
    name: Text | None = Field(default=None, min_length=1, max_length=200)
    tags: Tags | None = None
    notes: Text | None = Field(default=None, max_length=MAX_NOTES)

    @model_validator(mode="after")
    def _something(self) -> RunUpdate:
        if all(v is None for v in (self.status, self.name, self.tags, self.notes)):
            raise ValueError("nothing to change: give status, name, tags or notes")
        return self


class RunPublic(PublicModel):
    """A run as the API returns it."""

    id: int
    name: str
    config: dict[str, Any] = Field(
        description="the run's config; in the runs list only the keys it asks for (`config_keys`)"
    )
    recipe: dict[str, Any]
    recipe_overrides: dict[str, Any]
    effective_recipe: dict[str, Any]
    world_size: int
    host: str
    status: str
    num_tensors: int
    created_at: UtcDatetime
    updated_at: UtcDatetime
    first_step: int | None
    last_step: int | None
    last_loss: WireFloat | None
    steps_stored: int
    last_telemetry_at: UtcDatetime | None
    open_alerts: int
    open_incidents: int = 0
    tags: list[str] = Field(default_factory=list)
    scalar_names: list[str] = Field(default_factory=list, description="the scalars the run has sent")
    notes: str = Field(default="", description="free-text notes on the run (PATCH /runs/{id} writes them)")


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


class EventPublic(PublicModel):
    """A stored client event. In lists (and on the stream) `details` is whole only up to 4 KiB of JSON,
    else its summary (top-level numbers and texts) with `details_complete` false."""

    id: int
    run_id: int
    kind: EventKind
    step: int = Field(description="the training step the client reported it at")
    details: dict[str, Any] = Field(description="the details the client sent, or their summary")
    details_bytes: int = Field(description="size of the whole details as JSON")
    details_complete: bool = Field(description="whether `details` here is all of them (false: a summary)")
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


#: a recipe's scaling: per tensor (delayed, current) or block scaling (mxfp8: 1x32 blocks with E8M0 scales;
#: block: FP8 block scaling, 1x128 / 128x128 float32 scales); a job registers its recipe's as ``type``
Scaling = Literal["delayed", "current", "mxfp8", "block"]


class RecipeChanges(BaseModel):
    """The recipe fields a command may change (at least one)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    margin: int | None = Field(default=None, ge=0, le=1024)
    amax_history_len: int | None = Field(default=None, ge=1, le=1 << 20)
    amax_compute_algo: Literal["max", "most_recent"] | None = None
    interval: int | None = Field(default=None, ge=1, le=1 << 30)
    scaling: Scaling | None = None
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


class CommandPublic(PublicModel):
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
    created_at: UtcDatetime
    delivered_at: UtcDatetime | None
    resolved_at: UtcDatetime | None


class TelemetryResult(PublicModel):
    """Response of POST /runs/{id}/telemetry."""

    stored_steps: int = Field(description="steps of the batch newly stored (steps stored before are skipped)")
    duplicate: bool = Field(description="whether the batch's idempotency key was seen before")
    commands: list[CommandPublic] = Field(
        description="the run's unacknowledged commands, oldest first, for the training job to apply"
    )


class IncidentAlert(PublicModel):
    """An alert as listed in its incident (no evidence: read the alert for that)."""

    id: int
    kind: str
    tensor_index: int | None = Field(description="the tensor it is about (null: a run-level alert)")
    tensor_name: str | None
    layer: str | None
    state: AlertState
    severity: str
    message: str
    onset_step: int = Field(
        description="the step its condition began (before first_step when a rule waited for steps in a row)"
    )
    first_step: int
    last_step: int
    count: int = Field(description="findings folded into it")


class AlertPublic(IncidentAlert):
    """An alert (one open alert per run, kind and tensor): its summary within an incident and the rest."""

    run_id: int
    incident_id: int | None = Field(
        description="the incident it belongs to (null for alerts stored before incidents existed)"
    )
    evidence: dict[str, Any] = Field(description="the detector's numbers behind the finding")
    created_at: datetime
    updated_at: datetime
    acknowledged_at: datetime | None
    acknowledged_by: str | None


class IncidentPublic(PublicModel):
    """Alerts that share a cause, root cause first (see monitor_server.services.incidents)."""

    id: int
    run_id: int
    state: AlertState
    severity: str
    kind: str | None = Field(description="the root cause's kind")
    title: str = Field(description="a one-line description of the incident")
    root_alert_id: int | None
    root: IncidentAlert | None
    first_step: int
    last_step: int
    alert_count: int
    open_alerts: int
    tensors: list[str] = Field(
        description="tensor names of its alerts, root cause first (forward-then-backward order)"
    )
    layers: list[str] = Field(description="layers of its alerts, in the same order")
    created_at: datetime
    updated_at: datetime
    notified_at: datetime | None = Field(
        description="when it first merited a webhook message (null: not yet)"
    )
    acknowledged_at: datetime | None
    acknowledged_by: str | None
    url: str | None = Field(
        description="the run's dashboard page with this incident open, under the configured public URL"
    )
    alerts: list[IncidentAlert]
    replay_verdict: ReplayVerdict | None = Field(
        default=None, description="the verdict of its replay (GET .../replay), null: not replayed yet"
    )
    bundles: list[str] = Field(
        default_factory=list,
        description="paths of the incident bundles the job wrote (its `incident_bundle` events) from the "
        "incident's window before its first step to its last step, oldest first",
    )


class IncidentDetail(IncidentPublic):
    """An incident with its alerts in full (evidence included), root cause first."""

    alerts_full: list[AlertPublic]


class AckAllResult(PublicModel):
    """What POST /runs/{id}/incidents/ack acknowledged."""

    incidents: list[int] = Field(description="ids of the incidents acknowledged")
    alerts: int = Field(description="how many alerts were acknowledged (also those in no incident)")


#: a float of a replay report: finite as a JSON number, non-finite spelled as on the wire
ReplayFloat = Annotated[float, Field(allow_inf_nan=False)] | Literal["NaN", "Infinity", "-Infinity"]
#: a tensor (``<layer>.<role>``) or layer name in a replay report
ReplayName = Annotated[Text, Field(min_length=1, max_length=300)]
#: the most configurations, culprits and FP8 layers (SQNR entries) one replay report may hold
MAX_REPLAY_CONFIGS = 1024
MAX_REPLAY_LAYERS = 4096


class ReplayConfig(BaseModel):
    """One configuration of a replay: what ran in high precision, the window's losses, whether the fault
    came back, and (for the FP8 ones) each FP8 layer's output SQNR against the high-precision run."""

    model_config = ConfigDict(extra="forbid")

    name: ReplayName
    high_precision: list[ReplayName] = Field(default_factory=list, max_length=MAX_REPLAY_LAYERS)
    loss: ReplayFloat = Field(description="the failing step's loss")
    losses: list[ReplayFloat] = Field(default_factory=list, max_length=4096, description="the window's")
    fault: StrictBool
    sqnr_db: dict[ReplayName, ReplayFloat] | None = Field(default=None, max_length=MAX_REPLAY_LAYERS)
    grad_sqnr_db_min: ReplayFloat | None = None
    grad_sqnr_worst: ReplayName | None = None
    # a gradient-triggered replay (grad_overflow): the trigger layer's gradients against high precision,
    # and their norm over its window median (fp8_trainer/app/replay_judge.py)
    layer_grad_sqnr_db: ReplayFloat | None = None
    layer_grad_ratio: ReplayFloat | None = None


class ReplayReport(BaseModel):
    """Body of PUT /runs/{id}/incidents/{incident_id}/replay: the report `fp8-train replay` writes."""

    model_config = ConfigDict(extra="forbid")

    verdict: ReplayVerdict
    reason: Text = Field(max_length=2000)
    culprits: list[ReplayName] = Field(
        default_factory=list, max_length=MAX_REPLAY_CONFIGS, description="the most likely first"
    )
    configs: list[ReplayConfig] = Field(default_factory=list, max_length=MAX_REPLAY_CONFIGS)
    bundle: Text | None = Field(default=None, max_length=4096, description="the bundle replayed")
    step: StrictInt | None = Field(default=None, ge=0, description="the failing step")
    window: list[StrictInt] | None = Field(
        default=None, min_length=2, max_length=2, description="first and last step replayed"
    )
    bitwise: StrictBool | None = Field(default=None, description="the failing step's loss came back exactly")
    trigger: JsonObject | None = Field(default=None, description="what made the job write the bundle")


class ReplayPublic(ReplayReport):
    """A stored replay report, with the incident it belongs to and who stored it when."""

    incident_id: int
    run_id: int
    created_at: datetime
    updated_at: datetime
    updated_by: str


class PolicyActionPublic(PublicModel):
    """What a run's remediation policy made of a replayed incident (`monitor_server/services/policies.py`)."""

    id: int
    run_id: int
    incident_id: int | None
    rule: Literal["nonfinite", "low_sqnr", "persistent_underflow", "stale_scale"]
    target: str = Field(description="the layer")
    changes: dict[str, Any] = Field(description="the recipe change, as a command's")
    reason: str
    state: Literal["proposed", "queued", "kept", "rolled_back", "capped", "ended"]
    command_id: int | None = Field(description="the command queued for it (by the policy or a person)")
    rollback_id: int | None = Field(description="the rollback the check queued")
    loss_before: float | None = Field(description="mean loss of the check_steps steps before the command")
    loss_after: float | None = Field(description="mean loss of the check_steps steps after it")
    created_at: UtcDatetime
    checked_at: UtcDatetime | None


class ReplayRequestCreate(BaseModel):
    """Body of POST /runs/{id}/incidents/{incident_id}/replay-requests."""

    model_config = ConfigDict(extra="forbid")

    bundle: str | None = Field(
        default=None,
        max_length=4096,
        description="one of the incident's `bundles`; default: the newest",
    )


class ReplayRequestFinish(BaseModel):
    """Body of POST /replay-requests/{id}/finish (the worker that claimed it)."""

    model_config = ConfigDict(extra="forbid")

    state: Literal["done", "failed"]
    detail: str | None = Field(default=None, max_length=4096, description="why it failed (a log line)")


class ReplayRequestPublic(PublicModel):
    """A request that an incident's bundle be replayed by a replay worker (``fp8-monitor replay-worker``)."""

    id: int
    run_id: int
    incident_id: int
    bundle: str
    state: Literal["pending", "running", "done", "failed"]
    requested_by: str
    claimed_by: str | None
    detail: str | None
    created_at: UtcDatetime
    updated_at: UtcDatetime


class Health(PublicModel):
    """Response of GET /healthz (status "ok") and GET /readyz (status "ready")."""

    status: Literal["ok", "ready"]
    database: str = Field(description="the database's SQLAlchemy dialect: sqlite or postgresql")


class NotReady(PublicModel):
    """The 503 answer of GET /readyz: the database does not take a write."""

    status: Literal["unavailable"]
    database: str = Field(description="the database's SQLAlchemy dialect: sqlite or postgresql")
    detail: str = Field(description="the type of the error the write met, e.g. OperationalError")


class WhoAmI(PublicModel):
    """Response of GET /whoami."""

    name: str = Field(description='the token\'s name ("anonymous" without tokens)')
    scopes: list[str] = Field(description="the scopes it holds, in the order ingest, read, control")
    auth: bool = Field(description="whether the server checks tokens (false: everyone holds every scope)")
