// The run page's drill-down of one layer: its tensors' amax, scale, overflow, underflow, non-finite counts
// (and SQNR) over steps, one panel each.

import { el, plotly, plotlyText, replace } from "./dom.js";
import { SPECIAL, fetchHeatmap } from "./heatmapdata.js";
import { bandShapes, bucketSpans, spanText } from "./nonfinite.js";

/** The drill-down's heading: the layer's name as it is spelled (not upper-cased as headings are), on one line. */
function drillHead(layer) {
  return el("h3", { class: "drill-head" }, "Layer ", el("span", { class: "name", id: "drilldown-layer", title: layer }, layer));
}

/** amax, scale, overflow, underflow, non-finite (and SQNR) lines of one layer's tensors; the steps where any
 * of them counted non-finite elements as bands across every panel (a tensor gone all NaN has no amax: NaN,
 * which the log axis leaves out, so the counts are what say where the values went). One request, of only
 * the layer's rows. */
export async function drillDown(container, runId, layer) {
  replace(container, drillHead(layer), el("p", { class: "muted" }, "loading…"));
  // and the SQNR (dB) where the run sends the quality columns (a run without them stores no SQNR bucket)
  const metrics = ["amax", "scale", "overflow", "underflow", "nonfinite", "sqnr"];
  const answer = await fetchHeatmap(runId, { metrics: metrics.join(","), layer, max_cols: 600 });
  const mine = answer.tensors; // the layer's, by index
  if (answer.byMetric.sqnr.emptyCol.every((e) => e === 1)) metrics.pop();
  const maps = metrics.map((m) => answer.byMetric[m]);
  const plot = el("div", { id: "drilldown-plot" });
  replace(container, drillHead(layer), plot);
  const traces = [];
  const colours = ["#1f77b4", "#ff7f0e", "#2ca02c"];
  const panels = metrics.length;
  maps.forEach((hm, k) => {
    const x = hm.bucket_start;
    mine.forEach((t, j) => {
      const row = hm.rowOf[t.index];
      const raw = Array.from(hm.vals.subarray(row * hm.C, (row + 1) * hm.C), (v, c) => (hm.emptyCol[c] ? null : v));
      traces.push({
        type: "scatter", mode: "lines", x, y: raw.map((v) => (Number.isFinite(v) ? v : null)), xaxis: "x", yaxis: `y${k + 1}`,
        name: plotlyText(t.role), legendgroup: t.role, showlegend: k === 0, line: { color: colours[j % 3], width: 1.2 },
        hovertemplate: `${plotlyText(t.name)}<br>${metrics[k]} %{y}<br>step %{x}<extra></extra>`,
      });
    });
  });
  // one band per span of buckets where any of the layer's tensors had non-finite elements; one marker per
  // tensor and span on the counts' panel, named in its hover
  const counts = maps[metrics.indexOf("nonfinite")];
  // (the answer's rows are the layer's tensors: bucketSpans and the values take row numbers)
  const rowOf = (t) => counts.rowOf[t.index];
  const shapes = bandShapes(bucketSpans(counts, mine.map(rowOf)), { colour: SPECIAL[5][1], opacity: 0.12 });
  const marks = mine.flatMap((t) => bucketSpans(counts, [rowOf(t)]).map((span) => {
    const c = counts.bucket_start.indexOf(span[0]);
    return { x: span[0], y: counts.vals[rowOf(t) * counts.C + c], text: plotlyText(`${t.name}: ${spanText("non-finite elements", span)}`) };
  }));
  traces.push({
    type: "scatter", mode: "markers", name: "non-finite elements", x: marks.map((m) => m.x), y: marks.map((m) => m.y),
    yaxis: `y${metrics.indexOf("nonfinite") + 1}`, text: marks.map((m) => m.text), hovertemplate: "%{text}<extra></extra>",
    marker: { symbol: SPECIAL[5][2], size: 9, color: SPECIAL[5][1], line: { width: 2, color: SPECIAL[5][1] } },
    visible: marks.length ? true : "legendonly",
  });
  const layout = {
    height: 120 + 100 * panels,
    margin: { l: 60, r: 20, t: 20, b: 40 },
    grid: { rows: panels, columns: 1, shared_xaxes: true },
    xaxis: { title: { text: "step (bucket start)" } },
    legend: { orientation: "h", y: 1.05 },
    shapes,
  };
  metrics.forEach((m, k) => {
    const lo = 1 - (k + 1) / panels + 0.03;
    const title = m === "nonfinite" ? "non-finite" : m === "sqnr" ? "SQNR (dB)" : m;
    layout[`yaxis${k === 0 ? "" : k + 1}`] = { title: { text: title }, type: m === "amax" || m === "scale" ? "log" : "linear", domain: [lo, lo + 1 / panels - 0.06] };
  });
  await (await plotly()).newPlot(plot, traces, layout, { displaylogo: false, responsive: true });
}
