// The runs list: newest first, or sorted by the service by any column (a click on its header; again: the other
// way), with status, tags, notes, chosen config values, created, duration, last step, last loss, open
// incidents and a loss sparkline; kept live by the all-runs event stream. Search by name, filters (status,
// tag, config value), a page at a time; the filters, the sort and the grouping are kept in the page's address;
// rename, retag and delete (control scope); up to 8 runs picked for a comparison; grouped by a config value,
// each group's mean loss with its band (groups.js).
//
// The view creates the page's store (the sort and the config columns), the filters and the table
// (runstable.js), and wires them: a filter, a sort or the stream reloads the list, which the table renders.

import { api, auth, qs, subscribe } from "./api.js";
import { el, replace, throttle } from "./dom.js";
import { mountGroups } from "./groups.js";
import { noteStepSeen } from "./hooks.js";
import { RunsTable, failure } from "./runstable.js";
import { Store } from "./store.js";

const PAGE = 100;
const COLUMNS_KEY = "fp8scope.runColumns";
const STATUSES = ["", "running", "finished", "interrupted", "halted", "crashed"];

/** Filters, sort and grouping from the page's hash (#/?q=..&status=..&tag=..&config=k=v&sort=-name&group=lr):
 * links to a filtered, sorted or grouped list work. */
function filtersFromHash() {
  const query = (location.hash.split("?")[1] || "");
  const p = new URLSearchParams(query);
  const get = (k) => p.get(k) || "";
  return { q: get("q"), status: get("status"), tag: get("tag"), config: get("config"), sort: get("sort"), group: get("group") };
}

/** The config columns this browser was last asked for. */
function storedColumns() {
  return (localStorage.getItem(COLUMNS_KEY) || "").split(",").map((c) => c.trim()).filter(Boolean);
}

/** The filter inputs, filled from the address (and the columns from this browser's choice). */
function filterControls(filters, columns) {
  return {
    search: el("input", { id: "runs-search", type: "search", placeholder: "search names", value: filters.q, size: 18, "aria-label": "search run names" }),
    status: el("select", { id: "runs-status", "aria-label": "status" },
      STATUSES.map((st) => el("option", { value: st, selected: st === filters.status }, st || "any status"))),
    tag: el("input", { id: "runs-tag", type: "search", placeholder: "tag", value: filters.tag, size: 12, "aria-label": "tag" }),
    config: el("input", { id: "runs-config", type: "search", placeholder: "config key=value", value: filters.config, size: 18, "aria-label": "config filter" }),
    columns: el("input", { id: "runs-columns", type: "text", placeholder: "config columns, e.g. lr, model.n_layer", value: columns.join(", "), size: 30, "aria-label": "config columns" }),
    group: el("input", { id: "runs-group", type: "search", placeholder: "config key, e.g. lr", value: filters.group, size: 14, "aria-label": "group by config key" }),
  };
}

class RunsPage {
  constructor(container) {
    const filters = filtersFromHash();
    // "" (newest first), "<column>" or "-<column>" (descending); the config keys shown as columns
    this.store = new Store({ sort: filters.sort, columns: storedColumns() });
    this.next = null; // cursor of the next page
    this.shown = 1; // pages shown
    this.inputs = filterControls(filters, this.store.get("columns"));
    this.table = new RunsTable(this.store, { sort: (key) => this.setSort(key), picked: (picked) => this.showPicked(picked) });
    this.compareButton = el("button", { type: "button", id: "compare-selected", disabled: true }, "Compare selected");
    this.more = el("button", { type: "button", id: "runs-more", class: "small", hidden: true }, "Load more");
    this.readonly = el("p", { class: "muted readonly-note", id: "runs-readonly" });
    const groupsHost = el("div", { id: "runs-groups" });
    const { search, status, tag, config, columns, group } = this.inputs;
    replace(
      container,
      el("section", { class: "panel" },
        el("div", { class: "panel-head" }, el("h2", {}, "Runs"), this.compareButton),
        el("div", { class: "controls", id: "runs-filters" }, search, status, tag, config, el("label", { class: "muted" }, "columns ", columns),
          el("label", { class: "muted" }, "group by ", group)),
        this.readonly, this.table.error, this.table.node, this.table.empty, this.more),
      groupsHost,
    );
    this.groups = mountGroups(groupsHost);
    this.refreshers = new Map(); // run id -> its throttled re-read
    this.listRead = 0; // the number of the latest list read started (see RunsTable.startRead)
    this.reload = throttle(() => this.load().catch((err) => {
      this.table.error.textContent = `could not list runs: ${failure(err)}`;
    }), 300);
    this.reloadSorted = throttle(() => this.reload(), 3000);
    this.onAuth = () => {
      this.readonly.textContent = auth.readOnlyReason() ? `Rename, tags and delete are disabled (${auth.readOnlyReason()}).` : "";
      this.table.fillAll();
    };
    this.wire();
  }

