// The runs list: newest first, with status, last step, last loss, open incidents and a loss sparkline; kept
// live by the all-runs event stream. Two runs can be picked for a comparison.

import { api, num, subscribe } from "./api.js";
import { ago, badge, el, fmt, replace, sourceBadge, throttle } from "./dom.js";

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

function statusBadge(status) {
  return badge(status, { running: "info", finished: "ok", crashed: "bad" }[status] || "");
}

export async function mountRuns(container) {
  const rows = new Map(); // run id -> {run, tr, cells}
  const picked = new Set();
  const tbody = el("tbody");
  const compareButton = el("button", { type: "button", disabled: true }, "Compare selected");
  const empty = el("p", { class: "muted", hidden: true }, "No runs yet. Start a training job with --monitor-url.");
  replace(
    container,
    el(
      "section",
      { class: "panel" },
      el("div", { class: "panel-head" }, el("h2", {}, "Runs"), compareButton),
      el(
        "table",
        { class: "runs", id: "runs-table" },
        el(
          "thead",
          {},
          el("tr", {}, ...["", "Run", "Status", "Last step", "Last loss", "Open incidents", "Loss", "Last telemetry"].map((h) => el("th", {}, h))),
        ),
        tbody,
      ),
      empty,
    ),
  );
  compareButton.addEventListener("click", () => {
    const [a, b] = [...picked];
    location.hash = `#/compare?a=${a}&b=${b}`;
  });

  function pick(id, on) {
    if (on) picked.add(id);
    else picked.delete(id);
    while (picked.size > 2) picked.delete(picked.values().next().value);
    for (const [rid, row] of rows) row.check.checked = picked.has(rid);
    compareButton.disabled = picked.size !== 2;
  }

  function fill(row) {
    const r = row.run;
    replace(row.cells.status, statusBadge(r.status));
    row.cells.step.textContent = r.last_step === null ? "–" : String(r.last_step);
    row.cells.loss.textContent = fmt(num(r.last_loss));
    // one entry per fault: incidents (alerts stored before incidents existed count on their own)
    const open = r.open_incidents || 0;
    row.cells.alerts.title = `${r.open_alerts} open alert${r.open_alerts === 1 ? "" : "s"}`;
    replace(row.cells.alerts, open ? badge(String(open), "bad") : r.open_alerts ? badge(`${r.open_alerts} alerts`, "warn") : "0");
    row.cells.seen.textContent = ago(r.last_telemetry_at);
  }

  function addRow(run) {
    const check = el("input", { type: "checkbox", title: "pick for comparison", onchange: (ev) => pick(run.id, ev.target.checked) });
    const cells = {
      name: el("td", { class: "name" }, el("a", { href: `#/runs/${run.id}` }, run.name), " ", sourceBadge(run)),
      status: el("td"),
      step: el("td", { class: "num step" }),
      loss: el("td", { class: "num loss" }),
      alerts: el("td", { class: "num alerts" }),
      spark: el("td", { class: "spark" }),
      seen: el("td", { class: "muted" }),
    };
    const tr = el("tr", { dataset: { runId: run.id } }, el("td", {}, check), ...Object.values(cells));
    const row = { run, tr, cells, check };
    row.refreshSpark = throttle(() => loadSpark(row), 2000);
    rows.set(run.id, row);
    fill(row);
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

  async function load() {
    const runs = await api("/runs?limit=200");
    const order = [];
    for (const run of runs) {
      let row = rows.get(run.id);
      if (row) {
        const hadSteps = row.run.last_step !== run.last_step;
        row.run = run;
        fill(row);
        if (hadSteps) row.refreshSpark();
      } else {
        row = addRow(run);
      }
      order.push(row.tr);
    }
    replace(tbody, order); // newest first, as the API orders them
    empty.hidden = runs.length > 0;
  }
  const reload = throttle(() => load().catch((err) => console.warn("runs", err)), 500);
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
            console.warn("run", err);
          }
        }, 1000),
      );
    }
    refreshRun.get(id)();
  }

  await load();
  const stream = subscribe(
    "/stream",
    {
      step(d) {
        const row = rows.get(d.run_id);
        if (!row) return reload();
        if (row.run.last_step === null || d.step > row.run.last_step) {
          row.run.last_step = d.step;
          if (d.loss !== null && d.loss !== undefined) row.run.last_loss = d.loss;
          row.run.last_telemetry_at = new Date().toISOString();
          fill(row);
          window.fp8scope.stepSeen[`${d.run_id}:${d.step}`] = Date.now();
        }
        row.refreshSpark();
      },
      alert(d) {
        refreshOne(d.run_id);
      },
      incident(d) {
        refreshOne(d.run_id);
      },
      run(d) {
        if (!rows.has(d.run_id) || d.created) reload();
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
    },
  };
}
