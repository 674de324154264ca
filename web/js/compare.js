// Comparison of two runs: loss curves overlaid, and the heatmap difference log2 amax(A) - log2 amax(B) per
// tensor (matched by name) over the step range both runs cover, with the same bucket layout on both sides.

import { api, num } from "./api.js";
import { el, plotly, plotlyText, replace } from "./dom.js";
import { ROLE_ORDER, SPECIAL, fetchHeatmap } from "./heatmap.js";

/** Per tensor name in A's order that B also has: the row of log2(A) - log2(B) values (NaN/Inf codes apart). */
export function amaxDifference(a, b) {
  const bIndex = new Map(b.tensors.map((t) => [t.name, t.index]));
  const layerOrder = new Map();
  for (const t of a.tensors) if (!layerOrder.has(t.layer)) layerOrder.set(t.layer, layerOrder.size);
  const shared = a.tensors.filter((t) => bIndex.has(t.name))
    .sort((x, y) => (layerOrder.get(x.layer) - layerOrder.get(y.layer)) || (ROLE_ORDER[x.role] - ROLE_ORDER[y.role]) || (x.index - y.index));
  const C = Math.min(a.C, b.C);
  const z = [];
  const special = [];
  for (const t of shared) {
    const j = bIndex.get(t.name);
    const zr = new Array(C).fill(null);
    const sr = new Array(C).fill(null);
    for (let c = 0; c < C; c++) {
      if (a.emptyCol[c] || b.emptyCol[c]) continue;
      const va = a.vals[t.index * a.C + c];
      const vb = b.vals[j * b.C + c];
      if (Number.isNaN(va) || Number.isNaN(vb)) sr[c] = 1;
      else if (!Number.isFinite(va) || !Number.isFinite(vb)) sr[c] = 2;
      else if (va > 0 && vb > 0) zr[c] = Math.log2(va) - Math.log2(vb);
    }
    z.push(zr);
    special.push(sr);
  }
  return { shared, z, special, onlyA: a.tensors.length - shared.length, onlyB: b.tensors.length - shared.length };
}

