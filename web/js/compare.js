// Comparison of up to 8 runs: any scalar overlaid, the config diff, and between any two of them the heatmap
// difference of a metric (log2 amax(A) - log2 amax(B) by default; scale, SQNR, headroom, overflow, underflow;
// comparediff.js). Where a run went non-finite it says so: its loss (any scalar) as bands in the run's colour,
// and the difference's cells where either tensor had NaN/Inf elements marked.
//
// The view loads the runs and their applied recipe changes into the page's store, lays out the panels and
// wires the pickers; the config table and the scalars chart render from the store.

import { api, num } from "./api.js";
import { DIFF_METRICS, drawDifference } from "./comparediff.js";
import { configText, flattenConfig } from "./config.js";
import { COLOURS, el, plotly, plotlyText, replace } from "./dom.js";
import { SPECIAL } from "./heatmapdata.js";
import { noteDrawn } from "./hooks.js";
import { bandShapes, finiteNear, nonfiniteSpans, spanMarkers } from "./nonfinite.js";
import { appliedChanges, changeLines, changeMarkers } from "./recipe.js";
import { Store } from "./store.js";

export const MAX_RUNS = 8;

/** Config keys with each run's value; `differs` when the runs do not all agree. */
export function configDiff(runs) {
  const values = runs.map((r) => new Map(flattenConfig(r.config)));
  const keys = [...new Set(values.flatMap((m) => [...m.keys()]))].sort();
  return keys.map((key) => {
    const texts = values.map((m) => configText(m.get(key)));
    return { key, texts, differs: new Set(texts).size > 1 };
  });
}

function hashFor(ids, pair, metric = "amax") {
  const q = new URLSearchParams({ runs: ids.join(",") });
  if (pair && pair[0] && pair[1]) {
    q.set("a", pair[0]);
    q.set("b", pair[1]);
  }
  if (metric !== "amax") q.set("metric", metric);
  return `#/compare?${q.toString().replace(/%2C/g, ",")}`;
}

/** The runs to compare (those of `runIds`, or of the pair, that exist; at most MAX_RUNS) read whole (their
 * configs are compared), every run's name for the picker, and the pair of the difference. */
async function loadRuns(runIds, a, b) {
  const all = await api("/runs?limit=1000"); // names for the picker: a list carries no config
  const byId = new Map(all.map((r) => [String(r.id), r]));
  const ids = [...new Set([...(runIds.length ? runIds : [a, b]).filter(Boolean).map(String)])].filter((id) => byId.has(id)).slice(0, MAX_RUNS);
  const chosen = await Promise.all(ids.map((id) => api(`/runs/${id}`)));
  const pairA = a && ids.includes(String(a)) ? String(a) : ids[0];
  const pairB = b && ids.includes(String(b)) && String(b) !== pairA ? String(b) : ids.find((id) => id !== pairA);
  return { all, byId, ids, chosen, pair: [pairA, pairB] };
}

/** The recipe changes applied to each run while it trained (a run that cannot be read: none shown). */
function loadChanges(chosen) {
  return Promise.all(chosen.map((r) => api(`/runs/${r.id}/commands`).then(appliedChanges, (err) => {
    console.warn("commands", err);
    return [];
  })));
}

/** The runs chosen, as chips with a button that leaves one out, and a picker that adds one. */
function runPicker({ all, ids, chosen, pair }, metric) {
  const add = el("select", { id: "compare-add", "aria-label": "add a run" },
    el("option", { value: "" }, ids.length >= MAX_RUNS ? `at most ${MAX_RUNS} runs` : "add a run…"),
    all.filter((r) => !ids.includes(String(r.id))).map((r) => el("option", { value: r.id }, `#${r.id} ${r.name}`)));
  add.disabled = ids.length >= MAX_RUNS;
  add.addEventListener("change", () => {
    if (add.value) location.hash = hashFor([...ids, add.value], pair, metric);
  });
  const chips = el("div", { class: "tags", id: "compare-runs" }, chosen.map((r, i) =>
    el("span", { class: "tag chosen", dataset: { runId: r.id } },
      el("span", { class: "swatch", style: `background: ${COLOURS[i]}` }), `#${r.id} ${r.name} `,
      el("button", { type: "button", class: "small remove", title: "leave this run out", onclick: () => {
        location.hash = hashFor(ids.filter((id) => id !== String(r.id)), pair, metric);
      } }, "×"))));
  return [chips, add];
}

