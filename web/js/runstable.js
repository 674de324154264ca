// The runs list's table: a row per run (name, source, notes, status, tags, the chosen config columns,
// created, duration, last step and loss, open incidents, the loss sparkline, last telemetry, and rename /
// tags / delete for the control scope), headers that sort, and the runs picked for a comparison. It renders
// the runs the view hands it, in the order given, and reads the sort and the config columns from the page's
// store.

import { api, auth, num } from "./api.js";
import { configText, configValue, parseTags } from "./config.js";
import { ago, badge, el, fmt, replace, sourceBadge, statusBadge, throttle } from "./dom.js";
import { shortNotes } from "./notes.js";
import { dateTime, durationSeconds, durationText, sparkline } from "./runcells.js";

export const MAX_COMPARE = 8;

/** The columns the service sorts by (GET /runs?sort=), by header; a config column sorts as "config:<key>". */
const SORTS = { Run: "name", Status: "status", Created: "created", Duration: "duration", "Last step": "last_step",
  "Last loss": "last_loss", "Open incidents": "open_incidents", "Last telemetry": "last_telemetry" };

/** The text of a failed request: the service's detail where it gave one. */
export const failure = (err) => err.detail || err.message;

export class RunsTable {
  /** `store`: the page's store (`sort`, `columns`); `on.sort(key)`: a header clicked; `on.picked(picked)`:
   * the runs picked for a comparison changed. */
  constructor(store, on) {
    this.store = store;
    this.on = on;
    this.rows = new Map(); // run id -> {run, read, tr, cells, check, notes, actions, refreshSpark}
    // Reads of runs are numbered as they start: a row shows the answer of the latest read that started, so
    // a list read still in flight when a run was renamed does not put the old name back when it lands.
    this.reads = 0;
    this.deleted = new Map(); // run id -> the first read that cannot have seen it (a list older keeps it out)
    this.picked = new Set();
    this.tbody = el("tbody");
    this.thead = el("thead");
    this.error = el("p", { class: "error", id: "runs-error" });
    this.empty = el("p", { class: "muted", id: "runs-empty", hidden: true }, "No runs yet. Start a training job with --monitor-url.");
    this.node = el("div", { class: "table-scroll" }, el("table", { class: "runs", id: "runs-table" }, this.thead, this.tbody));
  }

  /** A header cell; a sortable one sorts the list by its column on a click (again: the other way round). */
  headCell(label, key, cls = "") {
    if (!key) return el("th", { class: cls }, label);
    const sort = this.store.get("sort");
    const on = sort === key || sort === `-${key}`;
    const descending = sort === `-${key}`;
    return el("th", { class: `${cls} sortable`.trim(), dataset: { sort: key }, "aria-sort": on ? (descending ? "descending" : "ascending") : "none",
      title: `sort by ${label}${on && !descending ? ", descending" : ""}`, onclick: () => this.on.sort(on && !descending ? `-${key}` : key) },
    label, on ? el("span", { class: "sort-mark" }, descending ? " ▼" : " ▲") : null);
  }

  renderHead() {
    const head = (label, key, cls) => this.headCell(label, key, cls);
    replace(this.thead, el("tr", {},
      head(""), head("Run", SORTS.Run), head("Status", SORTS.Status), head("Tags"),
      this.store.get("columns").map((c) => head(c, `config:${c}`, "config-col name")),
      ["Created", "Duration", "Last step", "Last loss", "Open incidents"].map((h) => head(h, SORTS[h])),
      head("Loss"), head("Last telemetry", SORTS["Last telemetry"]), head("")));
  }

  pick(id, on) {
    if (on) this.picked.add(id);
    else this.picked.delete(id);
    while (this.picked.size > MAX_COMPARE) this.picked.delete(this.picked.values().next().value);
    for (const [rid, row] of this.rows) row.check.checked = this.picked.has(rid);
    this.on.picked(this.picked);
  }

  /** The chosen config keys' cells, between the tags and the created date. */
  renderConfigCells(row) {
    for (const td of row.tr.querySelectorAll("td.config-value")) td.remove();
    for (const c of this.store.get("columns")) {
      row.tr.insertBefore(el("td", { class: "name config-value", dataset: { key: c } }, configText(configValue(row.run.config, c))), row.cells.created);
    }
  }

  /** Row `row`'s cells from its run. */
  fill(row) {
    const r = row.run;
    row.cells.name.firstChild.textContent = r.name;
    row.notes.textContent = shortNotes(r.notes);
    row.notes.title = (r.notes || "").slice(0, 2000);
    row.notes.hidden = !r.notes;
    row.cells.created.textContent = dateTime(r.created_at);
    row.cells.created.title = r.created_at;
    row.cells.duration.textContent = durationText(durationSeconds(r));
    replace(row.cells.status, statusBadge(r.status, r.last_loss)); // a run ended on a NaN loss is not green
    replace(row.cells.tags, (r.tags || []).map((t) => el("a", { class: "tag", href: `#/?tag=${encodeURIComponent(t)}`, title: "runs with this tag" }, t)));
    this.renderConfigCells(row);
    row.cells.step.textContent = r.last_step === null ? "–" : String(r.last_step);
    row.cells.loss.textContent = fmt(num(r.last_loss));
    // one entry per fault: incidents (alerts stored before incidents existed count on their own)
    const open = r.open_incidents || 0;
    row.cells.alerts.title = `${r.open_alerts} open alert${r.open_alerts === 1 ? "" : "s"}`;
    replace(row.cells.alerts, open ? badge(String(open), "bad") : r.open_alerts ? badge(`${r.open_alerts} alerts`, "warn") : "0");
    row.cells.seen.textContent = ago(r.last_telemetry_at);
    const reason = auth.readOnlyReason();
    for (const b of row.actions) {
      b.disabled = Boolean(reason);
      b.title = reason || b.dataset.help;
    }
  }

