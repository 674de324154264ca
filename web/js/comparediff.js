// The comparison's heatmap difference of two runs A and B: a metric's difference per tensor (matched by
// name) over the step range both cover, with the same bucket layout on both sides, the cells where either
// tensor had NaN/Inf elements marked (an amax ignores NaN, so a tensor with a few has a normal one; a tensor
// gone all NaN has none, NaN), and its mean per layer and role.

import { COLOURS, el, fmt, plotlyText, replace } from "./dom.js";
import { ROLE_ORDER, SPECIAL, fetchHeatmap } from "./heatmapdata.js";
import { drawStepAxis, markerSize, rowHeight, scrollRoom } from "./heatmaplayout.js";
import { changeLines } from "./recipe.js";

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

/** The line above the difference: the runs, steps and buckets, the tensors only one of them has, where each
 * run's tensors first had non-finite elements, and a run that stored none of the metric there. */
function differenceInfo({ runA, runB, from, to, metric }, pa, pb, diff) {
  // where each run's tensors first had non-finite elements (the cells marked below)
  // a loop, not Math.min(...cells): a run gone NaN can flag every cell of the plot, more than a call spreads
  const firstBad = (which) => {
    let first = Infinity;
    for (const f of diff.flagged) if (f[which] > 0 && f[1] < first) first = f[1];
    return first === Infinity ? null : pa.bucket_start[first];
  };
  const badText = [[runA, firstBad(2)], [runB, firstBad(3)]]
    .map(([r, step]) => (step === null ? "" : `; non-finite elements in #${r.id} from step ${step}`)).join("");
  let text = `#${runA.id} − #${runB.id}: steps ${from}–${to}, buckets of ${pa.bucket_width} step${pa.bucket_width === 1 ? "" : "s"}; ${diff.shared.length} tensors in both` +
    (diff.onlyA ? `, ${diff.onlyA} only in A` : "") + (diff.onlyB ? `, ${diff.onlyB} only in B` : "") + badText;
  // a run that stored none of this metric here (SQNR of a run sent without the quality columns): say so
  const without = [[runA, pa], [runB, pb]].filter(([, h]) => h.emptyCol.every((e) => e === 1)).map(([r]) => `#${r.id}`);
  if (without.length) text += `; no ${metric} values stored for ${without.join(" and ")} in these steps`;
  return text;
}

/** The difference's traces: its colours, the NaN / Inf cells (an overlay heatmap), their legend entries and
 * an open square on each cell where either tensor had non-finite elements, as on the run page (a filled
 * overlay, code 3, where there are too many for markers). */
function differenceTraces({ runA, runB, metric }, pa, pb, diff, rowH) {
  const shown = DIFF_METRICS[metric];
  const C = Math.min(pa.C, pb.C);
  // buckets are aligned to multiples of the width: drawn as a regular grid (fast in plotly)
  const w = pa.bucket_width;
  const x0 = Math.floor(pa.bucket_start[0] / w) * w + w / 2;
  let lim = 0;
  for (const row of diff.z) for (const v of row) if (v !== null) lim = Math.max(lim, Math.abs(v));
  const many = diff.flagged.length > MAX_MARKERS;
  if (many) for (const [r, c] of diff.flagged) if (diff.special[r][c] === null) diff.special[r][c] = 3;
  const cells = many ? [] : diff.flagged;
  return [
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
      marker: { symbol: many ? "square" : SPECIAL[5][2], size: many ? 11 : markerSize(rowH), color: SPECIAL[5][1], line: { width: 2, color: SPECIAL[5][1] } },
      showlegend: diff.flagged.length > 0 },
  ];
}

/** The difference's layout: rows that fit the box where they can (its step ticks then show above the table
 * below it, not under it), and where a recipe change took effect in A or B, in the run's colour (a
 * difference may start there). */
function differenceLayout(pair, diff, rowH) {
  const R = diff.shared.length;
  const every = Math.max(1, Math.ceil(11 / rowH));
  return {
    height: Math.max(200, R * rowH + 60), margin: { l: 230, r: 20, t: 10, b: 40 },
    xaxis: { title: { text: "step" } },
    yaxis: { autorange: "reversed", fixedrange: true, tickvals: diff.shared.map((_, i) => i).filter((i) => i % every === 0),
      ticktext: diff.shared.filter((_, i) => i % every === 0).map((t) => plotlyText(t.name)) },
    legend: { orientation: "h", y: 1, yanchor: "bottom" },
    shapes: [pair.a, pair.b].flatMap(({ index, changes }) =>
      changeLines(changes.filter((c) => c.step >= pair.from && c.step <= pair.to), COLOURS[index])),
  };
}

/** The same differences per layer and role, averaged over the buckets both runs have. */
function fillLayerMeans(table, diff, shown) {
  const means = layerMeans(diff);
  const signed = (v) => (Math.abs(v) < 0.005 ? "0.00" : `${v > 0 ? "+" : ""}${v.toFixed(2)}`); // no "-0.00"
  const cell = (v) => el("td", { class: "num" }, v === null || v === undefined ? "–" : signed(v));
  replace(table,
    el("caption", { class: "muted" }, `A − B per tensor, the mean over the buckets both runs have (${shown.bar})`),
    el("thead", {}, el("tr", {}, ["layer", "input", "weight", "grad_output"].map((h) => el("th", {}, h)))),
    el("tbody", {}, means.map((m) => el("tr", { dataset: { layer: m.layer } }, el("td", { class: "name" }, m.layer),
      cell(m.input), cell(m.weight), cell(m.grad_output)))));
  table.hidden = !means.length;
}

/**
 * Draw the difference of `pair` ({runA, runB, metric, a: {index, changes}, b: {index, changes}}) into
 * `nodes` ({plot, axis, box, info, layers}): four requests together (the metric and the non-finite counts of
 * both runs, over the steps both cover); two runs that share no step have none, and the line says so.
 */
export async function drawDifference(Plotly, nodes, pair) {
  const { runA, runB, metric } = pair;
  pair.from = Math.max(runA.first_step ?? 0, runB.first_step ?? 0);
  pair.to = Math.min(runA.last_step ?? -1, runB.last_step ?? -1);
  if (pair.to < pair.from) {
    nodes.info.textContent = "These two runs share no step range, so there is no heatmap difference to show.";
    return;
  }
  const cols = Math.max(100, Math.round((nodes.plot.clientWidth || 900) - 250));
  const [pa, pb, nfA, nfB] = await Promise.all([[metric, runA], [metric, runB], ["nonfinite", runA], ["nonfinite", runB]]
    .map(([m, r]) => fetchHeatmap(r.id, { metric: m, from: pair.from, to: pair.to, max_cols: cols })));
  const diff = heatmapDifference(pa, pb, metric, nfA, nfB);
  nodes.info.textContent = differenceInfo(pair, pa, pb, diff);
  const rowH = rowHeight(diff.shared.length, scrollRoom(nodes.box), 60);
  const traces = differenceTraces(pair, pa, pb, diff, rowH);
  await Plotly.newPlot(nodes.plot, traces, differenceLayout(pair, diff, rowH), { displaylogo: false, responsive: true });
  drawStepAxis(nodes.axis, nodes.plot, nodes.box);
  nodes.plot.on("plotly_afterplot", () => drawStepAxis(nodes.axis, nodes.plot, nodes.box));
  fillLayerMeans(nodes.layers, diff, DIFF_METRICS[metric]);
}
