"""Dependencies shared by the routes: the app context, DB sessions, bearer-token scopes, the run a path
names, the step-range query parameters and the heatmap both heatmap routes answer from.

Authentication: ``Authorization: Bearer <secret>``. With no tokens configured every request is allowed
(as "anonymous"). A missing or unknown token is 401, a known token without the needed scope 403; who a
token names and what it may do is `monitor_server/core/security.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from monitor_server.api.context import AppContext
from monitor_server.core.security import Principal, check_scope, principal_for
from monitor_server.services.heatmap import (
    HeatmapBadParameter,
    HeatmapTooLarge,
    heatmap_buckets,
    heatmap_selection,
)
from monitor_server.services.incidents import incident_of_run
from monitor_server.storage.models import Incident, Run
from monitor_server.storage.query_schemas import HeatmapHead
from monitor_server.storage.run_meta import RunMeta
from monitor_server.storage.schemas import AlertState, HeatmapMetric
from monitor_server.storage.series import step_range

bearer_scheme = HTTPBearer(auto_error=False, description="Bearer token with scopes ingest / read / control")


async def get_ctx(request: Request) -> AppContext:
    """The app's context (async: run on the event loop, not a worker thread's round trip per request)."""
    return request.app.state.ctx


CtxDep = Annotated[AppContext, Depends(get_ctx)]


def get_session(ctx: CtxDep) -> Iterator[Session]:
    """A read session for the duration of the request."""
    with ctx.db.read_session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def authenticate(ctx: AppContext, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """Resolve the caller from the Authorization header (401 when required and missing/unknown)."""
    if credentials is None:
        return principal_for(ctx.settings, None, None)
    return principal_for(ctx.settings, credentials.scheme, credentials.credentials)


def require_scope(*scopes: str) -> Callable[..., Principal]:
    """A dependency admitting callers holding any of `scopes` (403 otherwise).

    The dependency carries its scopes as `required_scopes`, so the request guard can refuse a caller
    before the request's body is read (FastAPI reads and parses a body before it runs dependencies).
    """

    async def dependency(
        ctx: CtxDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
    ) -> Principal:
        # async: a few comparisons, done on the event loop rather than in a worker thread
        return check_scope(authenticate(ctx, credentials), scopes)

    dependency.required_scopes = scopes  # type: ignore[attr-defined]
    return dependency


ReadDep = Annotated[Principal, Depends(require_scope("read"))]
IngestDep = Annotated[Principal, Depends(require_scope("ingest"))]
ControlDep = Annotated[Principal, Depends(require_scope("control"))]
#: creating runs and setting their status: the training job (ingest) or an operator (control)
RunWriteDep = Annotated[Principal, Depends(require_scope("ingest", "control"))]

#: path parameters naming database rows (32-bit ids)
RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]
AlertId = Annotated[int, Path(ge=1, le=2**31 - 1, description="alert id")]
EventId = Annotated[int, Path(ge=1, le=2**31 - 1, description="event id")]
IncidentId = Annotated[int, Path(ge=1, le=2**31 - 1, description="incident id")]
ActionId = Annotated[int, Path(ge=1, le=2**31 - 1, description="policy action id")]
RequestId = Annotated[int, Path(ge=1, le=2**31 - 1, description="replay request id")]

#: query parameters bounding a step range (`check_order` refuses one that ends before it starts)
FromQ = Annotated[
    int | None, Query(alias="from", ge=0, le=2**62, description="first step (default: the run's first)")
]
ToQ = Annotated[
    int | None, Query(alias="to", ge=0, le=2**62, description="last step (default: the run's last)")
]


#: the state filter of the alert and incident lists
AlertStateQ = Annotated[AlertState | None, Query(description="only those in this state")]


def check_order(lo: int | None, hi: int | None) -> None:
    """422 when the requested `to` step comes before `from`."""
    if lo is not None and hi is not None and hi < lo:
        raise HTTPException(422, f"to ({hi}) is before from ({lo})")


def clipped_range(run: Run, lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """The requested steps [lo, hi] (422 when hi < lo) clipped to the run's stored ones; None when that
    leaves nothing."""
    check_order(lo, hi)
    return step_range(run.first_step, run.last_step, lo, hi)


def incident_or_404(session: Session, run_id: int, incident_id: int) -> Incident:
    """The run's incident, or 404 naming both (an incident of another run is not found in this one)."""
    incident = incident_of_run(session, run_id=run_id, incident_id=incident_id)
    if incident is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"incident {incident_id} not found in run {run_id}")
    return incident