  /** The filters' text (null where empty), as the address and the list request spell them. */
  filterParams() {
    const { search, status, tag, config } = this.inputs;
    return { q: search.value.trim() || null, status: status.value || null, tag: tag.value.trim() || null, config: config.value.trim() || null };
  }

  filtering() {
    return Object.values(this.filterParams()).some(Boolean);
  }

  groupKey() {
    return this.inputs.group.value.trim();
  }

  /** The filters, sort and grouping into the page's address (no reload: a link to it shows this list). */
  keepInAddress() {
    const params = { ...this.filterParams(), sort: this.store.get("sort") || null, group: this.groupKey() || null };
    history.replaceState(null, "", `#/${qs(params)}`);
  }

  setSort(sort) {
    this.store.set("sort", sort);
    this.shown = 1;
    this.table.renderHead();
    this.keepInAddress();
    this.reload();
  }

  showPicked(picked) {
    this.compareButton.disabled = picked.size < 2;
    this.compareButton.textContent = picked.size >= 2 ? `Compare ${picked.size} runs` : "Compare selected";
  }

  /** Sorted by what telemetry changes: the order is read again as steps arrive. */
  liveSort() {
    return ["last_step", "last_loss", "duration", "last_telemetry"].includes(this.store.get("sort").replace(/^-/, ""));
  }

  query(cursor) {
    // the list carries only the config keys shown (the source badge, the columns) or grouped by; a run's
    // page has them all
    const keys = [...new Set(["fp8_source", ...this.store.get("columns"), this.groupKey()].filter(Boolean))].join(",");
    const params = { limit: PAGE, ...this.filterParams(), sort: this.store.get("sort") || null, cursor, config_keys: keys || null };
    return `/runs${qs(params)}`;
  }

  /** The first `shown` pages again (filters changed, or a run appeared). */
  async load() {
    const read = this.table.startRead();
    this.listRead = read;
    const runs = [];
    let cursor = null;
    for (let p = 0; p < this.shown; p++) {
      const page = await api(this.query(cursor), { page: true });
      runs.push(...page.data);
      cursor = page.next;
      if (!cursor) break;
    }
    if (read < this.listRead) return; // a later list read answers (or has answered) instead
    this.next = cursor;
    this.table.error.textContent = "";
    this.place(runs, false, read);
  }

  async loadMore() {
    try {
      const read = this.table.startRead();
      const page = await api(this.query(this.next), { page: true });
      if (read < this.listRead) return; // the list was read again meanwhile: this page may not follow it
      this.next = page.next;
      this.shown += 1;
      this.place(page.data, true, read);
    } catch (err) {
      this.table.error.textContent = `loading more runs failed: ${failure(err)}`;
    }
  }

  place(runs, append, read) {
    this.table.place(runs, append, read);
    this.more.hidden = !this.next;
    this.table.empty.textContent = this.filtering() ? "No run matches these filters." : "No runs yet. Start a training job with --monitor-url.";
    this.regroup();
  }

