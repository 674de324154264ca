"""Recipe-change commands: queue (validated) and list with their audit trail."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, status

from monitor_server.api.deps import ControlDep, CtxDep, ReadRunDep, RunId, SessionDep
from monitor_server.services.commands import (
    CommandError,
    create_command,
    run_commands,
    run_for_update,
)
from monitor_server.storage.schemas import CommandCreate, CommandPublic

router = APIRouter(prefix="/runs", tags=["commands"])


@router.post("/{run_id}/commands", status_code=status.HTTP_201_CREATED, response_model=CommandPublic)
def post_command(run_id: RunId, body: CommandCreate, ctx: CtxDep, principal: ControlDep) -> CommandPublic:
    """Queue a recipe change for the whole model or one layer, or a rollback of an applied command.

    The training job receives it in its next telemetry response, applies it at a step boundary and acks it.
    """
    with ctx.db.write() as session:
        run = run_for_update(session, run_id)
        if run is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
        meta = ctx.run_meta.get(session, run_id)
        layers = set(meta.layers) if meta else set()
        try:
            command = create_command(session, run=run, body=body, created_by=principal.name, layers=layers)
        except CommandError as exc:
            raise HTTPException(exc.status, exc.message) from None
        public = CommandPublic.model_validate(command, from_attributes=True)
    ctx.broker.publish(run_id, "command", public.model_dump())
    return public


@router.get("/{run_id}/commands", response_model=list[CommandPublic])
def list_commands(
    run_id: RunId,
    _run: ReadRunDep,
    session: SessionDep,
    state: Annotated[Literal["pending", "delivered", "applied", "rejected"] | None, Query()] = None,
) -> list[CommandPublic]:
    """The run's commands, newest first."""
    commands = run_commands(session, run_id=run_id, state=state)
    return [CommandPublic.model_validate(c, from_attributes=True) for c in commands]