def run_or_404(session: Session, run_id: int) -> Run:
    """The run, or 404 naming it; for a route that reads it in a session of its own (a write transaction,
    or a short read before a stream). The others take `RunDep`."""
    run = session.get(Run, run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    return run


def get_run_or_404(run_id: RunId, session: SessionDep) -> Run:
    """The run the path names, read in the request's session (404 when there is none). FastAPI caches a
    dependency per request: a route and its other dependencies that take `RunDep` share one read."""
    return run_or_404(session, run_id)


RunDep = Annotated[Run, Depends(get_run_or_404)]


def get_readable_run(_principal: ReadDep, run: RunDep) -> Run:
    """The run the path names, for a caller holding the read scope: 401/403 first (FastAPI resolves
    dependencies in parameter order), so a caller without it cannot tell which runs exist; then 404."""
    return run


#: the run the path names, read by a caller with the read scope
ReadRunDep = Annotated[Run, Depends(get_readable_run)]


def get_readable_incident(
    _principal: ReadDep, run_id: RunId, incident_id: IncidentId, session: SessionDep
) -> Incident:
    """The incident the path names, in the run it names, for a caller holding the read scope: 401/403 first,
    then 404 (`incident_or_404`)."""
    return incident_or_404(session, run_id, incident_id)


#: the incident the path names, read by a caller with the read scope
ReadIncidentDep = Annotated[Incident, Depends(get_readable_incident)]


def get_run_meta_or_404(run: RunDep, ctx: CtxDep, session: SessionDep) -> RunMeta:
    """The run's cached meta (its tensors), 404 when it has none."""
    meta = ctx.run_meta.get(session, run.id)
    if meta is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run.id} has no tensors")
    return meta


RunMetaDep = Annotated[RunMeta, Depends(get_run_meta_or_404)]


def get_heatmap(
    run: RunDep,
    meta: RunMetaDep,
    ctx: CtxDep,
    session: SessionDep,
    _principal: ReadDep,
    metric: Annotated[
        HeatmapMetric | None, Query(description="one metric (amax when neither this nor metrics is given)")
    ] = None,
    metrics: Annotated[
        str | None,
        Query(max_length=400, description="several metrics of the same buckets, comma-separated"),
    ] = None,
    tensors: Annotated[
        str | None,
        Query(
            max_length=65_536, description="only these tensors' rows: indices and ranges, e.g. 3,4,5 or 0-95"
        ),
    ] = None,
    layer: Annotated[str | None, Query(max_length=1000, description="only this layer's tensors")] = None,
    from_: FromQ = None,
    to: ToQ = None,
    max_cols: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    after_step: Annotated[
        int | None,
        Query(ge=0, le=2**62, description="only the buckets holding steps after this one (a live refresh)"),
    ] = None,
    bucket_width: Annotated[
        int | None,
        Query(
            ge=1, le=2**62, description="with after_step: the width the caller holds (else: the whole range)"
        ),
    ] = None,
) -> tuple[HeatmapHead, dict[str, Any] | None]:
    """The heatmap's fields but its values, and its buckets (`heatmap_buckets`); 422 naming the parameter
    for an unknown metric, tensor or layer, when it has more cells than `max_heatmap_cells` or `to` comes
    before `from`."""
    check_order(from_, to)
    try:
        selection = heatmap_selection(
            meta,
            metric=metric,
            metrics=metrics,
            tensors=tensors,
            layer=layer,
            after_step=after_step,
            held_width=bucket_width,
        )
        cells = ctx.settings.max_heatmap_cells
        return heatmap_buckets(
            session, run, meta, selection, lo=from_, hi=to, max_cols=max_cols, max_cells=cells
        )
    except (HeatmapTooLarge, HeatmapBadParameter) as exc:
        raise HTTPException(422, str(exc)) from None


#: the heatmap both heatmap routes answer from (its parameters are theirs)
HeatmapDep = Annotated[tuple[HeatmapHead, dict[str, Any] | None], Depends(get_heatmap)]
