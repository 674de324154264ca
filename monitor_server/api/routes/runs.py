"""Runs: create, list, show, set status."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response, status
from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from monitor_server.api.deps import CtxDep, ReadDep, RunId, RunWriteDep, SessionDep, check_owner
from monitor_server.commands import effective_recipe
from monitor_server.context import AppContext
from monitor_server.models import Alert, Incident, Run, TensorRow, as_utc, utcnow
from monitor_server.schemas import RunCreate, RunPublic, RunStatus, RunUpdate
from monitor_server.wire import first_nonfinite, json_too_deep

router = APIRouter(prefix="/runs", tags=["runs"])


def run_public(run: Run, open_alerts: int, open_incidents: int = 0) -> dict[str, Any]:
    """A run as the API returns it."""
    return {
        "id": run.id,
        "name": run.name,
        "config": run.config,
        "recipe": run.recipe,
        "recipe_overrides": run.recipe_overrides,
        "effective_recipe": effective_recipe(run),
        "world_size": run.world_size,
        "host": run.host,
        "status": run.status,
        "num_tensors": run.num_tensors,
        "created_at": as_utc(run.created_at),
        "updated_at": as_utc(run.updated_at),
        "first_step": run.first_step,
        "last_step": run.last_step,
        "last_loss": run.last_loss,
        "steps_stored": run.steps_stored,
        "last_telemetry_at": as_utc(run.last_telemetry_at),
        "open_alerts": open_alerts,
        "open_incidents": open_incidents,
    }


def get_run_or_404(session: Session, run_id: int) -> Run:
    """The run, or 404 naming it."""
    run = session.get(Run, run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    return run


def count_open_alerts(session: Session, run_id: int) -> int:
    """Open alerts of one run."""
    return session.scalar(select(func.count()).where(Alert.run_id == run_id, Alert.state == "open")) or 0


def count_open_incidents(session: Session, run_id: int) -> int:
    """Open incidents of one run."""
    query = select(func.count()).where(Incident.run_id == run_id, Incident.state == "open")
    return session.scalar(query) or 0


def _by_index(t: Any) -> int:
    return t.index


def _existing_run(ctx: AppContext, body: RunCreate) -> dict[str, Any] | None:
    """The run registered earlier with `body.client_key`, or None; 409 if it has other tensors."""
    if body.client_key is None:
        return None
    with ctx.db.read_session() as session:
        run = session.scalar(select(Run).where(Run.client_key == body.client_key))
        if run is None:
            return None
        if run.num_tensors != len(body.tensors):
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"client_key: run {run.id} was registered with this key and {run.num_tensors} tensors, "
                f"not {len(body.tensors)}",
            )
        return run_public(run, count_open_alerts(session, run.id))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=RunPublic,
    responses={
        200: {"model": RunPublic, "description": "a run with this client_key exists: returned as is"},
        409: {"description": "client_key already used for a run with another number of tensors"},
    },
)
def create_run(body: RunCreate, ctx: CtxDep, principal: RunWriteDep, response: Response) -> dict[str, Any]:
    """Register a run and its quantized tensors (dense indices 0..T-1).

    With a `client_key`, registering is idempotent: a retried or replayed registration gets the run
    created first with that key (200) instead of a second run.
    """
    limit = ctx.settings.max_tensors
    if len(body.tensors) > limit:
        raise HTTPException(
            422, f"tensors: {len(body.tensors)} tensors exceed the limit of {limit} per run (max_tensors)"
        )
    for name in ("config", "recipe"):
        value = getattr(body, name)
        if json_too_deep(value, ctx.settings.max_json_depth):
            limit = ctx.settings.max_json_depth
            raise HTTPException(
                422, f"{name}: nested deeper than the limit of {limit} levels (max_json_depth)"
            )
        bad = first_nonfinite(value, name)
        if bad is not None:  # stored, it would silently become null
            raise HTTPException(422, f"{bad}: NaN and Infinity are not JSON; send them as strings")
    existing = _existing_run(ctx, body)
    if existing is not None:
        response.status_code = status.HTTP_200_OK
        return existing
    now = utcnow()
    try:
        with ctx.db.write() as session:
            run = Run(
                name=body.name,
                config=body.config,
                recipe=body.recipe,
                recipe_overrides={"model": {}, "layers": {}},
                world_size=body.world_size,
                host=body.host,
                status="running",
                num_tensors=len(body.tensors),
                created_at=now,
                updated_at=now,
                steps_stored=0,
                client_key=body.client_key,
                owner=principal.name if ctx.settings.auth_enabled else None,
            )
            session.add(run)
            session.flush()
            if body.tensors:  # a run without FP8 (a bf16 / fp32 baseline) registers none
                session.execute(
                    insert(TensorRow),
                    [{"run_id": run.id, **t.model_dump()} for t in sorted(body.tensors, key=_by_index)],
                )
            created = run_public(run, 0)
    except IntegrityError:
        # a concurrent registration with the same client_key won the race
        existing = _existing_run(ctx, body)
        if existing is None:
            raise
        response.status_code = status.HTTP_200_OK
        return existing
    # after the commit: the runs list (all-runs stream) shows a new run before its first step arrives
    announce = {"id": created["id"], "status": created["status"], "created": True}
    ctx.broker.publish(created["id"], "run", announce)
    return created


@router.get("", response_model=list[RunPublic])
def list_runs(
    session: SessionDep,
    _principal: ReadDep,
    status_: Annotated[RunStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    """Runs, newest first, with status, last step, last loss and the number of open alerts."""
    open_count = (
        select(func.count())
        .where(Alert.run_id == Run.id, Alert.state == "open")
        .correlate(Run)
        .scalar_subquery()
    )
    open_incidents = (
        select(func.count())
        .where(Incident.run_id == Run.id, Incident.state == "open")
        .correlate(Run)
        .scalar_subquery()
    )
    query = select(Run, open_count, open_incidents).order_by(Run.id.desc()).limit(limit)
    if status_ is not None:
        query = query.where(Run.status == status_)
    return [run_public(run, n, m) for run, n, m in session.execute(query).all()]


@router.get("/{run_id}", response_model=RunPublic)
def get_run(run_id: RunId, session: SessionDep, _principal: ReadDep) -> dict[str, Any]:
    """One run, including its effective recipe (base recipe + applied overrides)."""
    run = get_run_or_404(session, run_id)
    return run_public(run, count_open_alerts(session, run_id), count_open_incidents(session, run_id))


@router.patch("/{run_id}", response_model=RunPublic)
def update_run(run_id: RunId, body: RunUpdate, ctx: CtxDep, principal: RunWriteDep) -> dict[str, Any]:
    """Set a run's status (running, finished, crashed). An `ingest` token sets it only on its own runs."""
    with ctx.db.write() as session:
        run = get_run_or_404(session, run_id)
        check_owner(principal, run.owner, run_id)
        run.status = body.status
        run.updated_at = utcnow()
        session.flush()
        result = run_public(run, count_open_alerts(session, run_id), count_open_incidents(session, run_id))
    ctx.broker.publish(run_id, "run", {"id": run_id, "status": body.status})
    if body.status != "running":  # a finished run's caches go now, not when the cache fills up
        ctx.detection.forget(run_id)
        ctx.run_meta.forget(run_id)
    return result
