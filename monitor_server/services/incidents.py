"""Incidents: the alerts that share a cause, grouped as they are stored, root cause first.

One fault rarely raises one alert. A NaN in one activation reaches every tensor downstream in the same
step and every weight in the next; a weight scaled x1e4 saturates itself and the layer after it, collapses
its scale and then underflows; an lr spike saturates the weights and spikes the loss. The detectors report
each tensor's condition (that is what a post-mortem needs); a person needs one notification naming the
first tensor that went wrong.

Rule: a new alert joins the run's open incident whose steps it falls within `window` steps of
(``first_step - window <= onset <= last_step + window``, the most recent such incident), else it opens a
new one. New alerts of a batch are taken in *order* — by onset step, then the forward-then-backward position
of their tensor (the loss sits between the forward and the backward tensors; run-level alerts such as
`stalled` come last), then kind (non-finite first) — so the first of them is the incident's root cause; a
later alert that sorts before it (an overflow episode whose rule waited three steps) takes its place. An
updated alert keeps its incident and extends its `last_step`. Acknowledging an incident acknowledges its
alerts; acknowledging its last open alert acknowledges the incident.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from fp8_protocol.tensors import TensorInfo
from monitor_server.detectors.nonfinite import forward_backward_order
from monitor_server.detectors.types import SEVERITIES
from monitor_server.storage.models import Alert, Incident, as_utc
from monitor_server.storage.run_meta import RunMeta

#: at the same step and position, the kind more likely to be the cause first
KIND_RANK = {
    "nonfinite": 0,
    "overflow_burst": 1,
    "scale_collapse": 2,
    "amax_divergence": 3,
    "rank_divergence": 4,
    "sqnr_drop": 5,
    "loss_spike": 6,
    "underflow_excess": 7,
    "stalled": 8,
}
KIND_LABEL = {
    "nonfinite": "non-finite values",
    "overflow_burst": "saturation",
    "scale_collapse": "scale collapse",
    "amax_divergence": "amax divergence",
    "rank_divergence": "rank divergence",
    "sqnr_drop": "SQNR drop",
    "loss_spike": "loss spike",
    "underflow_excess": "excess underflow",
    "stalled": "run stalled",
}
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def worse(a: str, b: str) -> str:
    """The worse of two severities."""
    return a if SEVERITY_RANK.get(a, 0) >= SEVERITY_RANK.get(b, 0) else b


@dataclass(frozen=True)
class TensorOrder:
    """Positions of a run's tensors in forward-then-backward order; the loss sits between the forward
    tensors (inputs, weights) and the backward ones (grad_output), as it is computed between the passes."""

    rank: np.ndarray  # (T,) position of tensor index i
    loss_position: float

    @classmethod
    def of(cls, meta: RunMeta | None) -> TensorOrder:
        tensors = list(meta.tensors) if meta is not None else []
        order = forward_backward_order(tensors) if tensors else np.zeros(0, dtype=np.int64)
        rank = np.empty(len(tensors), dtype=np.int64)
        rank[order] = np.arange(len(tensors))
        n_forward = sum(1 for t in tensors if t.role != "grad_output")
        return cls(rank, n_forward - 0.5)

    def position(self, kind: str, tensor_index: int | None) -> float:
        """Where an alert sits in the step: its tensor's position, the loss's for loss-level alerts."""
        if tensor_index is not None and 0 <= tensor_index < len(self.rank):
            return float(self.rank[tensor_index])
        if kind in ("loss_spike", "nonfinite"):
            return self.loss_position
        return math.inf


def onset_of(alert: Alert) -> int:
    """The step an alert's condition began."""
    return alert.onset_step if alert.onset_step is not None else alert.first_step


def order_key(alert: Alert, order: TensorOrder) -> tuple[float, float, int, int]:
    """Root-cause order: onset step, forward-then-backward position, kind, then age."""
    return (
        float(onset_of(alert)),
        order.position(alert.kind, alert.tensor_index),
        KIND_RANK.get(alert.kind, len(KIND_RANK)),
        alert.id or 0,
    )


