// The run's incidents panel: one entry per incident (alerts that share a cause), newest first, each
// expandable to its alerts root cause first, with acknowledge per incident, per alert and for all at once.
// It renders the page store's incidents and alerts (the store reads them, one request each, and takes the
// live ones; the curves' markers, the post-mortem and the layers' ranking render from the same).
// Under each incident's title: its replay, verdict first (replay.js).

import { api, auth } from "./api.js";
import { badge, el, replace } from "./dom.js";
import { ReplayViews } from "./replay.js";

export const SEVERITY_KIND = { critical: "bad", warning: "warn", info: "info", ok: "ok" };

export class IncidentsPanel {
  /**
   * @param container the panel element
   * @param store the page's RunStore: its `incidents` and `alerts` are what this renders
   * @param focus an incident id to open and scroll to (from #/runs/<id>?incident=<id>), or null
   */
  constructor(container, store, { focus = null } = {}) {
    this.runId = store.runId;
    this.store = store;
    this.container = container;
    this.focus = focus === null || focus === undefined ? null : Number(focus);
    this.alerts = new Map(); // id -> the store's alert (fresher than an incident's copy of it)
    this.expanded = new Set(this.focus === null ? [] : [this.focus]);
    this.replays = new ReplayViews(this.runId, () => this.fill());
    this.ackAll = el("button", { type: "button", id: "ack-all", class: "small" }, "Acknowledge all");
    this.ackAll.addEventListener("click", () => this.acknowledgeAll());
    this.summary = el("span", { class: "muted", id: "incidents-summary" });
    this.note = el("p", { class: "muted readonly-note", id: "alerts-readonly" });
    this.list = el("ul", { id: "incidents-list", class: "incidents" });
    container.append(el("div", { class: "incidents-bar" }, this.summary, el("span", { class: "spacer" }), this.ackAll), this.note, this.list);
  }

  /** Re-read the incidents and alerts into the store (which draws this again), then bring the incident in
   * focus into view. */
  async load() {
    await this.store.loadAlerts();
    if (this.focus !== null) {
      const item = this.list.querySelector(`li.incident[data-incident-id='${this.focus}']`);
      if (item) item.scrollIntoView({ block: "center" });
    }
  }

  /** Open incident `id` (its alerts unfolded, highlighted) and scroll to it; null: to the panel. */
  reveal(id) {
    if (id === null) {
      this.container.scrollIntoView({ block: "start" });
      return;
    }
    this.focus = id;
    this.expanded.add(id);
    this.fill();
    const item = this.list.querySelector(`li.incident[data-incident-id='${id}']`);
    (item || this.container).scrollIntoView({ block: "start" });
  }

  async acknowledgeAll() {
    this.ackAll.disabled = true;
    try {
      await api(`/runs/${this.runId}/incidents/ack`, { method: "POST" });
      await this.load();
    } catch (err) {
      this.ackAll.title = err.message;
      this.fill();
    }
  }

  /** An alert's current state: the alert stream is fresher than an incident's copy of it. */
  state(summary) {
    const full = this.alerts.get(summary.id);
    return full ? full.state : summary.state;
  }

  /** Draw the store's incidents (open first, newest first) and alerts. */
  fill() {
    const reason = auth.readOnlyReason();
    this.note.textContent = reason ? `Acknowledging is disabled (${reason}).` : "";
    const incidents = this.store.get("incidents") || [];
    const alerts = this.store.get("alerts") || [];
    this.alerts = new Map(alerts.map((a) => [a.id, a]));
    const loadError = this.store.error("incidents");
    // alerts stored before incidents existed stand on their own (the store's alerts are newest first)
    const orphans = alerts.filter((a) => a.incident_id === null || a.incident_id === undefined);
    const open = incidents.filter((i) => i.state === "open").length + orphans.filter((a) => a.state === "open").length;
    this.summary.textContent = incidents.length || orphans.length ? `${open} open, ${incidents.length + orphans.length} in all` : "";
    this.ackAll.disabled = Boolean(reason) || open === 0;
    this.ackAll.title = reason || (open ? "acknowledge every open incident and alert of this run" : "nothing open");
    const failed = loadError ? el("li", { class: "error", id: "incidents-error" }, `Could not load the incidents: ${loadError.message}`) : null;
    if (!incidents.length && !orphans.length) {
      replace(this.list, failed || el("li", { class: "muted" }, "No incidents."));
    } else {
      replace(this.list, failed, incidents.map((i) => this.incidentItem(i, reason)), orphans.map((a) => el("li", { class: "incident orphan" }, el("ul", { class: "alerts" }, this.alertItem(a, reason, false)))));
    }
  }