/** The difference's controls: which run is A, which B, and the metric (each a new address). */
function pairPicker({ ids, chosen, pair }, metric) {
  const pick = (id, name) => {
    const select = el("select", { id: `compare-${name}`, "aria-label": `run ${name.toUpperCase()}` },
      chosen.map((r) => el("option", { value: r.id, selected: String(r.id) === String(id) }, `#${r.id} ${r.name}`)));
    select.addEventListener("change", () => {
      location.hash = hashFor(ids, name === "a" ? [select.value, pair[1]] : [pair[0], select.value], metric);
    });
    return select;
  };
  const metricPick = el("select", { id: "compare-metric", "aria-label": "metric of the difference" },
    Object.keys(DIFF_METRICS).map((m) => el("option", { value: m, selected: m === metric }, m)));
  metricPick.addEventListener("change", () => {
    location.hash = hashFor(ids, pair, metricPick.value);
  });
  return el("div", { class: "controls" }, el("label", {}, "A ", pick(pair[0], "a")), el("label", {}, "B ", pick(pair[1], "b")), metricPick);
}

/** The page's sections; returns the nodes the panels draw into. */
function compareLayout(container, runs, metric) {
  const diffPlot = el("div", { id: "compare-diff" });
  // the step axis of a difference taller than its box, stuck to the box's bottom (as on the run page)
  const diffAxis = el("div", { id: "compare-diff-axis", class: "heatmap-axis", "aria-hidden": "true", hidden: true });
  const nodes = {
    info: el("p", { class: "muted", id: "compare-info" }),
    picker: el("div", { class: "picker", id: "compare-scalars-picker" }),
    scalars: el("div", { id: "compare-loss" }),
    config: el("table", { id: "compare-config", class: "config" }),
    onlyDiff: el("input", { type: "checkbox", id: "compare-config-diff", checked: true }),
    diff: { plot: diffPlot, axis: diffAxis, box: el("div", { class: "heatmap-scroll" }, diffPlot, diffAxis),
      info: el("p", { class: "muted", id: "compare-diff-info" }), layers: el("table", { id: "compare-diff-layers", class: "config", hidden: true }) },
  };
  replace(container,
    el("section", { class: "panel" }, el("h2", {}, `Compare runs (up to ${MAX_RUNS})`),
      el("div", { class: "controls" }, ...runPicker(runs, metric)), nodes.info),
    el("section", { class: "panel" }, el("h2", {}, "Scalars"), nodes.picker, nodes.scalars),
    el("section", { class: "panel" }, el("div", { class: "panel-head" }, el("h2", {}, "Config"),
      el("label", { class: "muted" }, nodes.onlyDiff, " only keys that differ")), nodes.config),
    el("section", { class: "panel" }, el("h2", { id: "compare-diff-title" }, `Heatmap difference: ${DIFF_METRICS[metric].title}`),
      pairPicker(runs, metric), nodes.diff.info, nodes.diff.box, nodes.diff.layers));
  return nodes;
}

/** The config diff, and beside it what was changed during each run (the config is how it started); every
 * key, or only those that differ. */
function renderConfig(table, store) {
  const chosen = store.get("runs");
  const changeTexts = store.get("changes").map((list) => (list.length ? list.map((c) => c.short).join("; ") : "none"));
  const rows = [...configDiff(chosen), { key: "recipe changes applied", texts: changeTexts, differs: new Set(changeTexts).size > 1 }];
  const shown = store.get("onlyDiff") ? rows.filter((r) => r.differs) : rows;
  replace(table,
    el("thead", {}, el("tr", {}, el("th", {}, "key"), chosen.map((r) => el("th", { class: "name" }, `#${r.id} ${r.name}`)))),
    el("tbody", {}, shown.length ? shown.map((r) => el("tr", { class: r.differs ? "differs" : "", dataset: { key: r.key } },
      el("td", { class: "name" }, r.key), r.texts.map((t) => el("td", { class: "name" }, t))))
      : el("tr", {}, el("td", { colspan: chosen.length + 1, class: "muted" }, "The configs agree on every key."))));
}

/** One chart per picked scalar (`names` in order), one line per run, with its non-finite spans as bands in
 * the run's colour and markers named in their hover, after the lines. */
function scalarTraces(chosen, names, got) {
  const gap = 0.08;
  const h = names.length ? (1 - gap * (names.length - 1)) / names.length : 1;
  const layout = { height: 80 + 220 * Math.max(1, names.length), margin: { l: 70, r: 20, t: 10, b: 40 }, legend: { orientation: "h", y: 1.08 },
    xaxis: { title: { text: "step" }, anchor: `y${names.length <= 1 ? "" : names.length}` }, shapes: [] };
  const traces = [];
  const bad = []; // marker traces of non-finite spans, after the lines
  names.forEach((n, k) => {
    const axis = k === 0 ? "" : String(k + 1);
    const top = 1 - k * (h + gap);
    layout[`yaxis${axis}`] = { title: { text: plotlyText(n) }, domain: [Math.max(0, top - h), top], tickformat: "~g" };
    chosen.forEach((r, i) => {
      const sr = got[i].series[n];
      if (!sr) return;
      const values = sr.values.map(num);
      traces.push({ type: "scatter", mode: "lines", name: plotlyText(`#${r.id} ${r.name}`), legendgroup: String(r.id), showlegend: k === 0,
        x: sr.steps, y: values.map((v) => (Number.isFinite(v) ? v : null)), yaxis: `y${axis}`, line: { color: COLOURS[i], width: 1.3 } });
      // where this run's values were NaN/Inf: a band in its colour over the chart, a marker named in the hover
      const spans = nonfiniteSpans(sr.steps, values);
      if (!spans.length) return;
      layout.shapes.push(...bandShapes(spans, { colour: COLOURS[i], yref: `y${axis} domain`, dash: "dot" }));
      bad.push(spanMarkers(spans, sr.steps, values, `#${r.id} ${r.name}: non-finite ${n}`, {
        name: plotlyText(`#${r.id} ${r.name}: non-finite`), legendgroup: String(r.id),
        showlegend: !bad.some((t) => t.legendgroup === String(r.id)), yaxis: `y${axis}`, meta: { run: r.id, scalar: n, spans },
        marker: { symbol: "square", size: 9, color: SPECIAL[1][1], line: { color: COLOURS[i], width: 2 } } }));
    });
  });
  return { traces: [...traces, ...bad], layout };
}

