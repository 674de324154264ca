"""Remediation policies: from a replayed incident's verdict to a recipe command, and back if it did not help.

A run opts in with its configuration's ``remediation``: a mode (``fp8-train --remediation act|propose``), or
an object (``Monitor(config={"remediation": {"mode": "act", ...}})``). ``mode`` ``"act"`` queues the
command, ``"propose"`` (a dry run) lists it on the incident for a person to apply with one click
(``POST .../policy-actions/{id}/apply``); ``max_actions_per_hour`` (default 2) caps what the policy queues
per run; ``check_steps`` (default 20) is how many steps after the command's step the check waits for;
``worse_by`` (default 0.02) how much higher the mean loss after it may be than before it before the command
is rolled back.

When a replay report stored on an incident says *fp8-caused* (``PUT .../incidents/{id}/replay``), the first
culprit names the layer (``<layer>.<role>`` or ``<layer>``), and one rule picks the change, the first that
applies:

1. ``nonfinite``: the incident's trigger or one of its alerts is a non-finite value -> the layer to high
   precision (``fp8_enabled: false``): a scale cannot bring back a NaN;
2. ``low_sqnr``: the layer's output SQNR in the FP8 replay is below ``SQNR_FLOOR_DB`` -> high precision:
   no scale fixes a precision E4M3 does not have;
3. ``persistent_underflow``: the incident's root cause is an underflow or a collapsed scale -> a shorter
   amax history (a quarter, at least 1), so the scale follows the tensor down sooner;
4. ``stale_scale``: otherwise (an overflow burst, a saturated channel, a jump the history had not seen) ->
   current scaling for that layer under delayed scaling (the scale then follows each tensor's own amax);
   a layer already current-scaled gets one more bit of margin.

Every action is a command like any other (the audit trail of ``/commands``, the markers on the plots), with
``policy:<rule>`` as its author. Once it has been applied at step ``s`` and the run has reached
``s + check_steps``, its check compares the mean loss of steps ``(s, s + check_steps]`` with that of
``[s - check_steps, s)``; after it more than ``worse_by`` higher: a rollback command is queued (author
``policy:rollback``) and the action is ``rolled_back``, else ``kept``. The check runs when telemetry is
stored (``check_actions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from monitor_server.services.commands import CommandError, create_command, effective_recipe
from monitor_server.storage.models import Alert, Command, Incident, PolicyAction, Run
from monitor_server.storage.schemas import CommandCreate, RecipeChanges
from monitor_server.storage.series import read_series

#: an FP8 layer's output SQNR (dB, against high precision) below which its precision, not its scale, is at
#: fault: E4M3's 3 mantissa bits give about 30 dB on well-scaled data
SQNR_FLOOR_DB = 15.0
MODES = ("off", "propose", "act")
ROLES = ("input", "weight", "grad_output")
#: alert kinds that say the scale fell too low (the tensor underflows), not that it overflowed
UNDERFLOW_KINDS = ("underflow", "scale_collapse")


@dataclass(frozen=True)
class RemediationConfig:
    """A run's ``config["remediation"]`` (module docstring); ``mode`` ``"off"`` when it has none."""

    mode: str = "off"
    max_actions_per_hour: int = 2
    check_steps: int = 20
    worse_by: float = 0.02

    @classmethod
    def of(cls, run_config: dict[str, Any] | None) -> RemediationConfig:
        """The run's remediation settings; anything malformed reads as off (the run registered fine)."""
        raw = (run_config or {}).get("remediation")
        if isinstance(raw, str):  # fp8-train's config: the flag's value, the mode alone
            raw = {"mode": raw}
        if not isinstance(raw, dict) or raw.get("mode") not in MODES:
            return cls()
        try:
            return cls(
                mode=raw["mode"],
                max_actions_per_hour=max(0, int(raw.get("max_actions_per_hour", cls.max_actions_per_hour))),
                check_steps=max(1, int(raw.get("check_steps", cls.check_steps))),
                worse_by=max(0.0, float(raw.get("worse_by", cls.worse_by))),
            )
        except (TypeError, ValueError):
            return cls()


@dataclass(frozen=True)
class Proposal:
    """One recipe change a rule proposes: the rule's name, the layer, the changes, and why."""

    rule: str
    target: str
    changes: dict[str, Any]
    reason: str


def culprit_layer(name: str, layers: set[str]) -> str | None:
    """The layer a culprit names (``<layer>.<role>``, the layer itself, or casts of one layer together as
    ``<layer>.input+<layer>.weight``), if it is one of the run's."""
    named = set()
    for part in name.split("+"):
        layer, _, role = part.rpartition(".")
        named.add(part if part in layers else layer if role in ROLES and layer in layers else None)
    return named.pop() if len(named) == 1 and None not in named else None