def assign_incidents(
    session: Session,
    *,
    run_id: int,
    touched: list[tuple[Alert, bool]],
    order: TensorOrder,
    window: int,
    now: datetime,
) -> list[Incident]:
    """Put new alerts (and alerts stored before incidents existed) into incidents and bring the incidents
    of updated alerts up to date (steps, severity, count, root). Returns the incidents touched, in the order
    they were first touched. The alerts must have ids (flushed)."""
    if not touched:
        return []
    open_incidents = list(
        session.scalars(select(Incident).where(Incident.run_id == run_id, Incident.state == "open"))
    )
    by_id = {inc.id: inc for inc in open_incidents}
    changed: dict[int, Incident] = {}
    unplaced = sorted(
        (a for a, is_new in touched if is_new or a.incident_id not in by_id),
        key=lambda a: order_key(a, order),
    )
    for alert in unplaced:
        onset = onset_of(alert)
        near = [i for i in open_incidents if i.first_step - window <= onset <= i.last_step + window]
        incident = max(near, key=lambda i: (i.last_step, i.id), default=None)
        if incident is None:
            incident = Incident(
                run_id=run_id,
                state="open",
                severity=alert.severity,
                root_alert_id=alert.id,
                first_step=onset,
                last_step=alert.last_step,
                alert_count=0,
                created_at=now,
                updated_at=now,
            )
            session.add(incident)
            session.flush()
            open_incidents.append(incident)
            by_id[incident.id] = incident
        elif incident.root_alert_id is None or order_key(alert, order) < _root_key(session, incident, order):
            incident.root_alert_id = alert.id
        alert.incident_id = incident.id
        incident.alert_count += 1
        incident.first_step = min(incident.first_step, onset)
        changed.setdefault(incident.id, incident)
    for alert, _ in touched:
        incident = by_id.get(alert.incident_id) if alert.incident_id is not None else None
        if incident is None:
            continue
        incident.last_step = max(incident.last_step, alert.last_step)
        incident.severity = worse(incident.severity, alert.severity)
        incident.updated_at = now
        changed.setdefault(incident.id, incident)
    session.flush()
    return list(changed.values())


def _root_key(session: Session, incident: Incident, order: TensorOrder) -> tuple[float, ...]:
    root = session.get(Alert, incident.root_alert_id)
    return order_key(root, order) if root is not None else (math.inf,)


def alerts_by_incident(session: Session, incident_ids: Iterable[int]) -> dict[int, list[Alert]]:
    """The alerts of each incident (unsorted)."""
    ids = list(incident_ids)
    out: dict[int, list[Alert]] = {i: [] for i in ids}
    if ids:
        for alert in session.scalars(select(Alert).where(Alert.incident_id.in_(ids))):
            if alert.incident_id is not None:  # it is: selected by it
                out[alert.incident_id].append(alert)
    return out


def alert_tensor(alert: Alert, meta: RunMeta | None) -> TensorInfo | None:
    """The run's tensor record an alert is about, or None (a run-level alert, or unknown metadata)."""
    if meta is not None and alert.tensor_index is not None and 0 <= alert.tensor_index < meta.num_tensors:
        return meta.tensors[alert.tensor_index]
    return None


def alert_summary(alert: Alert, meta: RunMeta | None) -> dict[str, Any]:
    """An alert within an incident: what the dashboard's list needs, without the evidence."""
    tensor = alert_tensor(alert, meta)
    return {
        "id": alert.id,
        "kind": alert.kind,
        "tensor_index": alert.tensor_index,
        "tensor_name": tensor.name if tensor else None,
        "layer": tensor.layer if tensor else None,
        "state": alert.state,
        "severity": alert.severity,
        "message": alert.message,
        "onset_step": onset_of(alert),
        "first_step": alert.first_step,
        "last_step": alert.last_step,
        "count": alert.count,
    }


def run_link(public_url: str, run_id: int, incident_id: int | None = None) -> str | None:
    """The dashboard's page of a run (and incident) under the configured public URL; None without one."""
    if not public_url:
        return None
    link = f"{public_url.rstrip('/')}/#/runs/{run_id}"
    return f"{link}?incident={incident_id}" if incident_id is not None else link


def incident_public(
    incident: Incident, alerts: list[Alert], meta: RunMeta | None, order: TensorOrder, public_url: str = ""
) -> dict[str, Any]:
    """An incident as the API returns it: its alerts root cause first, the tensors affected in that order,
    a one-line title and the dashboard link."""
    ordered = sorted(alerts, key=lambda a: order_key(a, order))
    summaries = [alert_summary(a, meta) for a in ordered]
    root = summaries[0] if summaries else None
    tensors = list(dict.fromkeys(s["tensor_name"] for s in summaries if s["tensor_name"]))
    layers = list(dict.fromkeys(s["layer"] for s in summaries if s["layer"]))
    return {
        "id": incident.id,
        "run_id": incident.run_id,
        "state": incident.state,
        "severity": incident.severity,
        "kind": root["kind"] if root else None,
        "title": title(root, len(tensors)),
        "root_alert_id": root["id"] if root else incident.root_alert_id,
        "root": root,
        "first_step": incident.first_step,
        "last_step": incident.last_step,
        "alert_count": len(summaries),
        "open_alerts": sum(1 for s in summaries if s["state"] == "open"),
        "tensors": tensors,
        "layers": layers,
        "created_at": as_utc(incident.created_at),
        "updated_at": as_utc(incident.updated_at),
        "notified_at": as_utc(incident.notified_at),
        "acknowledged_at": as_utc(incident.acknowledged_at),
        "acknowledged_by": incident.acknowledged_by,
        "url": run_link(public_url, incident.run_id, incident.id),
        "alerts": summaries,
    }