/** Each run's applied recipe changes: a dashed line in its colour, a star on its first chart. */
function changeTraces(chosen, changes, first, got, shapes) {
  const starred = [];
  chosen.forEach((r, i) => {
    if (!changes[i].length || !first) return;
    shapes.push(...changeLines(changes[i], COLOURS[i]));
    const sr = got[i].series[first];
    const at = (step) => (sr ? finiteNear(sr.steps, sr.values.map(num), step) : null);
    starred.push(changeMarkers(changes[i], changes[i].map((c) => at(c.step)), {
      colour: COLOURS[i], prefix: `#${r.id} ${r.name}: `,
      name: plotlyText(`#${r.id} ${r.name}: recipe changes`), legendgroup: String(r.id),
    }));
  });
  return starred;
}

/** The scalars overlaid: the picked ones' series of every run that has them (one request per run), drawn. */
async function drawScalars(Plotly, plot, store) {
  const chosen = store.get("runs");
  const picked = store.get("names").filter((n) => store.get("selected").has(n));
  const got = await Promise.all(chosen.map((r) => {
    const mine = picked.filter((n) => (r.scalar_names || []).includes(n));
    if (!mine.length) return Promise.resolve({ series: {} });
    return api(`/runs/${r.id}/series/multi?${mine.map((n) => `name=${encodeURIComponent(n)}`).join("&")}&max_points=2000`);
  }));
  const { traces, layout } = scalarTraces(chosen, picked, got);
  const starred = changeTraces(chosen, store.get("changes"), picked[0], got, layout.shapes);
  await Plotly.react(plot, [...traces, ...starred], layout, { displaylogo: false, responsive: true });
}

/** The scalars' picker: a box per scalar any run sent, writing the selection into the store. */
function renderScalarPicker(picker, store) {
  const selected = store.get("selected");
  replace(picker, store.get("names").map((n) => el("label", { class: "pick", dataset: { name: n } },
    el("input", { type: "checkbox", checked: selected.has(n), onchange: (ev) => {
      const next = new Set(store.get("selected"));
      if (ev.target.checked) next.add(n);
      else next.delete(n);
      store.set("selected", next);
    } }), n)));
}

export async function mountCompare(container, { runs: runIds = [], a = null, b = null, metric = null }) {
  const diffMetric = Object.hasOwn(DIFF_METRICS, metric || "") ? metric : "amax";
  const runs = await loadRuns(runIds, a, b);
  const nodes = compareLayout(container, runs, diffMetric);
  if (runs.chosen.length < 2) {
    nodes.info.textContent = "Pick at least two runs.";
    return { destroy() {} };
  }
  nodes.info.textContent = `${runs.chosen.length} runs`;
  const names = [...new Set(runs.chosen.flatMap((r) => r.scalar_names || []))].sort();
  const store = new Store({
    runs: runs.chosen, changes: await loadChanges(runs.chosen), onlyDiff: nodes.onlyDiff.checked,
    names, selected: new Set(names.includes("loss") ? ["loss"] : names.slice(0, 1)),
  });
  nodes.onlyDiff.addEventListener("change", () => store.set("onlyDiff", nodes.onlyDiff.checked));
  store.subscribe(["runs", "changes", "onlyDiff"], () => renderConfig(nodes.config, store));
  renderConfig(nodes.config, store);

  const Plotly = await plotly();
  store.subscribe("selected", () => drawScalars(Plotly, nodes.scalars, store));
  renderScalarPicker(nodes.picker, store);
  await drawScalars(Plotly, nodes.scalars, store);

  const [pairA, pairB] = runs.pair;
  const side = (id) => ({ index: runs.ids.indexOf(id), changes: store.get("changes")[runs.ids.indexOf(id)] });
  await drawDifference(Plotly, nodes.diff, {
    runA: runs.byId.get(pairA), runB: runs.byId.get(pairB), metric: diffMetric, a: side(pairA), b: side(pairB),
  });
  noteDrawn("compare");
  return { destroy() {} };
}
