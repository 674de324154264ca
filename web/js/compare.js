// Comparison of up to 8 runs: any scalar overlaid, the config diff, and between any two of them the heatmap
// difference of a metric (log2 amax(A) - log2 amax(B) by default; scale, SQNR, headroom, overflow, underflow)
// per tensor (matched by name) over the step range both cover, with the same bucket layout on both sides,
// and its mean per layer and role. Where a run went non-finite it says so: its loss (any scalar) as bands in
// the run's colour, and the difference's cells where either tensor had NaN/Inf elements marked (an amax
// ignores NaN, so a tensor with a few has a normal one; a tensor gone all NaN has none, NaN).

import { api, num } from "./api.js";
import { configText, flattenConfig } from "./config.js";
import { COLOURS, el, fmt, plotly, plotlyText, replace } from "./dom.js";
import { ROLE_ORDER, SPECIAL, drawStepAxis, fetchHeatmap, rowHeight, scrollRoom } from "./heatmap.js";
import { bandShapes, finiteNear, nonfiniteSpans, spanMarkers } from "./nonfinite.js";
import { appliedChanges, changeLines, changeMarkers } from "./recipe.js";

/** The heatmap metrics the difference can be taken of: its title, the colour bar's, the hover's label, and the
 * difference of two finite cell values (null where there is none). amax and scale as a log2 ratio (binades),
 * SQNR and headroom as plain differences (dB, binades), counts as a difference of log10(1 + count). */
export const DIFF_METRICS = {
  amax: { title: "log2 amax(A) − log2 amax(B)", bar: "log2 A/B", hover: "log2 ratio", diff: (a, b) => (a > 0 && b > 0 ? Math.log2(a) - Math.log2(b) : null) },
  scale: { title: "log2 scale(A) − log2 scale(B)", bar: "log2 A/B", hover: "log2 ratio", diff: (a, b) => (a > 0 && b > 0 ? Math.log2(a) - Math.log2(b) : null) },
  sqnr: { title: "SQNR(A) − SQNR(B), dB (worst of each bucket)", bar: "dB A−B", hover: "SQNR A−B (dB)", diff: (a, b) => a - b },
  headroom: { title: "headroom(A) − headroom(B), binades (least of each bucket)", bar: "binades A−B", hover: "headroom A−B", diff: (a, b) => a - b },
  overflow: { title: "log10(1 + overflow) A − B", bar: "log10 A−B", hover: "log10(1+overflow) A−B", diff: (a, b) => Math.log10(1 + a) - Math.log10(1 + b) },
  underflow: { title: "log10(1 + underflow) A − B", bar: "log10 A−B", hover: "log10(1+underflow) A−B", diff: (a, b) => Math.log10(1 + a) - Math.log10(1 + b) },
};

/** Per tensor name in A's order that B also has: the row of `DIFF_METRICS[metric].diff(A, B)` values (NaN and
 * Inf as codes 1 and 2 instead). With the runs' nonfinite counts in the same bucket layout (`nfA`, `nfB`),
 * `flagged` lists the cells where either tensor counted non-finite elements, as [row, column, count in A,
 * count in B]. */
export function heatmapDifference(a, b, metric = "amax", nfA = null, nfB = null) {
  const diff = DIFF_METRICS[metric].diff;
  const bIndex = new Map(b.tensors.map((t) => [t.name, t.index]));
  const layerOrder = new Map();
  for (const t of a.tensors) if (!layerOrder.has(t.layer)) layerOrder.set(t.layer, layerOrder.size);
  const shared = a.tensors.filter((t) => bIndex.has(t.name))
    .sort((x, y) => (layerOrder.get(x.layer) - layerOrder.get(y.layer)) || (ROLE_ORDER[x.role] - ROLE_ORDER[y.role]) || (x.index - y.index));
  const C = Math.min(a.C, b.C);
  const countsA = nfA && nfA.C === a.C ? nfA.vals : null;
  const countsB = nfB && nfB.C === b.C ? nfB.vals : null;
  const z = [];
  const special = [];
  const flagged = [];
  shared.forEach((t, r) => {
    const j = bIndex.get(t.name);
    const zr = new Array(C).fill(null);
    const sr = new Array(C).fill(null);
    for (let c = 0; c < C; c++) {
      if (a.emptyCol[c] || b.emptyCol[c]) continue;
      const va = a.vals[t.index * a.C + c];
      const vb = b.vals[j * b.C + c];
      if (Number.isNaN(va) || Number.isNaN(vb)) sr[c] = 1;
      else if (!Number.isFinite(va) || !Number.isFinite(vb)) sr[c] = 2;
      else zr[c] = diff(va, vb);
      const na = countsA ? countsA[t.index * a.C + c] : 0;
      const nb = countsB ? countsB[j * b.C + c] : 0;
      if (na > 0 || nb > 0) flagged.push([r, c, na, nb]);
    }
    z.push(zr);
    special.push(sr);
  });
  return { shared, z, special, flagged, onlyA: a.tensors.length - shared.length, onlyB: b.tensors.length - shared.length };
}

