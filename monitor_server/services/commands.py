"""The control channel: recipe-change commands, their lifecycle and the run's effective recipe.

Lifecycle: pending -> delivered (returned in a telemetry response) -> applied (acked with the step) or
rejected (acked with a reason). When a command is applied, the values it replaced are stored in `previous`
and the run's `recipe_overrides` follow the change. A rollback is a new command whose changes are the
`previous` of an applied command. Layer overrides take precedence over model-wide ones.
"""

from __future__ import annotations

from typing import Any, get_args

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitor_server.storage.models import Command, Run, as_utc, utcnow
from monitor_server.storage.schemas import CommandCreate, CommandPublic, Scaling, attributes

#: Transformer Engine DelayedScaling defaults, used for fields the run's base recipe does not state
RECIPE_DEFAULTS: dict[str, Any] = {
    "margin": 0,
    "amax_history_len": 1024,
    "amax_compute_algo": "max",
    "interval": 1,
    "scaling": "delayed",
    "fp8_enabled": True,
}
MODEL_TARGET = "model"
#: the recipe kinds a job registers as ``type`` that are also a ``scaling`` (the runtime's four)
SCALINGS: tuple[str, ...] = get_args(Scaling)


class CommandError(Exception):
    """A command request or ack that cannot be honoured; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _overrides(run: Run) -> dict[str, Any]:
    ov = run.recipe_overrides or {}
    return {
        "model": dict(ov.get("model", {})),
        "layers": {k: dict(v) for k, v in ov.get("layers", {}).items()},
    }


def base_recipe(recipe: dict[str, Any] | None) -> dict[str, Any]:
    """The run's registered recipe over the defaults. A job states its recipe's kind as ``type``
    (``DelayedScaling.to_dict()``: ``{"type": "current", ...}``), which is the ``scaling`` a command
    changes: a current-scaled run's ``scaling`` is ``current``, not the defaults' ``delayed``."""
    recipe = recipe or {}
    kind = recipe.get("type")
    scaling = {"scaling": kind} if kind in SCALINGS and "scaling" not in recipe else {}
    return {**RECIPE_DEFAULTS, **recipe, **scaling}


def effective_recipe(run: Run) -> dict[str, Any]:
    """The recipe in force: {"model": defaults + base recipe + model overrides, "layers": {layer: merged}}.

    Only layers with overrides are listed under "layers".
    """
    ov = _overrides(run)
    model = {**base_recipe(run.recipe), **ov["model"]}
    return {"model": model, "layers": {layer: {**model, **values} for layer, values in ov["layers"].items()}}


def _effective_for(run: Run, target: str) -> dict[str, Any]:
    eff = effective_recipe(run)
    model: dict[str, Any] = eff["model"]
    recipe: dict[str, Any] = eff["layers"].get(target, model) if target != MODEL_TARGET else model
    return recipe


def create_command(
    session: Session, *, run: Run, body: CommandCreate, created_by: str, layers: set[str]
) -> Command:
    """Validate and queue a recipe change or rollback for `run`.

    Raises:
        CommandError: 409 for a run that is no longer running, 422 for an unknown layer, 404/409 for a
            rollback of a missing or unapplied command.
    """
    if run.status != "running":
        raise CommandError(
            409, f"run {run.id} is {run.status}: recipe changes go to running jobs only (none would apply it)"
        )
    if body.rollback is not None:
        original = session.get(Command, body.rollback)
        if original is None or original.run_id != run.id:
            raise CommandError(404, f"rollback: command {body.rollback} is not a command of run {run.id}")
        if original.state != "applied" or original.previous is None:
            raise CommandError(
                409,
                f"rollback: command {original.id} is {original.state}; "
                "only an applied command can be rolled back",
            )
        command = Command(
            run_id=run.id,
            kind="rollback",
            target=original.target,
            changes=dict(original.previous),
            rollback_of=original.id,
            state="pending",
            created_by=created_by,
            created_at=utcnow(),
        )
    else:
        target = body.target or MODEL_TARGET
        if target != MODEL_TARGET and target not in layers:
            raise CommandError(422, f"target: {target!r} is neither 'model' nor a layer of run {run.id}")
        assert body.changes is not None
        command = Command(
            run_id=run.id,
            kind="recipe_change",
            target=target,
            changes=body.changes.model_dump(exclude_none=True),
            state="pending",
            created_by=created_by,
            created_at=utcnow(),
        )
    session.add(command)
    session.flush()
    return command


def apply_acks(session: Session, run: Run, acks: list[dict[str, Any]]) -> list[Command]:
    """Resolve commands acknowledged in a telemetry batch; returns the commands whose state changed.

    An ack for a command already applied or rejected is ignored (acks may be retried).

    Raises:
        CommandError: 422 when an ack names a command that is not this run's.
    """
    changed = []
    for i, ack in enumerate(acks):
        command = session.get(Command, ack["command_id"])
        if command is None or command.run_id != run.id:
            raise CommandError(
                422, f"acks[{i}].command_id: command {ack['command_id']} is not a command of run {run.id}"
            )
        if command.state in ("applied", "rejected"):
            continue
        now = utcnow()
        if ack["state"] == "applied":
            before = _effective_for(run, command.target)
            command.previous = {key: before.get(key) for key in command.changes}
            ov = _overrides(run)
            bucket = (
                ov["model"] if command.target == MODEL_TARGET else ov["layers"].setdefault(command.target, {})
            )
            bucket.update(command.changes)
            run.recipe_overrides = ov
            command.applied_step = ack["step"]
        else:
            command.reason = ack["reason"]
        command.state = ack["state"]
        command.resolved_at = now
        if command.delivered_at is None:
            command.delivered_at = now
        changed.append(command)
    return changed


def end_commands(session: Session, run: Run) -> list[Command]:
    """The run has ended: its commands not yet acknowledged can no longer apply. Rejects them with the
    reason and returns them."""
    open_ = session.scalars(
        select(Command).where(Command.run_id == run.id, Command.state.in_(("pending", "delivered")))
    ).all()
    now = utcnow()
    for command in open_:
        command.state = "rejected"
        command.reason = f"the run ended ({run.status}) before the job applied it"
        command.resolved_at = now
    return list(open_)


def deliver_pending(session: Session, run: Run) -> tuple[list[Command], list[Command]]:
    """The run's unacknowledged commands, oldest first, and those of them that were pending until now.

    Pending commands become delivered. Commands delivered before but not yet acknowledged are sent again:
    a response lost on the way (a server killed after its commit, a client timeout) must not lose a
    command, and the client applies each command id once.
    """
    unacked = list(
        session.scalars(
            select(Command)
            .where(Command.run_id == run.id, Command.state.in_(("pending", "delivered")))
            .order_by(Command.id)
        )
    )
    now = utcnow()
    fresh = [c for c in unacked if c.state == "pending"]
    for command in fresh:
        command.state = "delivered"
        command.delivered_at = now
    return unacked, fresh


#: the times of a command (SQLite hands them back naive)
_COMMAND_TIMES = ("created_at", "delivered_at", "resolved_at")


def command_public(command: Command) -> dict[str, Any]:
    """A command as the API returns it: `CommandPublic`'s fields in its order, the times in UTC. A dict, not
    the model: telemetry responses carry every unacknowledged command, and the stream takes dicts."""
    public = attributes(command, CommandPublic.model_fields)
    for name in _COMMAND_TIMES:
        public[name] = as_utc(public[name])
    return public


def run_for_update(session: Session, run_id: int) -> Run | None:
    """The run, its row locked until the transaction ends (commands are numbered and checked against it)."""
    return session.execute(select(Run).where(Run.id == run_id).with_for_update()).scalar_one_or_none()


def run_commands(session: Session, *, run_id: int, state: str | None) -> list[Command]:
    """The run's commands, newest first, of `state` where given."""
    query = select(Command).where(Command.run_id == run_id).order_by(Command.id.desc())
    if state is not None:
        query = query.where(Command.state == state)
    return list(session.execute(query).scalars())