  /** The group view of the runs listed (hidden without a group key). */
  regroup() {
    this.groups.update(this.groupKey(), this.table.listed());
  }

  /** New config columns: kept in this browser; the list carries only the config keys asked for, so the new
   * columns' values come with the next load, which fills every row's cells (head and cells change together). */
  setColumns() {
    const columns = this.inputs.columns.value.split(",").map((c) => c.trim()).filter(Boolean);
    this.store.set("columns", columns);
    localStorage.setItem(COLUMNS_KEY, columns.join(","));
    const sort = this.store.get("sort");
    if (sort.replace(/^-/, "").startsWith("config:") && !columns.includes(sort.replace(/^-?config:/, ""))) this.setSort("");
    this.load().then(() => this.table.renderHead(), (err) => {
      this.table.error.textContent = `could not list runs: ${failure(err)}`;
    });
  }

  wire() {
    const { search, status, tag, config, columns, group } = this.inputs;
    this.compareButton.addEventListener("click", () => {
      location.hash = `#/compare?runs=${[...this.table.picked].join(",")}`;
    });
    this.more.addEventListener("click", () => this.loadMore());
    const refilter = () => {
      this.shown = 1;
      this.keepInAddress();
      this.reload();
    };
    for (const input of [search, tag, config]) input.addEventListener("input", refilter);
    status.addEventListener("change", refilter);
    group.addEventListener("input", () => {
      this.keepInAddress();
      this.reload(); // load() regroups
    });
    columns.addEventListener("change", () => this.setColumns());
    auth.listeners.add(this.onAuth);
  }

  /** Run `id` read again (at most once a second): an alert or incident changed its counts. */
  refreshOne(id) {
    if (!this.refreshers.has(id)) {
      this.refreshers.set(id, throttle(async () => {
        const row = this.table.rows.get(id);
        if (!row) return this.reload();
        try {
          const read = this.table.startRead();
          this.table.update(row, await api(`/runs/${id}`), read);
        } catch (err) {
          if (err.status === 404) this.reload(); // deleted meanwhile
          else console.warn("run", err);
        }
      }, 1000));
    }
    this.refreshers.get(id)();
  }

  /** A live step of any run: its row follows (a run not listed: the list is read again, unless filtered). */
  liveStep(d) {
    const row = this.table.rows.get(d.run_id);
    if (!row) return this.filtering() ? undefined : this.reload();
    if (row.run.last_step === null || d.step > row.run.last_step) {
      row.run.last_step = d.step;
      if (d.loss !== null && d.loss !== undefined) row.run.last_loss = d.loss;
      row.run.last_telemetry_at = new Date().toISOString();
      this.table.fill(row);
      noteStepSeen(d.run_id, d.step);
      if (this.liveSort()) this.reloadSorted();
    }
    row.refreshSpark();
    if (this.groupKey()) this.regroup();
  }

  /** Follow the all-runs stream: steps, alerts, incidents and runs created, changed or deleted. */
  follow() {
    return subscribe(
      "/stream",
      {
        step: (d) => this.liveStep(d),
        alert: (d) => this.refreshOne(d.run_id),
        incident: (d) => this.refreshOne(d.run_id),
        run: (d) => {
          if (d.deleted) this.table.remove(d.run_id, this.table.startRead());
          else if (!this.table.rows.has(d.run_id) || d.created) this.reload();
          else this.refreshOne(d.run_id);
        },
      },
      { onopen: () => this.reload() },
    );
  }
}

export async function mountRuns(container) {
  const page = new RunsPage(container);
  page.table.renderHead();
  page.onAuth();
  await page.load();
  const stream = page.follow();
  const clock = setInterval(() => page.table.tick(), 5000);
  return {
    destroy() {
      stream.close();
      clearInterval(clock);
      auth.listeners.delete(page.onAuth);
    },
  };
}
