// Runs grouped by a config value (the runs list's "group by"): the runs the list shows that share the value of
// a config key (a sweep's seeds) form a group, and each group's loss is drawn as its mean over the group's
// runs with a band from the least to the greatest of them, all groups on one plot. Each run's curve is its
// loss series (GET /runs/{id}/series), read again only when the run has moved on.

import { api, num } from "./api.js";
import { configText, configValue } from "./config.js";
import { COLOURS, el, fmt, plotly, plotlyText, replace, throttle } from "./dom.js";
import { noteDrawn } from "./hooks.js";

/** the most runs whose curves a group view reads */
export const MAX_GROUP_RUNS = 200;
const POINTS = 500;

/** Runs by the text of their value at `key` (runs without it under `null`), groups in order of first
 * appearance: [{value, runs}]. */
export function groupRuns(runs, key) {
  const groups = new Map();
  for (const run of runs) {
    const v = configValue(run.config, key);
    const value = v === undefined ? null : configText(v);
    if (!groups.has(value)) groups.set(value, []);
    groups.get(value).push(run);
  }
  return [...groups].map(([value, members]) => ({ value, runs: members }));
}

/** The value of a curve ({steps, values}, finite values only, steps ascending) at `step`, linearly
 * interpolated between its neighbours; null outside the curve's steps. */
function valueAt(curve, step) {
  const { steps, values } = curve;
  if (!steps.length || step < steps[0] || step > steps[steps.length - 1]) return null;
  let lo = 0;
  let hi = steps.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (steps[mid] <= step) lo = mid;
    else hi = mid;
  }
  if (steps[lo] === step) return values[lo];
  if (steps[hi] === step) return values[hi];
  const t = (step - steps[lo]) / (steps[hi] - steps[lo]);
  return values[lo] + t * (values[hi] - values[lo]);
}

/** Mean, least and greatest of `curves` (each {steps, values}) at the steps of any of them (at most
 * `points`, evenly picked): each curve counts at the steps within its own range (`n`: how many did). */
export function band(curves, points = POINTS) {
  const usable = curves.map((c) => {
    const keep = c.steps.map((_, i) => i).filter((i) => Number.isFinite(c.values[i]));
    return { steps: keep.map((i) => c.steps[i]), values: keep.map((i) => c.values[i]) };
  }).filter((c) => c.steps.length);
  const all = [...new Set(usable.flatMap((c) => c.steps))].sort((a, b) => a - b);
  const every = Math.max(1, Math.ceil(all.length / points));
  const grid = all.filter((_, i) => i % every === 0 || i === all.length - 1);
  const out = { steps: [], mean: [], lo: [], hi: [], n: [] };
  for (const step of grid) {
    const at = usable.map((c) => valueAt(c, step)).filter((v) => v !== null);
    if (!at.length) continue;
    out.steps.push(step);
    out.mean.push(at.reduce((a, b) => a + b, 0) / at.length);
    out.lo.push(Math.min(...at));
    out.hi.push(Math.max(...at));
    out.n.push(at.length);
  }
  return out;
}

function rgba(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

/** The group view in `container`: `update(key, runs)` draws the groups of `runs` by `key` (at most a few
 * times a second; an empty key hides it). */
export function mountGroups(container) {
  const cache = new Map(); // run id -> {lastStep, curve}
  const info = el("p", { class: "muted", id: "groups-info" });
  const plot = el("div", { id: "groups-plot", class: "plot" });
  const table = el("table", { id: "groups-table", class: "groups" });
  const error = el("p", { class: "error", id: "groups-error" });
  const section = el("section", { class: "panel", id: "groups", hidden: true },
    el("h2", {}, "Groups"), info, error, plot, table);
  replace(container, section);
  let generation = 0;

  async function curveOf(run) {
    const hit = cache.get(run.id);
    if (hit && hit.lastStep === run.last_step) return hit.curve;
    const s = await api(`/runs/${run.id}/series?name=loss&max_points=${POINTS}`);
    const curve = { steps: s.steps, values: s.values.map(num) };
    cache.set(run.id, { lastStep: run.last_step, curve });
    return curve;
  }

  async function draw(key, runs) {
    const mine = ++generation;
    section.hidden = !key;
    if (!key) return;
    const shown = runs.slice(0, MAX_GROUP_RUNS);
    const groups = groupRuns(shown, key);
    const cut = runs.length > shown.length ? ` (the first ${shown.length} of the ${runs.length} listed)` : "";
    info.textContent = `${groups.length} group${groups.length === 1 ? "" : "s"} of the runs listed${cut} by ` +
      `${key}: each group's mean loss, the band from its least to its greatest run.`;
    const curves = await Promise.all(groups.map((g) => Promise.all(g.runs.map((r) => (r.last_step === null ? null : curveOf(r))))));
    if (mine !== generation) return; // a newer draw has started
    const Plotly = await plotly();
    const traces = [];
    const rows = [];
    groups.forEach((g, i) => {
      const colour = COLOURS[i % COLOURS.length];
      const label = g.value === null ? `${key} not set` : `${key}=${g.value}`;
      const b = band(curves[i].filter(Boolean));
      const n = g.runs.length;
      rows.push(el("tr", { dataset: { value: g.value ?? "" } },
        el("td", {}, el("span", { class: "swatch", style: `background: ${colour}` })),
        el("td", { class: "name" }, label),
        el("td", { class: "num" }, `${n} run${n === 1 ? "" : "s"}`),
        el("td", { class: "num" }, b.steps.length ? `last mean loss ${fmt(b.mean[b.mean.length - 1])}` : "no steps yet"),
        el("td", { class: "name" }, g.runs.map((r) => r.name).join(", "))));
      if (!b.steps.length) return;
      const name = plotlyText(`${label}: mean of ${n} run${n === 1 ? "" : "s"} (band: min–max)`);
      traces.push({ type: "scatter", mode: "lines", name: plotlyText(`${label}: min–max`), legendgroup: label, showlegend: false,
        x: [...b.steps, ...[...b.steps].reverse()], y: [...b.hi, ...[...b.lo].reverse()], fill: "toself",
        fillcolor: rgba(colour, 0.18), line: { width: 0, color: colour }, hoverinfo: "skip", meta: { group: g.value, kind: "band" } });
      traces.push({ type: "scatter", mode: "lines", name, legendgroup: label, x: b.steps, y: b.mean,
        line: { color: colour, width: 1.6 }, customdata: b.n, hovertemplate: "step %{x}: %{y:.4g} (mean of %{customdata})<extra></extra>",
        meta: { group: g.value, kind: "mean" } });
    });
    replace(table, el("tbody", {}, rows));
    const layout = { height: 340, margin: { l: 60, r: 20, t: 10, b: 40 }, legend: { orientation: "h", y: 1.12 },
      xaxis: { title: { text: "step" } }, yaxis: { title: { text: "loss" }, tickformat: "~g" } };
    await Plotly.react(plot, traces, layout, { displaylogo: false, responsive: true });
    if (mine === generation) noteDrawn("groups");
  }

  const later = throttle((key, runs) => draw(key, runs).catch((err) => {
    error.textContent = `could not draw the groups: ${err.detail || err.message}`;
  }), 2000);
  return {
    update(key, runs) {
      error.textContent = "";
      if (!key) section.hidden = true;
      later(key, runs);
    },
  };
}