def first_culprit(report: dict[str, Any], layers: set[str]) -> tuple[str, str] | None:
    """The report's first culprit that names one of the run's layers, and that layer; None if none does."""
    for culprit in report.get("culprits", []):
        layer = culprit_layer(culprit, layers)
        if layer is not None:
            return culprit, layer
    return None


def _sqnr(report: dict[str, Any], layer: str) -> float | None:
    """The layer's output SQNR (dB) in the report's all-FP8 configuration, if it has one."""
    for config in report.get("configs", []):
        if config.get("name") == "fp8" and isinstance(config.get("sqnr_db"), dict):
            value = config["sqnr_db"].get(layer)
            return float(value) if isinstance(value, int | float) else None
    return None


def propose(
    report: dict[str, Any],
    layers: set[str],
    recipe: dict[str, Any],
    alert_kinds: set[str],
    root_kind: str | None,
) -> Proposal | None:
    """The change the rules (module docstring) propose for an *fp8-caused* report, or None.

    Args:
        report: the stored replay report.
        layers: the run's FP8 layers.
        recipe: the culprit layer's recipe in force (``commands.effective_recipe``), with ``scaling``.
        alert_kinds: the kinds of the incident's alerts; root_kind: its root cause's.
    """
    found = first_culprit(report, layers) if report.get("verdict") == "fp8-caused" else None
    if found is None:
        return None
    first, layer = found
    trigger = report.get("trigger") or {}
    sqnr = _sqnr(report, layer)
    if trigger.get("kind") == "nonfinite" or "nonfinite" in alert_kinds:
        why = f"a non-finite value that the replay traced to FP8 in {first}: a scale cannot undo a NaN"
        return Proposal("nonfinite", layer, {"fp8_enabled": False}, why)
    if sqnr is not None and sqnr < SQNR_FLOOR_DB:
        why = f"{layer}'s output SQNR in FP8 is {sqnr:.1f} dB (< {SQNR_FLOOR_DB:g}): E4M3 lacks the precision"
        return Proposal("low_sqnr", layer, {"fp8_enabled": False}, why)
    if root_kind in UNDERFLOW_KINDS and recipe.get("scaling") == "delayed":
        history = int(recipe.get("amax_history_len", 1))
        shorter = max(1, history // 4)
        if shorter < history:
            why = f"{first} underflows under a scale its {history}-step amax history holds up"
            return Proposal("persistent_underflow", layer, {"amax_history_len": shorter}, why)
    if recipe.get("scaling") == "delayed":
        why = f"{first} saturates under a stale delayed scale: current scaling follows each tensor's amax"
        return Proposal("stale_scale", layer, {"scaling": "current"}, why)
    if recipe.get("scaling") == "current":
        margin = int(recipe.get("margin", 0)) + 1
        why = f"{first} saturates under current scaling: one more bit of margin"
        return Proposal("stale_scale", layer, {"margin": margin}, why)
    return None


def _layer_recipe(run: Run, layer: str) -> dict[str, Any]:
    """The layer's recipe in force (its ``scaling`` the run's recipe type unless a command changed it)."""
    eff = effective_recipe(run)
    recipe: dict[str, Any] = eff["layers"].get(layer, eff["model"])
    return recipe


def _already_asked(session: Session, run_id: int, proposal: Proposal, recipe: dict[str, Any]) -> bool:
    """The change is in force for the layer already, or an action of the run proposes or queues the same
    change for it (not applied yet, or applied and not checked yet): a second report of the same fault (the
    job replays each bundle it writes) asks for nothing new."""
    if all(recipe.get(key) == value for key, value in proposal.changes.items()):
        return True
    waiting = session.scalars(
        select(PolicyAction).where(
            PolicyAction.run_id == run_id,
            PolicyAction.target == proposal.target,
            PolicyAction.state.in_(("proposed", "queued")),
        )
    )
    return any(action.changes == proposal.changes for action in waiting)


def _queued_last_hour(session: Session, run_id: int, now: datetime) -> int:
    since = now - timedelta(hours=1)
    return session.execute(
        select(func.count())
        .select_from(PolicyAction)
        .where(
            PolicyAction.run_id == run_id,
            PolicyAction.command_id.is_not(None),
            PolicyAction.created_at >= since,
        )
    ).scalar_one()


def on_replay(
    session: Session, *, run: Run, incident: Incident, report: dict[str, Any], layers: set[str], now: datetime
) -> list[Command]:
    """A replay report was stored on ``incident``: act as the run's policy says. Returns the commands queued
    (to publish); the action is stored either way (proposed, queued or capped)."""
    cfg = RemediationConfig.of(run.config)
    if cfg.mode == "off" or run.status != "running":
        return []
    alerts = session.execute(select(Alert.id, Alert.kind).where(Alert.incident_id == incident.id)).all()
    root_kind = next((kind for aid, kind in alerts if aid == incident.root_alert_id), None)
    found = first_culprit(report, layers)
    if found is None:
        return []
    recipe = _layer_recipe(run, found[1])
    proposal = propose(report, layers, recipe, {k for _, k in alerts}, root_kind)
    if proposal is None or _already_asked(session, run.id, proposal, recipe):
        return []
    action = PolicyAction(
        run_id=run.id,
        incident_id=incident.id,
        rule=proposal.rule,
        target=proposal.target,
        changes=proposal.changes,
        reason=proposal.reason,
        state="proposed",
        created_at=now,
    )
    session.add(action)
    if cfg.mode == "propose":
        session.flush()
        return []
    if _queued_last_hour(session, run.id, now) >= cfg.max_actions_per_hour:
        action.state = "capped"
        session.flush()
        return []
    command = _queue(session, run, action, f"policy:{proposal.rule}", layers)
    return [command] if command is not None else []


def _queue(session: Session, run: Run, action: PolicyAction, who: str, layers: set[str]) -> Command | None:
    body = CommandCreate(target=action.target, changes=RecipeChanges(**action.changes))
    try:
        command = create_command(session, run=run, body=body, created_by=who, layers=layers)
    except CommandError as exc:
        action.state, action.reason = "ended", f"{action.reason} (not queued: {exc.message})"
        session.flush()
        return None
    action.command_id, action.state = command.id, "queued"
    session.flush()
    return command


def apply_proposal(
    session: Session, *, run: Run, action: PolicyAction, who: str, layers: set[str]
) -> Command:
    """A person applies a proposed action (dry-run mode): its command is queued with them as its author,
    and it is checked and rolled back like the policy's own. ``CommandError`` when it is not proposed."""
    if action.state != "proposed":
        raise CommandError(
            409, f"policy action {action.id} is {action.state}: only a proposed one is applied"
        )
    command = _queue(session, run, action, who, layers)
    if command is None:
        raise CommandError(409, action.reason)
    return command


def _mean_loss(session: Session, run_id: int, lo: int, hi: int) -> float | None:
    steps, values = read_series(session, run_id, ["loss"], (lo, hi))["loss"]
    finite = [float(v) for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def check_actions(session: Session, *, run: Run, last_step: int, now: datetime) -> list[Command]:
    """The run's queued actions whose command was applied ``check_steps`` or more steps ago: kept, or rolled
    back (module docstring). Returns the rollback commands queued (to publish)."""
    cfg = RemediationConfig.of(run.config)
    if cfg.mode == "off":  # the common case: no query on the ingest path
        return []
    queued = session.execute(
        select(PolicyAction, Command)
        .join(Command, Command.id == PolicyAction.command_id)
        .where(PolicyAction.run_id == run.id, PolicyAction.state == "queued", Command.state == "applied")
    ).all()
    rollbacks = []
    for action, command in queued:
        s = command.applied_step
        if s is None or last_step < s + cfg.check_steps:
            continue
        before = _mean_loss(session, run.id, s - cfg.check_steps, s - 1)
        after = _mean_loss(session, run.id, s + 1, s + cfg.check_steps)
        action.loss_before, action.loss_after, action.checked_at = before, after, now
        worse = after is None or (before is not None and after > before * (1 + cfg.worse_by))
        if not worse:
            action.state = "kept"
            continue
        try:
            rollback = create_command(
                session,
                run=run,
                body=CommandCreate(rollback=command.id),
                created_by="policy:rollback",
                layers=set(),
            )
        except CommandError:
            action.state = "ended"
            continue
        action.state, action.rollback_id = "rolled_back", rollback.id
        rollbacks.append(rollback)
    session.flush()
    return rollbacks


def run_actions(session: Session, *, run_id: int, incident_id: int | None) -> list[PolicyAction]:
    """The run's policy actions, newest first, of one incident where given."""
    query = select(PolicyAction).where(PolicyAction.run_id == run_id).order_by(PolicyAction.id.desc())
    if incident_id is not None:
        query = query.where(PolicyAction.incident_id == incident_id)
    return list(session.execute(query).scalars())


def action_of_run(session: Session, *, run_id: int, action_id: int) -> PolicyAction | None:
    """One policy action of the run (None: the run has no such action)."""
    action = session.get(PolicyAction, action_id)
    return action if action is not None and action.run_id == run_id else None