  incidentItem(i, reason) {
    const ack = el("button", { type: "button", class: "small ack-incident", disabled: i.state !== "open" || Boolean(reason), title: reason || "acknowledge this incident and its alerts" }, i.state === "open" ? "Acknowledge" : "Acknowledged");
    ack.addEventListener("click", async () => {
      ack.disabled = true;
      try {
        this.store.upsertIncident(await api(`/runs/${this.runId}/incidents/${i.id}/ack`, { method: "POST" }));
        await this.load(); // its alerts changed too
      } catch (err) {
        ack.disabled = false;
        ack.title = err.message;
      }
    });
    const details = el(
      "details",
      { class: "incident-alerts", open: this.expanded.has(i.id) },
      el("summary", {}, `${i.alert_count} alert${i.alert_count === 1 ? "" : "s"}, root cause first${i.tensors.length > 1 ? ` · ${i.tensors.length} tensors` : ""}`),
      el("ul", { class: "alerts" }, i.alerts.map((a, k) => this.alertItem(a, reason, k === 0))),
    );
    details.addEventListener("toggle", () => (details.open ? this.expanded.add(i.id) : this.expanded.delete(i.id)));
    return el(
      "li",
      { class: `incident ${i.state}${i.id === this.focus ? " focus" : ""}`, dataset: { incidentId: i.id, state: i.state } },
      el("div", { class: "alert-head" }, badge(i.severity, SEVERITY_KIND[i.severity] || ""), el("b", { class: "incident-title" }, i.title),
        el("span", { class: "muted" }, ` · steps ${i.first_step}–${i.last_step}`), el("span", { class: "spacer" }), ack),
      this.replays.view(i),
      i.state === "acknowledged" ? el("div", { class: "muted" }, `acknowledged by ${i.acknowledged_by || "?"}`) : null,
      details,
    );
  }

  alertItem(a, reason, root) {
    const state = this.state(a);
    const ack = el("button", { type: "button", class: "small ack", disabled: state !== "open" || Boolean(reason), title: reason || "acknowledge this alert" }, state === "open" ? "Acknowledge" : "Acknowledged");
    ack.addEventListener("click", async () => {
      ack.disabled = true;
      try {
        this.store.upsertAlert(await api(`/runs/${this.runId}/alerts/${a.id}/ack`, { method: "POST" }));
      } catch (err) {
        ack.disabled = false;
        ack.title = err.message;
      }
    });
    const where = a.tensor_name ? el("span", { class: "name" }, a.tensor_name) : el("span", { class: "muted" }, "run");
    const full = this.alerts.get(a.id);
    return el(
      "li",
      { class: `alert ${state}${root ? " root" : ""}`, dataset: { alertId: a.id, state } },
      el("div", { class: "alert-head" }, root ? badge("root cause", "bad") : null, badge(a.severity, SEVERITY_KIND[a.severity] || ""), el("b", {}, a.kind), " · ", where,
        el("span", { class: "muted" }, ` · step ${a.onset_step ?? a.first_step}${a.last_step !== a.first_step ? `–${a.last_step}` : ""} · ${a.count}×`), el("span", { class: "spacer" }), ack),
      el("div", { class: "alert-msg" }, a.message),
      state === "acknowledged" && full ? el("div", { class: "muted" }, `acknowledged by ${full.acknowledged_by || "?"}`) : null,
    );
  }
}
