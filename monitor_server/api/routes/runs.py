"""Runs: create, list (search, filters, sorts, cursor paging), show, update (status, name, tags, notes),
delete."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, HTTPException, Query, Response, status
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fp8_protocol.runs import MAX_TAGS
from monitor_server.api.context import AppContext
from monitor_server.api.deps import (
    ControlDep,
    CtxDep,
    ReadDep,
    ReadRunDep,
    RunId,
    RunWriteDep,
    SessionDep,
    run_or_404,
)
from monitor_server.core.security import check_owner
from monitor_server.infra.wire import first_nonfinite, json_too_deep
from monitor_server.services import run_admin
from monitor_server.services.commands import command_public, effective_recipe
from monitor_server.services.run_admin import (
    RunFilter,
    count_open_alerts,
    count_open_incidents,
    insert_run,
    parse_config_filter,
    run_by_client_key,
    tags_of,
)
from monitor_server.storage import run_sort
from monitor_server.storage.models import Run, utcnow
from monitor_server.storage.schemas import MAX_ID, RunCreate, RunPublic, RunStatus, RunUpdate, Tag, attributes

router = APIRouter(prefix="/runs", tags=["runs"])
NEXT_CURSOR = "X-Next-Cursor"
#: the fields of `RunPublic` shown as the run stores them
RUN_COLUMNS = (
    "id",
    "name",
    "config",
    "recipe",
    "recipe_overrides",
    "world_size",
    "host",
    "status",
    "num_tensors",
    "created_at",
    "updated_at",
    "first_step",
    "last_step",
    "last_loss",
    "steps_stored",
    "last_telemetry_at",
    "notes",
)


#: the most config keys one runs list asks for (`config_keys`)
MAX_CONFIG_KEYS = 32


def config_subset(config: dict[str, Any] | None, keys: list[str]) -> dict[str, Any]:
    """The parts of a nested `config` that `keys` name (``a.b`` is ``config["a"]["b"]``), nested as they
    are in it: what a runs list shows of each run."""
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = config or {}
        parts = key.split(".")
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            target = out
            for part in parts[:-1]:  # copies on the way down: the run's own config is never changed
                nested = target.get(part)
                target[part] = dict(nested) if isinstance(nested, dict) else {}
                target = target[part]
            target[parts[-1]] = node
    return out


def parse_config_keys(text: str | None) -> list[str]:
    """``config_keys``: comma-separated config keys (``lr,model.n_layer``), at most `MAX_CONFIG_KEYS`."""
    keys = [k.strip() for k in (text or "").split(",") if k.strip()]
    if len(keys) > MAX_CONFIG_KEYS:
        raise ValueError(f"config_keys: {len(keys)} keys; at most {MAX_CONFIG_KEYS}")
    return keys


def run_public(
    run: Run,
    open_alerts: int,
    open_incidents: int = 0,
    tags: list[str] | None = None,
    config_keys: list[str] | None = None,
) -> RunPublic:
    """A run as the API returns it; with `config_keys` (a list), only those keys of its config."""
    stored = attributes(run, RUN_COLUMNS)
    if config_keys is not None:
        stored["config"] = config_subset(run.config, config_keys)
    counted = {"open_alerts": open_alerts, "open_incidents": open_incidents, "tags": list(tags or ())}
    derived = {"effective_recipe": effective_recipe(run), "scalar_names": list(run.scalar_names or ())}
    return RunPublic.model_validate({**stored, **counted, **derived})


def _existing_run(ctx: AppContext, body: RunCreate) -> RunPublic | None:
    """The run registered earlier with `body.client_key`, or None; 409 if it has other tensors."""
    if body.client_key is None:
        return None
    with ctx.db.read_session() as session:
        run = run_by_client_key(session, body.client_key)
        if run is None:
            return None
        if run.num_tensors != len(body.tensors):
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"client_key: run {run.id} was registered with this key and {run.num_tensors} tensors, "
                f"not {len(body.tensors)}",
            )
        return run_public(
            run, count_open_alerts(session, run.id), tags=tags_of(session, [run.id]).get(run.id)
        )


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=RunPublic,
    responses={
        200: {"model": RunPublic, "description": "a run with this client_key exists: returned as is"},
        409: {"description": "client_key already used for a run with another number of tensors"},
    },
)
def create_run(body: RunCreate, ctx: CtxDep, principal: RunWriteDep, response: Response) -> RunPublic:
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
    size, limit = len(orjson.dumps(body.config)), ctx.settings.max_config_bytes
    if size > limit:  # every view of the run carries it
        raise HTTPException(
            422, f"config: {size} bytes of JSON exceed the limit of {limit} bytes (max_config_bytes)"
        )
    existing = _existing_run(ctx, body)
    if existing is not None:
        response.status_code = status.HTTP_200_OK
        return existing
    now = utcnow()
    try:
        with ctx.db.write() as session:
            owner = principal.name if ctx.settings.auth_enabled else None
            run = insert_run(session, body=body, owner=owner, now=now)
            created = run_public(run, 0, tags=body.tags)
    except IntegrityError:
        # a concurrent registration with the same client_key won the race
        existing = _existing_run(ctx, body)
        if existing is None:
            raise
        response.status_code = status.HTTP_200_OK
        return existing
    # after the commit: the runs list (all-runs stream) shows a new run before its first step arrives
    announce = {"id": created.id, "status": created.status, "created": True}
    ctx.broker.publish(created.id, "run", announce)
    return created


@router.get(
    "",
    response_model=list[RunPublic],
    responses={200: {"headers": {NEXT_CURSOR: {"description": "`cursor` of the next page (absent: last)"}}}},
)
def list_runs(
    session: SessionDep,
    _principal: ReadDep,
    response: Response,
    status_: Annotated[RunStatus | None, Query(alias="status")] = None,
    q: Annotated[str | None, Query(max_length=200, description="part of the run's name (any case)")] = None,
    tag: Annotated[list[Tag], Query(max_length=MAX_TAGS, description="runs with all of these tags")] = (),
    config: Annotated[
        list[str], Query(max_length=16, description="KEY=VALUE: the run's config has it (KEY may be a.b)")
    ] = (),
    sort: Annotated[str | None, Query(max_length=300, description=f"the order: {run_sort.ALLOWED}")] = None,
    cursor: Annotated[
        str | None, Query(max_length=2000, description="the previous page's X-Next-Cursor")
    ] = None,
    before: Annotated[
        int | None,
        Query(ge=1, le=MAX_ID, description="newest first only: the runs below this id (the cursor there)"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    config_keys: Annotated[
        str | None,
        Query(
            max_length=2000,
            description=f"comma-separated config keys (a.b nested) each run's `config` shows; none: `{{}}`"
            f" (at most {MAX_CONFIG_KEYS})",
        ),
    ] = None,
) -> list[RunPublic]:
    """Runs, newest first or in the order `sort` names (ties broken by id), with status, last step, last loss
    and the number of open alerts. When more runs match than `limit`, the `X-Next-Cursor` header holds the
    `cursor` of the next page (newest first it is a run id, which `before` also takes). Each run's `config`
    holds only the `config_keys` asked for and the keys `config` filters and `sort` name (`GET /runs/{id}`
    has it whole)."""
    try:
        # the keys asked for, and those the list is filtered or sorted by
        keys = parse_config_keys(config_keys)
        keys += [c.split("=", 1)[0].strip() for c in config if "=" in c]
        if sort and sort.lstrip("-").startswith(run_sort.CONFIG_PREFIX):
            keys.append(sort.lstrip("-")[len(run_sort.CONFIG_PREFIX) :])
        order = run_sort.parse_sort(sort)
        if before is not None and (cursor is not None or order is not None):
            raise ValueError("before: only for the newest-first list without a cursor; give cursor instead")
        flt = RunFilter(q=q, status=status_, tags=tuple(tag), config=parse_config_filter(list(config)))
        start = str(before) if before is not None else cursor
        rows, next_cursor = run_admin.list_runs(session, flt=flt, limit=limit, sort=order, cursor=start)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    if next_cursor is not None:
        response.headers[NEXT_CURSOR] = next_cursor
    tags = tags_of(session, [run.id for run, _, _ in rows])
    return [run_public(run, n, m, tags.get(run.id), keys) for run, n, m in rows]


@router.get("/{run_id}", response_model=RunPublic)
def get_run(run_id: RunId, run: ReadRunDep, session: SessionDep) -> RunPublic:
    """One run, including its effective recipe (base recipe + applied overrides)."""
    return _public(session, run)


@router.patch("/{run_id}", response_model=RunPublic)
def update_run(run_id: RunId, body: RunUpdate, ctx: CtxDep, principal: RunWriteDep) -> RunPublic:
    """Change a run's status (one of `fp8_protocol.runs.RUN_STATUSES`), name, tags or notes (each replaced as
    a whole). An `ingest` token changes only its own runs. A run that ends rejects its commands not yet
    applied."""
    with ctx.db.write() as session:
        run = run_or_404(session, run_id)
        check_owner(principal, run.owner, run_id)
        ended = run_admin.update_run(session, run, body=body, now=utcnow())
        ended_public = [command_public(c) for c in ended]
        result = _public(session, run)
    changed = {"id": run_id, "status": result.status, "name": result.name, "tags": result.tags}
    ctx.broker.publish(run_id, "run", changed)
    for command in ended_public:
        ctx.broker.publish(run_id, "command", command)
    if body.status is not None and body.status != "running":  # a finished run's caches go now
        ctx.detection.retire(run_id)
        ctx.run_meta.forget(run_id)
    return result


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_run(run_id: RunId, ctx: CtxDep, _principal: ControlDep) -> Response:
    """Delete a run and everything stored for it (statistics, scalars, events, alerts, commands)."""
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        if not run_admin.delete_run(session, run_id):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    ctx.forget_run(run_id)
    ctx.broker.publish(run_id, "run", {"id": run_id, "deleted": True})
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _public(session: Session, run: Run) -> RunPublic:
    return run_public(
        run,
        count_open_alerts(session, run.id),
        count_open_incidents(session, run.id),
        tags_of(session, [run.id]).get(run.id),
    )
