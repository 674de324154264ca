// The runs list: newest first, or sorted by the service by any column (a click on its header; again: the other
// way), with status, tags, notes, chosen config values, created, duration, last step, last loss, open
// incidents and a loss sparkline; kept live by the all-runs event stream. Search by name, filters (status,
// tag, config value), a page at a time; the filters, the sort and the grouping are kept in the page's address;
// rename, retag and delete (control scope); up to 8 runs picked for a comparison; grouped by a config value,
// each group's mean loss with its band (groups.js).

import { api, auth, num, qs, subscribe } from "./api.js";
import { ago, badge, el, fmt, replace, sourceBadge, statusBadge, throttle } from "./dom.js";
import { configText, configValue, parseTags } from "./config.js";
import { mountGroups } from "./groups.js";
import { shortNotes } from "./notes.js";

export const MAX_COMPARE = 8;
const PAGE = 100;
const COLUMNS_KEY = "fp8scope.runColumns";

/** Filters, sort and grouping from the page's hash (#/?q=..&status=..&tag=..&config=k=v&sort=-name&group=lr):
 * links to a filtered, sorted or grouped list work. */
function filtersFromHash() {
  const query = (location.hash.split("?")[1] || "");
  const p = new URLSearchParams(query);
  const get = (k) => p.get(k) || "";
  return { q: get("q"), status: get("status"), tag: get("tag"), config: get("config"), sort: get("sort"), group: get("group") };
}

/** The columns the service sorts by (GET /runs?sort=), by header; a config column sorts as "config:<key>". */
const SORTS = { Run: "name", Status: "status", Created: "created", Duration: "duration", "Last step": "last_step",
  "Last loss": "last_loss", "Open incidents": "open_incidents", "Last telemetry": "last_telemetry" };

/** An ISO date as local "YYYY-MM-DD HH:MM". */
export function dateTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  const two = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}`;
}

/** A run's duration in seconds: from its registration to its last telemetry (so a live run's grows); the
 * service sorts by the same. */
export function durationSeconds(run) {
  const start = Date.parse(run.created_at);
  return Math.max(0, (Date.parse(run.last_telemetry_at || run.created_at) - start) / 1000);
}

/** Seconds as "42 s", "12 min 05 s", "3 h 07 min", "2 d 4 h". */
export function durationText(seconds) {
  const s = Math.round(seconds);
  const two = (n) => String(n).padStart(2, "0");
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${two(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${two(Math.floor(s / 60) % 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor(s / 3600) % 24} h`;
}

const SVG = "http://www.w3.org/2000/svg";
const SPARK_W = 140;
const SPARK_H = 28;

/** An inline SVG sparkline of (steps, values); non-finite values are marked with a red dot. */
export function sparkline(steps, values) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", SPARK_W);
  svg.setAttribute("height", SPARK_H);
  svg.setAttribute("class", "sparkline");
  const pts = [];
  let lo = Infinity;
  let hi = -Infinity;
  steps.forEach((s, i) => {
    const v = values[i];
    if (Number.isFinite(v)) {
      lo = Math.min(lo, v);
      hi = Math.max(hi, v);
    }
  });
  if (!steps.length || !Number.isFinite(lo)) return svg;
  const s0 = steps[0];
  const s1 = steps[steps.length - 1];
  const x = (s) => (s1 > s0 ? ((s - s0) / (s1 - s0)) * (SPARK_W - 4) + 2 : SPARK_W / 2);
  const y = (v) => (hi > lo ? SPARK_H - 2 - ((v - lo) / (hi - lo)) * (SPARK_H - 4) : SPARK_H / 2);
  const bad = [];
  steps.forEach((s, i) => {
    const v = values[i];
    if (Number.isFinite(v)) pts.push(`${x(s).toFixed(1)},${y(v).toFixed(1)}`);
    else bad.push(x(s));
  });
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", pts.join(" "));
  line.setAttribute("class", "spark-line");
  svg.appendChild(line);
  for (const bx of bad) {
    const dot = document.createElementNS(SVG, "circle");
    dot.setAttribute("cx", bx.toFixed(1));
    dot.setAttribute("cy", String(SPARK_H / 2));
    dot.setAttribute("r", "2.5");
    dot.setAttribute("class", "spark-bad");
    svg.appendChild(dot);
  }
  return svg;
}