def title(root: dict[str, Any] | None, n_tensors: int) -> str:
    """``"non-finite values in blocks.1.mlp.fc.input at step 40 (27 tensors affected)"``."""
    if root is None:
        return "incident without alerts"
    label = KIND_LABEL.get(root["kind"], root["kind"])
    if root["tensor_name"]:
        where = f" in {root['tensor_name']}"
    elif root["kind"] == "nonfinite":  # a loss spike is the loss's by name ("loss spike in the loss")
        where = " in the loss"
    else:
        where = ""
    more = f" ({n_tensors} tensors affected)" if n_tensors > 1 else ""
    return f"{label}{where} at step {root['onset_step']}{more}"


def mark_acknowledged(row: Incident | Alert, *, who: str, now: datetime) -> None:
    """Acknowledge one incident or alert (`who` at `now`): both keep the same acknowledgement record, and
    the change counts as an update (lists order by it, the stream shows it)."""
    row.state = "acknowledged"
    row.acknowledged_at = now
    row.acknowledged_by = who
    row.updated_at = now


def acknowledge(
    session: Session, *, run_id: int, incident_ids: list[int] | None, who: str, now: datetime
) -> tuple[list[Incident], list[Alert]]:
    """Acknowledge open incidents (all of the run's when `incident_ids` is None) and their open alerts;
    with None also the run's open alerts that belong to no incident. Returns what changed."""
    query = select(Incident).where(Incident.run_id == run_id, Incident.state == "open")
    if incident_ids is not None:
        query = query.where(Incident.id.in_(incident_ids))
    incidents = list(session.scalars(query))
    ids = [i.id for i in incidents]
    alerts_q = select(Alert).where(Alert.run_id == run_id, Alert.state == "open")
    if incident_ids is not None:
        alerts_q = alerts_q.where(Alert.incident_id.in_(ids or [-1]))
    alerts = list(session.scalars(alerts_q))
    rows: list[Incident | Alert] = [*incidents, *alerts]
    for row in rows:
        mark_acknowledged(row, who=who, now=now)
    session.flush()
    return incidents, alerts


def settle_incident(session: Session, *, incident_id: int | None, who: str, now: datetime) -> Incident | None:
    """After one of its alerts was acknowledged: acknowledge the incident once none of its alerts is open.
    Returns the incident (changed or not), None when the alert had none."""
    if incident_id is None:
        return None
    incident = session.get(Incident, incident_id)
    if incident is None or incident.state != "open":
        return incident
    still_open = session.scalar(
        select(Alert.id).where(Alert.incident_id == incident_id, Alert.state == "open").limit(1)
    )
    if still_open is None:
        mark_acknowledged(incident, who=who, now=now)
    else:
        incident.updated_at = now
    session.flush()
    return incident


def run_incidents(session: Session, *, run_id: int, state: str | None, limit: int) -> list[Incident]:
    """The run's incidents, newest first, of `state` where given; at most `limit`."""
    query = select(Incident).where(Incident.run_id == run_id).order_by(Incident.id.desc()).limit(limit)
    if state is not None:
        query = query.where(Incident.state == state)
    return list(session.scalars(query))


def incident_of_run(session: Session, *, run_id: int, incident_id: int) -> Incident | None:
    """One incident of the run (None: the run has no such incident)."""
    incident = session.get(Incident, incident_id)
    return incident if incident is not None and incident.run_id == run_id else None


def incidents_by_id(session: Session, ids: Iterable[int]) -> list[Incident]:
    """The incidents of `ids` (those that exist)."""
    return list(session.scalars(select(Incident).where(Incident.id.in_(list(ids)))))


def incident_alerts(session: Session, *, incident_id: int, order: TensorOrder) -> list[Alert]:
    """An incident's alerts, root cause first (`order_key`)."""
    alerts = session.scalars(select(Alert).where(Alert.incident_id == incident_id))
    return sorted(alerts, key=lambda a: order_key(a, order))
