"""Remediation policy actions: list what a run's policy queued or proposed, and apply a proposed one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from monitor_server.api.deps import ActionId, ControlDep, CtxDep, ReadRunDep, RunId, SessionDep, run_or_404
from monitor_server.services.commands import CommandError, command_public
from monitor_server.services.policies import action_of_run, apply_proposal, run_actions
from monitor_server.storage.schemas import PolicyActionPublic

router = APIRouter(prefix="/runs", tags=["commands"])


@router.get("/{run_id}/policy-actions", response_model=list[PolicyActionPublic])
def list_policy_actions(
    run_id: RunId,
    _run: ReadRunDep,
    session: SessionDep,
    incident_id: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="only this incident's")] = None,
) -> list[PolicyActionPublic]:
    """The run's policy actions, newest first: the rule, the change, its state and the loss check."""
    actions = run_actions(session, run_id=run_id, incident_id=incident_id)
    return [PolicyActionPublic.model_validate(a, from_attributes=True) for a in actions]


@router.post("/{run_id}/policy-actions/{action_id}/apply", response_model=PolicyActionPublic)
def apply_policy_action(
    run_id: RunId, action_id: ActionId, ctx: CtxDep, principal: ControlDep
) -> PolicyActionPublic:
    """Apply a proposed action (a dry-run policy's): its command is queued with the caller as its author,
    then checked against the loss and rolled back if the loss got worse, as the policy's own are."""
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        run = run_or_404(session, run_id)
        action = action_of_run(session, run_id=run_id, action_id=action_id)
        if action is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"policy action {action_id} not found in run {run_id}"
            )
        meta = ctx.run_meta.get(session, run_id)
        try:
            command = apply_proposal(
                session,
                run=run,
                action=action,
                who=principal.name,
                layers=set(meta.layers) if meta else set(),
            )
        except CommandError as exc:
            raise HTTPException(exc.status, exc.message) from None
        public = PolicyActionPublic.model_validate(action, from_attributes=True)
        command_out = command_public(command)
    ctx.broker.publish(run_id, "command", command_out)
    return public