export async function mountCompare(container, { a, b }) {
  const runs = await api("/runs?limit=500");
  const pick = (id, name) => {
    const select = el("select", { id: `compare-${name}`, "aria-label": `run ${name.toUpperCase()}` },
      el("option", { value: "" }, "choose a run"),
      runs.map((r) => el("option", { value: r.id, selected: String(r.id) === String(id) }, `#${r.id} ${r.name}`)));
    select.addEventListener("change", () => {
      location.hash = `#/compare?a=${selA.value}&b=${selB.value}`;
    });
    return select;
  };
  const selA = pick(a, "a");
  const selB = pick(b, "b");
  const info = el("p", { class: "muted", id: "compare-info" });
  const lossPlot = el("div", { id: "compare-loss" });
  const diffPlot = el("div", { id: "compare-diff" });
  replace(container,
    el("section", { class: "panel" }, el("h2", {}, "Compare two runs"),
      el("div", { class: "controls" }, el("label", {}, "A ", selA), el("label", {}, "B ", selB)), info),
    el("section", { class: "panel" }, el("h2", {}, "Loss"), lossPlot),
    el("section", { class: "panel" }, el("h2", {}, "Heatmap difference: log2 amax(A) − log2 amax(B)"),
      el("div", { class: "heatmap-scroll" }, diffPlot)));
  const runA = runs.find((r) => String(r.id) === String(a));
  const runB = runs.find((r) => String(r.id) === String(b));
  if (!runA || !runB) {
    info.textContent = "Pick two runs.";
    return { destroy() {} };
  }
  const Plotly = await plotly();
  const [lossA, lossB] = await Promise.all([runA, runB].map((r) => api(`/runs/${r.id}/series?name=loss&max_points=2000`)));
  await Plotly.newPlot(lossPlot, [
    { type: "scatter", mode: "lines", name: plotlyText(`A: ${runA.name}`), x: lossA.steps, y: lossA.values.map((v) => (Number.isFinite(num(v)) ? num(v) : null)) },
    { type: "scatter", mode: "lines", name: plotlyText(`B: ${runB.name}`), x: lossB.steps, y: lossB.values.map((v) => (Number.isFinite(num(v)) ? num(v) : null)) },
  ], { height: 300, margin: { l: 60, r: 20, t: 10, b: 40 }, xaxis: { title: { text: "step" } }, yaxis: { title: { text: "loss" } }, legend: { orientation: "h", y: 1.1 } },
  { displaylogo: false, responsive: true });

  const from = Math.max(runA.first_step ?? 0, runB.first_step ?? 0);
  const to = Math.min(runA.last_step ?? -1, runB.last_step ?? -1);
  if (to < from) {
    info.textContent = "The runs share no step range, so there is no heatmap difference to show.";
    return { destroy() {} };
  }
  const cols = Math.max(100, Math.round((diffPlot.clientWidth || 900) - 250));
  const [pa, pb] = await Promise.all([runA, runB].map((r) => fetchHeatmap(r.id, { metric: "amax", from, to, max_cols: cols })));
  const diff = amaxDifference(pa, pb);
  info.textContent = `steps ${from}–${to}, buckets of ${pa.bucket_width} step${pa.bucket_width === 1 ? "" : "s"}; ${diff.shared.length} tensors in both` +
    (diff.onlyA ? `, ${diff.onlyA} only in A` : "") + (diff.onlyB ? `, ${diff.onlyB} only in B` : "");
  const C = Math.min(pa.C, pb.C);
  // buckets are aligned to multiples of the width: drawn as a regular grid (fast in plotly)
  const w = pa.bucket_width;
  const x0 = Math.floor(pa.bucket_start[0] / w) * w + w / 2;
  const R = diff.shared.length;
  const rowH = Math.max(3, Math.min(18, Math.floor(640 / Math.max(1, R))));
  const every = Math.max(1, Math.ceil(11 / rowH));
  let lim = 0;
  for (const row of diff.z) for (const v of row) if (v !== null) lim = Math.max(lim, Math.abs(v));
  await Plotly.newPlot(diffPlot, [
    { type: "heatmap", x0, dx: w, y0: 0, dy: 1, z: diff.z, zsmooth: false, colorscale: "RdBu", reversescale: true, zmin: -lim || -1, zmax: lim || 1,
      text: diff.shared.map((t) => new Array(C).fill(plotlyText(t.name))), hovertemplate: "%{text}<br>step %{x}<br>log2 ratio %{z:.2f}<extra></extra>",
      colorbar: { title: { text: "log2 A/B" }, thickness: 12 } },
    { type: "heatmap", x0, dx: w, y0: 0, dy: 1, z: diff.special, zsmooth: false, colorscale: [[0, SPECIAL[1][1]], [0.5, SPECIAL[1][1]], [0.5, SPECIAL[2][1]], [1, SPECIAL[2][1]]],
      zmin: 0.5, zmax: 2.5, showscale: false, hoverinfo: "skip" },
    { type: "scatter", mode: "markers", x: [null], y: [null], name: "NaN in either", marker: { symbol: "square", size: 11, color: SPECIAL[1][1] } },
    { type: "scatter", mode: "markers", x: [null], y: [null], name: "Inf in either", marker: { symbol: "square", size: 11, color: SPECIAL[2][1] } },
  ], {
    height: Math.max(200, R * rowH + 60), margin: { l: 230, r: 20, t: 10, b: 40 },
    xaxis: { title: { text: "step" } },
    yaxis: { autorange: "reversed", fixedrange: true, tickvals: diff.shared.map((_, i) => i).filter((i) => i % every === 0),
      ticktext: diff.shared.filter((_, i) => i % every === 0).map((t) => plotlyText(t.name)) },
    legend: { orientation: "h", y: 1, yanchor: "bottom" },
  }, { displaylogo: false, responsive: true });
  window.fp8scope.drawn.compare = performance.now();
  return { destroy() {} };
}