/** Beyond this many flagged cells the difference draws them as an overlay heatmap instead of one marker each. */
const MAX_MARKERS = 20000;

/** Per layer (in `diff`'s row order), each role's mean difference over the buckets where it has one (null
 * where none): which layers a recipe change helps, in numbers beside the picture. */
export function layerMeans(diff) {
  const layers = new Map();
  diff.shared.forEach((t, r) => {
    let sum = 0;
    let n = 0;
    for (const v of diff.z[r]) {
      if (v === null) continue;
      sum += v;
      n++;
    }
    if (!layers.has(t.layer)) layers.set(t.layer, {});
    layers.get(t.layer)[t.role] = n ? sum / n : null;
  });
  return [...layers].map(([layer, roles]) => ({ layer, ...roles }));
}

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

export async function mountCompare(container, { runs: runIds = [], a = null, b = null, metric = null }) {
  const diffMetric = Object.hasOwn(DIFF_METRICS, metric || "") ? metric : "amax";
  const all = await api("/runs?limit=1000"); // names for the picker: a list carries no config
  const byId = new Map(all.map((r) => [String(r.id), r]));
  let ids = [...new Set([...(runIds.length ? runIds : [a, b]).filter(Boolean).map(String)])].filter((id) => byId.has(id)).slice(0, MAX_RUNS);
  const chosen = await Promise.all(ids.map((id) => api(`/runs/${id}`))); // whole: their configs are compared
  const pairA = a && ids.includes(String(a)) ? String(a) : ids[0];
  const pairB = b && ids.includes(String(b)) && String(b) !== pairA ? String(b) : ids.find((id) => id !== pairA);

  const add = el("select", { id: "compare-add", "aria-label": "add a run" },
    el("option", { value: "" }, ids.length >= MAX_RUNS ? `at most ${MAX_RUNS} runs` : "add a run…"),
    all.filter((r) => !ids.includes(String(r.id))).map((r) => el("option", { value: r.id }, `#${r.id} ${r.name}`)));
  add.disabled = ids.length >= MAX_RUNS;
  add.addEventListener("change", () => {
    if (add.value) location.hash = hashFor([...ids, add.value], [pairA, pairB], diffMetric);
  });
  const chips = el("div", { class: "tags", id: "compare-runs" }, chosen.map((r, i) =>
    el("span", { class: "tag chosen", dataset: { runId: r.id } },
      el("span", { class: "swatch", style: `background: ${COLOURS[i]}` }), `#${r.id} ${r.name} `,
      el("button", { type: "button", class: "small remove", title: "leave this run out", onclick: () => {
        location.hash = hashFor(ids.filter((id) => id !== String(r.id)), [pairA, pairB], diffMetric);
      } }, "×"))));
  const info = el("p", { class: "muted", id: "compare-info" });
  const picker = el("div", { class: "picker", id: "compare-scalars-picker" });
  const lossPlot = el("div", { id: "compare-loss" });
  const configTable = el("table", { id: "compare-config", class: "config" });
  const onlyDiff = el("input", { type: "checkbox", id: "compare-config-diff", checked: true });
  const pick = (id, name) => {
    const select = el("select", { id: `compare-${name}`, "aria-label": `run ${name.toUpperCase()}` },
      chosen.map((r) => el("option", { value: r.id, selected: String(r.id) === String(id) }, `#${r.id} ${r.name}`)));
    select.addEventListener("change", () => {
      location.hash = hashFor(ids, name === "a" ? [select.value, pairB] : [pairA, select.value], diffMetric);
    });
    return select;
  };
  const diffPlot = el("div", { id: "compare-diff" });
  // the step axis of a difference taller than its box, stuck to the box's bottom (as on the run page)
  const diffAxis = el("div", { id: "compare-diff-axis", class: "heatmap-axis", "aria-hidden": "true", hidden: true });
  const diffBox = el("div", { class: "heatmap-scroll" }, diffPlot, diffAxis);
  const layerTable = el("table", { id: "compare-diff-layers", class: "config", hidden: true });
  const metricPick = el("select", { id: "compare-metric", "aria-label": "metric of the difference" },
    Object.keys(DIFF_METRICS).map((m) => el("option", { value: m, selected: m === diffMetric }, m)));
  metricPick.addEventListener("change", () => {
    location.hash = hashFor(ids, [pairA, pairB], metricPick.value);
  });
  replace(container,
    el("section", { class: "panel" }, el("h2", {}, `Compare runs (up to ${MAX_RUNS})`),
      el("div", { class: "controls" }, chips, add), info),
    el("section", { class: "panel" }, el("h2", {}, "Scalars"), picker, lossPlot),
    el("section", { class: "panel" }, el("div", { class: "panel-head" }, el("h2", {}, "Config"),
      el("label", { class: "muted" }, onlyDiff, " only keys that differ")), configTable),
    el("section", { class: "panel" }, el("h2", { id: "compare-diff-title" }, `Heatmap difference: ${DIFF_METRICS[diffMetric].title}`),
      el("div", { class: "controls" }, el("label", {}, "A ", pick(pairA, "a")), el("label", {}, "B ", pick(pairB, "b")), metricPick),
      el("p", { class: "muted", id: "compare-diff-info" }),
      diffBox, layerTable));
  if (chosen.length < 2) {
    info.textContent = "Pick at least two runs.";
    return { destroy() {} };
  }
  info.textContent = `${chosen.length} runs`;

  // the recipe changes applied to each run while it trained (a run that cannot be read: none shown)
  const changes = await Promise.all(chosen.map((r) => api(`/runs/${r.id}/commands`).then(appliedChanges, (err) => {
    console.warn("commands", err);
    return [];
  })));
  // config diff, and beside it what was changed during each run (the config is how it started)
  const changeTexts = changes.map((list) => (list.length ? list.map((c) => c.short).join("; ") : "none"));
  const rows = [...configDiff(chosen),
    { key: "recipe changes applied", texts: changeTexts, differs: new Set(changeTexts).size > 1 }];
  const fillConfig = () => {
    const shown = onlyDiff.checked ? rows.filter((r) => r.differs) : rows;
    replace(configTable,
      el("thead", {}, el("tr", {}, el("th", {}, "key"), chosen.map((r) => el("th", { class: "name" }, `#${r.id} ${r.name}`)))),
      el("tbody", {}, shown.length ? shown.map((r) => el("tr", { class: r.differs ? "differs" : "", dataset: { key: r.key } },
        el("td", { class: "name" }, r.key), r.texts.map((t) => el("td", { class: "name" }, t))))
        : el("tr", {}, el("td", { colspan: chosen.length + 1, class: "muted" }, "The configs agree on every key."))));
  };
  onlyDiff.addEventListener("change", fillConfig);
  fillConfig();

  // scalars overlaid: one chart per picked scalar, one trace per run
  const names = [...new Set(chosen.flatMap((r) => r.scalar_names || []))].sort();
  const selected = new Set(names.includes("loss") ? ["loss"] : names.slice(0, 1));
  const Plotly = await plotly();
  const drawScalars = async () => {
    const picked = names.filter((n) => selected.has(n));
    const got = await Promise.all(chosen.map((r) => {
      const mine = picked.filter((n) => (r.scalar_names || []).includes(n));
      if (!mine.length) return Promise.resolve({ series: {} });
      return api(`/runs/${r.id}/series/multi?${mine.map((n) => `name=${encodeURIComponent(n)}`).join("&")}&max_points=2000`);
    }));
    const gap = 0.08;
    const h = picked.length ? (1 - gap * (picked.length - 1)) / picked.length : 1;
    const layout = { height: 80 + 220 * Math.max(1, picked.length), margin: { l: 70, r: 20, t: 10, b: 40 }, legend: { orientation: "h", y: 1.08 },
      xaxis: { title: { text: "step" }, anchor: `y${picked.length <= 1 ? "" : picked.length}` } };
    const traces = [];
    const shapes = [];
    const bad = []; // marker traces of non-finite spans, after the lines
    picked.forEach((n, k) => {
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
        shapes.push(...bandShapes(spans, { colour: COLOURS[i], yref: `y${axis} domain`, dash: "dot" }));
        bad.push(spanMarkers(spans, sr.steps, values, `#${r.id} ${r.name}: non-finite ${n}`, {
          name: plotlyText(`#${r.id} ${r.name}: non-finite`), legendgroup: String(r.id),
          showlegend: !bad.some((t) => t.legendgroup === String(r.id)), yaxis: `y${axis}`, meta: { run: r.id, scalar: n, spans },
          marker: { symbol: "square", size: 9, color: SPECIAL[1][1], line: { color: COLOURS[i], width: 2 } } }));
      });
    });
    // each run's applied recipe changes: a dashed line in its colour, a star on its first chart
    const starred = [];
    chosen.forEach((r, i) => {
      if (!changes[i].length || !picked.length) return;
      shapes.push(...changeLines(changes[i], COLOURS[i]));
      const sr = got[i].series[picked[0]];
      const at = (step) => (sr ? finiteNear(sr.steps, sr.values.map(num), step) : null);
      starred.push(changeMarkers(changes[i], changes[i].map((c) => at(c.step)), {
        colour: COLOURS[i], prefix: `#${r.id} ${r.name}: `,
        name: plotlyText(`#${r.id} ${r.name}: recipe changes`), legendgroup: String(r.id),
      }));
    });
    layout.shapes = shapes;
    await Plotly.react(lossPlot, [...traces, ...bad, ...starred], layout, { displaylogo: false, responsive: true });
  };
  replace(picker, names.map((n) => el("label", { class: "pick", dataset: { name: n } },
    el("input", { type: "checkbox", checked: selected.has(n), onchange: (ev) => {
      if (ev.target.checked) selected.add(n);
      else selected.delete(n);
      drawScalars();
    } }), n)));
  await drawScalars();

  const runA = byId.get(pairA);
  const runB = byId.get(pairB);
  const diffInfo = document.getElementById("compare-diff-info");
  const from = Math.max(runA.first_step ?? 0, runB.first_step ?? 0);
  const to = Math.min(runA.last_step ?? -1, runB.last_step ?? -1);
  if (to < from) {
    diffInfo.textContent = "These two runs share no step range, so there is no heatmap difference to show.";
    window.fp8scope.drawn.compare = performance.now();
    return { destroy() {} };
  }
  const cols = Math.max(100, Math.round((diffPlot.clientWidth || 900) - 250));
  const [pa, pb, nfA, nfB] = await Promise.all([[diffMetric, runA], [diffMetric, runB], ["nonfinite", runA], ["nonfinite", runB]]
    .map(([m, r]) => fetchHeatmap(r.id, { metric: m, from, to, max_cols: cols })));
  const diff = heatmapDifference(pa, pb, diffMetric, nfA, nfB);
  const shown = DIFF_METRICS[diffMetric];
  const C = Math.min(pa.C, pb.C);
  // where each run's tensors first had non-finite elements (the cells marked below)
  // a loop, not Math.min(...cells): a run gone NaN can flag every cell of the plot, more than a call spreads
  const firstBad = (which) => {
    let first = Infinity;
    for (const f of diff.flagged) if (f[which] > 0 && f[1] < first) first = f[1];
    return first === Infinity ? null : pa.bucket_start[first];
  };
  const badText = [[runA, firstBad(2)], [runB, firstBad(3)]]
    .map(([r, step]) => (step === null ? "" : `; non-finite elements in #${r.id} from step ${step}`)).join("");
  diffInfo.textContent = `#${runA.id} − #${runB.id}: steps ${from}–${to}, buckets of ${pa.bucket_width} step${pa.bucket_width === 1 ? "" : "s"}; ${diff.shared.length} tensors in both` +
    (diff.onlyA ? `, ${diff.onlyA} only in A` : "") + (diff.onlyB ? `, ${diff.onlyB} only in B` : "") + badText;
  // a run that stored none of this metric here (SQNR of a run sent without the quality columns): say so
  const without = [[runA, pa], [runB, pb]].filter(([, h]) => h.emptyCol.every((e) => e === 1)).map(([r]) => `#${r.id}`);
  if (without.length) diffInfo.textContent += `; no ${diffMetric} values stored for ${without.join(" and ")} in these steps`;
  // buckets are aligned to multiples of the width: drawn as a regular grid (fast in plotly)
  const w = pa.bucket_width;
  const x0 = Math.floor(pa.bucket_start[0] / w) * w + w / 2;
  const R = diff.shared.length;
  // rows that fit the box where they can: its step ticks then show above the table below it, not under it
  const rowH = rowHeight(R, scrollRoom(diffBox), 60);
  const every = Math.max(1, Math.ceil(11 / rowH));
  let lim = 0;
  for (const row of diff.z) for (const v of row) if (v !== null) lim = Math.max(lim, Math.abs(v));
  // cells where either tensor had non-finite elements: an open square each, as on the run page (a filled
  // overlay, code 3, where there are too many for markers)
  const many = diff.flagged.length > MAX_MARKERS;
  if (many) for (const [r, c] of diff.flagged) if (diff.special[r][c] === null) diff.special[r][c] = 3;
  const cells = many ? [] : diff.flagged;
  const size = Math.max(6, Math.min(14, rowH + 2));
  await Plotly.newPlot(diffPlot, [
    { type: "heatmap", x0, dx: w, y0: 0, dy: 1, z: diff.z, zsmooth: false, colorscale: "RdBu", reversescale: true, zmin: -lim || -1, zmax: lim || 1,
      text: diff.shared.map((t) => new Array(C).fill(plotlyText(t.name))), hovertemplate: `%{text}<br>step %{x}<br>${shown.hover} %{z:.2f}<extra></extra>`,
      colorbar: { title: { text: shown.bar }, thickness: 12 } },
    { type: "heatmap", x0, dx: w, y0: 0, dy: 1, z: diff.special, zsmooth: false,
      colorscale: [[0, SPECIAL[1][1]], [1 / 3, SPECIAL[1][1]], [1 / 3, SPECIAL[2][1]], [2 / 3, SPECIAL[2][1]], [2 / 3, SPECIAL[5][1]], [1, SPECIAL[5][1]]],
      zmin: 0.5, zmax: 3.5, showscale: false, hoverinfo: "skip" },
    { type: "scatter", mode: "markers", x: [null], y: [null], name: "NaN in either", marker: { symbol: "square", size: 11, color: SPECIAL[1][1] } },
    { type: "scatter", mode: "markers", x: [null], y: [null], name: "Inf in either", marker: { symbol: "square", size: 11, color: SPECIAL[2][1] } },
    { type: "scatter", mode: "markers", name: "non-finite elements in either", cliponaxis: true, meta: { flagged: diff.flagged.length },
      x: cells.length ? cells.map(([, c]) => x0 + c * w) : [null], y: cells.length ? cells.map(([r]) => r) : [null],
      text: cells.map(([r, c, na, nb]) => `${plotlyText(diff.shared[r].name)}<br>steps ${pa.bucket_start[c]}–${pa.bucket_end[c]}<br>non-finite elements: #${runA.id} ${fmt(na)}, #${runB.id} ${fmt(nb)}`),
      hovertemplate: "%{text}<extra></extra>",
      marker: { symbol: many ? "square" : SPECIAL[5][2], size: many ? 11 : size, color: SPECIAL[5][1], line: { width: 2, color: SPECIAL[5][1] } },
      showlegend: diff.flagged.length > 0 },
  ], {
    height: Math.max(200, R * rowH + 60), margin: { l: 230, r: 20, t: 10, b: 40 },
    xaxis: { title: { text: "step" } },
    yaxis: { autorange: "reversed", fixedrange: true, tickvals: diff.shared.map((_, i) => i).filter((i) => i % every === 0),
      ticktext: diff.shared.filter((_, i) => i % every === 0).map((t) => plotlyText(t.name)) },
    legend: { orientation: "h", y: 1, yanchor: "bottom" },
    // where a recipe change took effect in A or B, in the run's colour (a difference may start there)
    shapes: [pairA, pairB].flatMap((id) => {
      const i = ids.indexOf(id);
      return changeLines(changes[i].filter((c) => c.step >= from && c.step <= to), COLOURS[i]);
    }),
  }, { displaylogo: false, responsive: true });
  drawStepAxis(diffAxis, diffPlot, diffBox);
  diffPlot.on("plotly_afterplot", () => drawStepAxis(diffAxis, diffPlot, diffBox));
  // the same differences per layer and role, averaged over the buckets both runs have
  const means = layerMeans(diff);
  const signed = (v) => (Math.abs(v) < 0.005 ? "0.00" : `${v > 0 ? "+" : ""}${v.toFixed(2)}`); // no "-0.00"
  const cell = (v) => el("td", { class: "num" }, v === null || v === undefined ? "–" : signed(v));
  replace(layerTable,
    el("caption", { class: "muted" }, `A − B per tensor, the mean over the buckets both runs have (${shown.bar})`),
    el("thead", {}, el("tr", {}, ["layer", "input", "weight", "grad_output"].map((h) => el("th", {}, h)))),
    el("tbody", {}, means.map((m) => el("tr", { dataset: { layer: m.layer } }, el("td", { class: "name" }, m.layer),
      cell(m.input), cell(m.weight), cell(m.grad_output)))));
  layerTable.hidden = !means.length;
  window.fp8scope.drawn.compare = performance.now();
  return { destroy() {} };
}