export async function mountRuns(container) {
  const rows = new Map(); // run id -> {run, tr, cells}
  const picked = new Set();
  const filters = filtersFromHash();
  let columns = (localStorage.getItem(COLUMNS_KEY) || "").split(",").map((c) => c.trim()).filter(Boolean);
  let next = null; // cursor of the next page
  let shown = 1; // pages shown
  let sort = filters.sort; // "" (newest first), "<column>" or "-<column>" (descending)

  const tbody = el("tbody");
  const thead = el("thead");
  const compareButton = el("button", { type: "button", id: "compare-selected", disabled: true }, "Compare selected");
  const empty = el("p", { class: "muted", id: "runs-empty", hidden: true }, "No runs yet. Start a training job with --monitor-url.");
  const more = el("button", { type: "button", id: "runs-more", class: "small", hidden: true }, "Load more");
  const error = el("p", { class: "error", id: "runs-error" });
  const search = el("input", { id: "runs-search", type: "search", placeholder: "search names", value: filters.q, size: 18, "aria-label": "search run names" });
  const status = el("select", { id: "runs-status", "aria-label": "status" },
    ["", "running", "finished", "interrupted", "halted", "crashed"].map((st) => el("option", { value: st, selected: st === filters.status }, st || "any status")));
  const tagFilter = el("input", { id: "runs-tag", type: "search", placeholder: "tag", value: filters.tag, size: 12, "aria-label": "tag" });
  const configFilter = el("input", { id: "runs-config", type: "search", placeholder: "config key=value", value: filters.config, size: 18, "aria-label": "config filter" });
  const columnsInput = el("input", { id: "runs-columns", type: "text", placeholder: "config columns, e.g. lr, model.n_layer", value: columns.join(", "), size: 30, "aria-label": "config columns" });
  const groupInput = el("input", { id: "runs-group", type: "search", placeholder: "config key, e.g. lr", value: filters.group, size: 14, "aria-label": "group by config key" });
  const readonly = el("p", { class: "muted readonly-note", id: "runs-readonly" });
  const groupsHost = el("div", { id: "runs-groups" });
  replace(
    container,
    el("section", { class: "panel" },
      el("div", { class: "panel-head" }, el("h2", {}, "Runs"), compareButton),
      el("div", { class: "controls", id: "runs-filters" }, search, status, tagFilter, configFilter, el("label", { class: "muted" }, "columns ", columnsInput),
        el("label", { class: "muted" }, "group by ", groupInput)),
      readonly, error,
      el("div", { class: "table-scroll" }, el("table", { class: "runs", id: "runs-table" }, thead, tbody)),
      empty, more),
    groupsHost,
  );
  const groups = mountGroups(groupsHost);

  /** A header cell; a sortable one sorts the list by its column on a click (again: the other way round). */
  function headCell(label, key, cls = "") {
    if (!key) return el("th", { class: cls }, label);
    const on = sort === key || sort === `-${key}`;
    const descending = sort === `-${key}`;
    return el("th", { class: `${cls} sortable`.trim(), dataset: { sort: key }, "aria-sort": on ? (descending ? "descending" : "ascending") : "none",
      title: `sort by ${label}${on && !descending ? ", descending" : ""}`, onclick: () => setSort(on && !descending ? `-${key}` : key) },
    label, on ? el("span", { class: "sort-mark" }, descending ? " ▼" : " ▲") : null);
  }

  function renderHead() {
    replace(thead, el("tr", {},
      headCell(""), headCell("Run", SORTS.Run), headCell("Status", SORTS.Status), headCell("Tags"),
      columns.map((c) => headCell(c, `config:${c}`, "config-col name")),
      ["Created", "Duration", "Last step", "Last loss", "Open incidents"].map((h) => headCell(h, SORTS[h])),
      headCell("Loss"), headCell("Last telemetry", SORTS["Last telemetry"]), headCell("")));
  }

  function setSort(next) {
    sort = next;
    shown = 1;
    renderHead();
    keepInAddress();
    reload();
  }

  /** The filters, sort and grouping into the page's address (no reload: a link to it shows this list). */
  function keepInAddress() {
    const params = { q: search.value.trim() || null, status: status.value || null, tag: tagFilter.value.trim() || null,
      config: configFilter.value.trim() || null, sort: sort || null, group: groupInput.value.trim() || null };
    history.replaceState(null, "", `#/${qs(params)}`);
  }

  compareButton.addEventListener("click", () => {
    location.hash = `#/compare?runs=${[...picked].join(",")}`;
  });

  function pick(id, on) {
    if (on) picked.add(id);
    else picked.delete(id);
    while (picked.size > MAX_COMPARE) picked.delete(picked.values().next().value);
    for (const [rid, row] of rows) row.check.checked = picked.has(rid);
    compareButton.disabled = picked.size < 2;
    compareButton.textContent = picked.size >= 2 ? `Compare ${picked.size} runs` : "Compare selected";
  }

  /** The chosen config keys' cells, between the tags and the created date. */
  function renderConfigCells(row) {
    for (const td of row.tr.querySelectorAll("td.config-value")) td.remove();
    for (const c of columns) {
      row.tr.insertBefore(el("td", { class: "name config-value", dataset: { key: c } }, configText(configValue(row.run.config, c))), row.cells.created);
    }
  }

  function fill(row) {
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
    renderConfigCells(row);
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

  async function act(row, what) {
    const r = row.run;
    error.textContent = "";
    try {
      if (what === "rename") {
        const name = window.prompt(`New name of run #${r.id}`, r.name);
        if (name === null || !name.trim() || name.trim() === r.name) return;
        row.run = await api(`/runs/${r.id}`, { method: "PATCH", body: { name: name.trim() } });
      } else if (what === "tags") {
        const text = window.prompt(`Tags of run #${r.id} (space-separated)`, (r.tags || []).join(" "));
        if (text === null) return;
        const parsed = parseTags(text);
        if (parsed.error) {
          error.textContent = parsed.error;
          return;
        }
        const tags = parsed.tags;
        row.run = await api(`/runs/${r.id}`, { method: "PATCH", body: { tags } });
      } else if (what === "delete") {
        if (!window.confirm(`Delete run #${r.id} "${r.name}" and all its telemetry? This cannot be undone.`)) return;
        await api(`/runs/${r.id}`, { method: "DELETE" });
        rows.delete(r.id);
        picked.delete(r.id);
        row.tr.remove();
        empty.hidden = rows.size > 0;
        return;
      }
      fill(row);
    } catch (err) {
      error.textContent = `${what} failed: ${err.detail || err.message}`;
    }
  }

  function addRow(run) {
    const check = el("input", { type: "checkbox", title: `pick for comparison (up to ${MAX_COMPARE})`, onchange: (ev) => pick(run.id, ev.target.checked) });
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
    const row = { run, cells, check, notes };
    const action = (what, label, help) => el("button", { type: "button", class: `small run-${what}`, dataset: { help }, onclick: () => act(row, what) }, label);
    row.actions = [action("rename", "Rename", "rename this run"), action("tags", "Tags", "edit this run's tags"), action("delete", "Delete", "delete this run and its telemetry")];
    row.tr = el("tr", { dataset: { runId: run.id } }, el("td", {}, check), cells.name, cells.status, cells.tags, cells.created, cells.duration, cells.step, cells.loss, cells.alerts, cells.spark, cells.seen, el("td", { class: "actions" }, row.actions));
    fill(row);
    row.refreshSpark = throttle(() => loadSpark(row), 2000);
    rows.set(run.id, row);
    loadSpark(row);
    return row;
  }

  async function loadSpark(row) {
    if (row.run.last_step === null) return;
    try {
      const s = await api(`/runs/${row.run.id}/series?name=loss&max_points=120`);
      replace(row.cells.spark, sparkline(s.steps, s.values.map(num)));
    } catch (err) {
      console.warn("sparkline", err);
    }
  }

  function query(cursor) {
    // the list carries only the config keys shown (the source badge, the columns) or grouped by; a run's
    // page has them all
    const keys = [...new Set(["fp8_source", ...columns, groupInput.value.trim()].filter(Boolean))].join(",");
    const params = { limit: PAGE, q: search.value.trim() || null, status: status.value || null, tag: tagFilter.value.trim() || null,
      config: configFilter.value.trim() || null, sort: sort || null, cursor, config_keys: keys || null };
    return `/runs${qs(params)}`;
  }

  /** The first `shown` pages again (filters changed, or a run appeared). */
  async function load() {
    const runs = [];
    let cursor = null;
    for (let p = 0; p < shown; p++) {
      const page = await api(query(cursor), { page: true });
      runs.push(...page.data);
      cursor = page.next;
      if (!cursor) break;
    }
    next = cursor;
    error.textContent = "";
    place(runs, false);
  }

  function place(runs, append) {
    const order = append ? [...tbody.children] : [];
    const keep = new Set(append ? rows.keys() : []);
    for (const run of runs) {
      let row = rows.get(run.id);
      if (row) {
        const moved = row.run.last_step !== run.last_step;
        row.run = run;
        fill(row);
        if (moved) row.refreshSpark();
      } else {
        row = addRow(run);
      }
      keep.add(run.id);
      order.push(row.tr);
    }
    for (const id of [...rows.keys()]) if (!keep.has(id)) rows.delete(id);
    replace(tbody, order); // in the order the API answers (newest first, or the sort's)
    more.hidden = !next;
    empty.hidden = rows.size > 0;
    empty.textContent = filtering() ? "No run matches these filters." : "No runs yet. Start a training job with --monitor-url.";
    regroup();
  }

  /** The group view of the runs listed (hidden without a group key). */
  function regroup() {
    groups.update(groupInput.value.trim(), [...tbody.children].map((tr) => rows.get(Number(tr.dataset.runId))?.run).filter(Boolean));
  }

  function filtering() {
    return Boolean(search.value.trim() || status.value || tagFilter.value.trim() || configFilter.value.trim());
  }

  more.addEventListener("click", async () => {
    try {
      const page = await api(query(next), { page: true });
      next = page.next;
      shown += 1;
      place(page.data, true);
    } catch (err) {
      error.textContent = `loading more runs failed: ${err.detail || err.message}`;
    }
  });

  const reload = throttle(() => load().catch((err) => {
    error.textContent = `could not list runs: ${err.detail || err.message}`;
  }), 300);
  for (const input of [search, tagFilter, configFilter]) input.addEventListener("input", () => { shown = 1; keepInAddress(); reload(); });
  status.addEventListener("change", () => { shown = 1; keepInAddress(); reload(); });
  groupInput.addEventListener("input", () => { keepInAddress(); reload(); }); // load() regroups
  // sorted by what telemetry changes: the order is read again as steps arrive
  const liveSort = () => ["last_step", "last_loss", "duration", "last_telemetry"].includes(sort.replace(/^-/, ""));
  const reloadSorted = throttle(() => reload(), 3000);
  columnsInput.addEventListener("change", () => {
    columns = columnsInput.value.split(",").map((c) => c.trim()).filter(Boolean);
    localStorage.setItem(COLUMNS_KEY, columns.join(","));
    if (sort.replace(/^-/, "").startsWith("config:") && !columns.includes(sort.replace(/^-?config:/, ""))) setSort("");
    // the list carries only the config keys asked for: the new columns' values come with the next load,
    // which fills every row's cells (head and cells change together)
    load().then(renderHead, (err) => {
      error.textContent = `could not list runs: ${err.detail || err.message}`;
    });
  });
  const onAuth = () => {
    readonly.textContent = auth.readOnlyReason() ? `Rename, tags and delete are disabled (${auth.readOnlyReason()}).` : "";
    for (const row of rows.values()) fill(row);
  };
  auth.listeners.add(onAuth);
  const refreshRun = new Map();

  function refreshOne(id) {
    if (!refreshRun.has(id)) {
      refreshRun.set(
        id,
        throttle(async () => {
          const row = rows.get(id);
          if (!row) return reload();
          try {
            row.run = await api(`/runs/${id}`);
            fill(row);
          } catch (err) {
            if (err.status === 404) reload(); // deleted meanwhile
            else console.warn("run", err);
          }
        }, 1000),
      );
    }
    refreshRun.get(id)();
  }

  renderHead();
  onAuth();
  await load();
  const stream = subscribe(
    "/stream",
    {
      step(d) {
        const row = rows.get(d.run_id);
        if (!row) return filtering() ? undefined : reload();
        if (row.run.last_step === null || d.step > row.run.last_step) {
          row.run.last_step = d.step;
          if (d.loss !== null && d.loss !== undefined) row.run.last_loss = d.loss;
          row.run.last_telemetry_at = new Date().toISOString();
          fill(row);
          window.fp8scope.stepSeen[`${d.run_id}:${d.step}`] = Date.now();
          if (liveSort()) reloadSorted();
        }
        row.refreshSpark();
        if (groupInput.value.trim()) regroup();
      },
      alert(d) {
        refreshOne(d.run_id);
      },
      incident(d) {
        refreshOne(d.run_id);
      },
      run(d) {
        if (d.deleted) {
          const row = rows.get(d.run_id);
          if (row) {
            row.tr.remove();
            rows.delete(d.run_id);
            empty.hidden = rows.size > 0;
          }
        } else if (!rows.has(d.run_id) || d.created) reload();
        else refreshOne(d.run_id);
      },
    },
    { onopen: () => reload() },
  );
  const clock = setInterval(() => {
    for (const row of rows.values()) row.cells.seen.textContent = ago(row.run.last_telemetry_at);
  }, 5000);
  return {
    destroy() {
      stream.close();
      clearInterval(clock);
      auth.listeners.delete(onAuth);
    },
  };
}