  /** Every row again (the token's scopes changed). */
  fillAll() {
    for (const row of this.rows.values()) this.fill(row);
  }

  /** The "last telemetry" column again (it reads "12 s ago"). */
  tick() {
    for (const row of this.rows.values()) row.cells.seen.textContent = ago(row.run.last_telemetry_at);
  }

  /** Ask for the run's new name or tags, or confirm its deletion, and send it. */
  async act(row, what) {
    const r = row.run;
    this.error.textContent = "";
    try {
      let change;
      if (what === "rename") {
        const name = window.prompt(`New name of run #${r.id}`, r.name);
        if (name === null || !name.trim() || name.trim() === r.name) return;
        change = { name: name.trim() };
      } else if (what === "tags") {
        const text = window.prompt(`Tags of run #${r.id} (space-separated)`, (r.tags || []).join(" "));
        if (text === null) return;
        const parsed = parseTags(text);
        if (parsed.error) {
          this.error.textContent = parsed.error;
          return;
        }
        change = { tags: parsed.tags };
      } else if (what === "delete") {
        if (!window.confirm(`Delete run #${r.id} "${r.name}" and all its telemetry? This cannot be undone.`)) return;
        const read = this.startRead();
        await api(`/runs/${r.id}`, { method: "DELETE" });
        this.picked.delete(r.id);
        this.remove(r.id, read);
        return;
      }
      const read = this.startRead();
      this.update(row, await api(`/runs/${r.id}`, { method: "PATCH", body: change }), read);
    } catch (err) {
      this.error.textContent = `${what} failed: ${failure(err)}`;
    }
  }

  /** The number of a read of runs about to start (for `update`, `place` and `remove`). */
  startRead() {
    return ++this.reads;
  }

  /** Row `row` shows `run`, the answer of read number `read`, unless a read that started later has
   * answered already (then the row has newer facts); says whether it did. */
  update(row, run, read) {
    if (read < row.read) return false;
    row.run = run;
    row.read = read;
    this.fill(row);
    return true;
  }

  /** Take run `id`'s row out of the table: deleted, as read `read` knows (a list read that started before
   * it does not bring the row back). */
  remove(id, read) {
    this.deleted.set(id, read);
    const row = this.rows.get(id);
    if (!row) return;
    row.tr.remove();
    this.rows.delete(id);
    this.empty.hidden = this.rows.size > 0;
  }

  addRow(run, read) {
    const check = el("input", { type: "checkbox", title: `pick for comparison (up to ${MAX_COMPARE})`, onchange: (ev) => this.pick(run.id, ev.target.checked) });
    const notes = el("div", { class: "run-notes-short" });
    const cells = {
      name: el("td", { class: "name" }, el("a", { href: `#/runs/${run.id}` }, run.name), " ", sourceBadge(run), notes),
      status: el("td"),
      tags: el("td", { class: "tags-cell" }),
      created: el("td", { class: "created" }),
      duration: el("td", { class: "num duration" }),
      step: el("td", { class: "num step" }),
      loss: el("td", { class: "num loss" }),
      alerts: el("td", { class: "num alerts" }),
      spark: el("td", { class: "spark" }),
      seen: el("td", { class: "muted" }),
    };
    const row = { run, read, cells, check, notes };
    const action = (what, label, help) => el("button", { type: "button", class: `small run-${what}`, dataset: { help }, onclick: () => this.act(row, what) }, label);
    row.actions = [action("rename", "Rename", "rename this run"), action("tags", "Tags", "edit this run's tags"), action("delete", "Delete", "delete this run and its telemetry")];
    row.tr = el("tr", { dataset: { runId: run.id } }, el("td", {}, check), cells.name, cells.status, cells.tags, cells.created, cells.duration, cells.step, cells.loss, cells.alerts, cells.spark, cells.seen, el("td", { class: "actions" }, row.actions));
    this.fill(row);
    row.refreshSpark = throttle(() => this.loadSpark(row), 2000);
    this.rows.set(run.id, row);
    this.loadSpark(row);
    return row;
  }

  async loadSpark(row) {
    if (row.run.last_step === null) return;
    try {
      const s = await api(`/runs/${row.run.id}/series?name=loss&max_points=120`);
      replace(row.cells.spark, sparkline(s.steps, s.values.map(num)));
    } catch (err) {
      console.warn("sparkline", err);
    }
  }

  /** Show `runs`, the answer of list read number `read`, in the order given (after the rows shown, with
   * `append`): known runs' rows are refilled (their sparkline re-read when they stepped) unless a later read
   * answered for them, new ones added, and rows of runs not listed dropped. */
  place(runs, append, read) {
    const order = append ? [...this.tbody.children] : [];
    const keep = new Set(append ? this.rows.keys() : []);
    for (const run of runs) {
      if (read < (this.deleted.get(run.id) ?? 0)) continue;
      let row = this.rows.get(run.id);
      if (row) {
        const moved = row.run.last_step !== run.last_step;
        if (this.update(row, run, read) && moved) row.refreshSpark();
      } else {
        row = this.addRow(run, read);
      }
      keep.add(run.id);
      order.push(row.tr);
    }
    for (const id of [...this.rows.keys()]) if (!keep.has(id)) this.rows.delete(id);
    replace(this.tbody, order); // in the order the API answers (newest first, or the sort's)
    this.empty.hidden = this.rows.size > 0;
  }

  /** The runs listed, in their order. */
  listed() {
    return [...this.tbody.children].map((tr) => this.rows.get(Number(tr.dataset.runId))?.run).filter(Boolean);
  }
}
