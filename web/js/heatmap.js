// The tensors x steps heatmap of one metric (GET /runs/{id}/heatmap): rows grouped by layer (input, weight,
// grad_output inside each) or by role, layers collapsible into one row (the bucket aggregate of their
// tensors), a name filter, non-finite cells drawn by an overlay trace in their own colours, hover details
// in a tooltip, and x zoom that refetches the visible step range at the resolution the plot can show.
// One request per drawing (the metric and the non-finite counts together), one of only the hovered layer's
// rows for its tooltip, and on a live run only the buckets after those held.

import { el, fmt, plotly, plotlyText } from "./dom.js";
import { METRICS, ROLE_ORDER, SATURATED_BELOW, SPECIAL, aggregate, cellColour, colourRange, fetchHeatmap, mergeTail } from "./heatmapdata.js";
import { drawStepAxis, markerSize, rowHeight, scrollRoom } from "./heatmaplayout.js";
import { noteMark, noteQuery } from "./hooks.js";
import { heatmapPreview, paintFirstFrame } from "./preview.js";
import { changeLines, changeMarkers } from "./recipe.js";

const HOVER_METRICS = ["amax", "scale", "overflow", "underflow", "nonfinite"];
const MARGIN = { l: 230, r: 20, t: 10, b: 40 };
const COLORBAR_PX = 90; // the colour bar sits right of the cells
const MAX_MARKERS = 20000; // beyond this many non-finite cells, an overlay heatmap draws them

/** The x positions of data `d`'s buckets: they are aligned to multiples of the width, a regular grid, which
 * plotly draws an order of magnitude faster than bricks of irregular widths (the clipped first and last
 * buckets are drawn full width). */
function bucketGrid(d) {
  const w = d.bucket_width;
  const firstBucket = d.C ? Math.floor(d.bucket_start[0] / w) : 0;
  const x0 = firstBucket * w;
  return { C: d.C, w, firstBucket, x0, centre: (c) => x0 + (c + 0.5) * w };
}

/** The traces of the cells drawn in their own colours (non-finite, saturated): few, so one square marker
 * each, drawn above the colours and listed in the legend; a pathological run with very many falls back to
 * a second (regular) heatmap. */
function specialTraces({ specials, nSpecial, R, grid, headroom, size }) {
  const { C, w, x0 } = grid;
  const traces = [];
  const codes = Object.keys(SPECIAL).map(Number)
    .filter((code) => (code !== 4 || headroom) && (code !== 5 || specials.get(5).length));
  if (nSpecial > MAX_MARKERS) {
    const special = Array.from({ length: R }, () => new Array(C).fill(null));
    for (const [code, cells] of specials) for (const [r, c] of cells) special[r][c] = code;
    const scale = [];
    codes.forEach((code, i) => scale.push([i / codes.length, SPECIAL[code][1]], [(i + 1) / codes.length, SPECIAL[code][1]]));
    traces.push({
      type: "heatmap", name: "non-finite", x0: x0 + w / 2, dx: w, y0: 0, dy: 1, z: special.map((row) => row.map((v) => (v === null ? null : codes.indexOf(v) + 1))),
      colorscale: scale, zmin: 0.5, zmax: codes.length + 0.5, showscale: false, hoverinfo: "none", zsmooth: false,
    });
  }
  for (const code of codes) {
    const cells = nSpecial > MAX_MARKERS ? [] : specials.get(code);
    const [name, colour, symbol] = SPECIAL[code];
    traces.push({
      type: "scatter", mode: "markers", name, showlegend: true, hoverinfo: "none", cliponaxis: true,
      x: cells.length ? cells.map(([, c]) => grid.centre(c)) : [null], y: cells.length ? cells.map(([r]) => r) : [null],
      customdata: cells, marker: symbol
        ? { symbol, size, color: colour, line: { width: 2, color: colour } }
        : { symbol: "square", size, color: colour, line: { width: 0 } },
    });
  }
  return traces;
}

/** The line beside the controls: rows, buckets, and which kinds of special cells are present. */
function infoText(R, { C, w }, specials) {
  const present = new Set([...specials].filter(([, cells]) => cells.length).map(([code]) => code));
  return `${R} rows × ${C} buckets of ${w} step${w === 1 ? "" : "s"}` +
    (present.has(1) ? " · NaN present" : "") + (present.has(2) || present.has(3) ? " · Inf present" : "") +
    (present.has(5) ? " · non-finite elements present" : "");
}

export class Heatmap {
  /** `opts`: {runId, metric (the first one shown; default amax), onDrawn(kind), firstPaint(painted)}. Call `load()` to fetch and draw. With `firstPaint`,
   * the first data is drawn on a canvas at once (before plotly.js loads) and `firstPaint` is called. */
  constructor(container, opts) {
    this.runId = opts.runId;
    this.onDrawn = opts.onDrawn || (() => {});
    this.firstPaint = opts.firstPaint || null;
    this.metric = Object.hasOwn(METRICS, opts.metric || "") ? opts.metric : "amax";
    this.groupBy = "layer";
    this.filter = "";
    this.collapsed = new Set();
    this.range = null; // [from, to] when zoomed
    this.data = null;
    this.query = null; // the parameters `data` was asked with (a live refresh asks for the same layout)
    this.companions = new Map(); // layer -> its tooltip metrics in the layout of `data` (or their promise)
    this.marker = null; // {step, tensorIndex, label}
    this.rows = [];
    this.build(container);
  }

  build(container) {
    const metricSelect = el("select", { id: "heatmap-metric", "aria-label": "metric" },
      ...Object.entries(METRICS).map(([k, m]) => el("option", { value: k }, m.label)));
    metricSelect.value = this.metric;
    metricSelect.addEventListener("change", () => {
      this.metric = metricSelect.value;
      this.load();
    });
    const groupSelect = el("select", { id: "heatmap-group", "aria-label": "group by" },
      el("option", { value: "layer" }, "group by layer"), el("option", { value: "role" }, "group by role"));
    groupSelect.addEventListener("change", () => {
      this.groupBy = groupSelect.value;
      this.render();
    });
    const search = el("input", { id: "heatmap-search", type: "search", placeholder: "filter tensors by name", size: 28 });
    let timer = null;
    search.addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(() => {
        this.filter = search.value.trim().toLowerCase();
        this.render();
      }, 150);
    });
    const collapseAll = el("button", { type: "button", class: "small", id: "heatmap-collapse" }, "Collapse layers");
    collapseAll.addEventListener("click", () => {
      if (!this.data) return;
      for (const t of this.data.tensors) this.collapsed.add(t.layer);
      this.render();
    });
    const expandAll = el("button", { type: "button", class: "small", id: "heatmap-expand" }, "Expand layers");
    expandAll.addEventListener("click", () => {
      this.collapsed.clear();
      this.render();
    });
    const reset = el("button", { type: "button", class: "small", id: "heatmap-reset" }, "Full range");
    reset.addEventListener("click", () => {
      this.range = null;
      this.load();
    });
    this.info = el("span", { class: "muted", id: "heatmap-info" });
    this.plot = el("div", { id: "heatmap", class: "heatmap-plot" });
    // the step axis, stuck to the bottom of the scroll box: with hundreds of rows the plot's own axis is
    // scrolled out of sight (it is drawn from the plot's computed ticks after every redraw); a plot that can
    // fit the box is sized to (`rowHeight`), so the strip never covers the rows of one that does not need it
    this.axis = el("div", { id: "heatmap-axis", class: "heatmap-axis", "aria-hidden": "true" });
    this.scroller = el("div", { class: "heatmap-scroll" }, this.plot, this.axis);
    container.append(
      el("div", { class: "controls" }, metricSelect, groupSelect, search, collapseAll, expandAll, reset, this.info),
      el("p", { class: "hint muted" }, "Drag across steps to zoom (finer buckets are fetched); click a row to collapse or expand its layer."),
      this.scroller,
    );
    this.tooltip = document.getElementById("tooltip");
  }

  /** Width in pixels of the plotting area, which is also the number of columns worth asking for. */
  plotWidth() {
    return Math.max(100, (this.scroller.clientWidth || 900) - MARGIN.l - MARGIN.r - COLORBAR_PX);
  }

  /** The metrics one drawing asks for: the one shown and the non-finite counts that mark its cells. */
  drawnMetrics() {
    return this.metric === "nonfinite" ? ["nonfinite"] : [this.metric, "nonfinite"];
  }

  /** Fetch the current metric for the current range and draw it: one request, which brings the non-finite
   * counts of the same buckets along (the cells they mark, code 5). */
  async load() {
    const seq = (this.seq = (this.seq || 0) + 1);
    this.info.textContent = "loading…";
    const [from, to] = this.range || [null, null];
    const query = { metrics: this.drawnMetrics().join(","), from, to, max_cols: Math.round(this.plotWidth()) };
    // for tests and benchmarks: the request of the drawn metric's cells alone (`GET /runs/{id}/heatmap`)
    noteQuery("heatmapQuery", { metric: this.metric, from, to, max_cols: query.max_cols });
    const data = await fetchHeatmap(this.runId, query);
    noteMark("heatmap-data");
    if (seq !== this.seq || this.dead) return; // a newer request superseded this one
    this.query = query;
    this.take(data.byMetric);
    // the first frame now; plotly.js is held back until it is painted
    if (!this.plotted) this.firstPaint = paintFirstFrame(this.firstPaint, () => this.paintPreview());
    await this.render();
  }

  /** Hold the views (metric -> `unpackHeatmap` view) of one layout: the shown metric's, and the non-finite
   * counts where any cell has some. The tooltips' data of another layout is dropped. */
  take(byMetric) {
    this.views = byMetric;
    this.data = byMetric[this.metric];
    const nf = byMetric.nonfinite;
    this.nonfinite = this.metric !== "nonfinite" && nf && nf.vals.some((v) => v > 0) ? nf : null;
    this.companions = new Map();
  }

  /** A live run's new steps: only the buckets after those held (`after_step`), merged in, in one request; a
   * layout that has changed meanwhile (the run outgrew its bucket width) comes back whole. Zoomed, nothing. */
  async refresh() {
    const d = this.data;
    // zoomed, or another metric picked (its drawing is on its way): nothing to refresh
    if (this.range || (this.query && this.query.metrics !== this.drawnMetrics().join(","))) return;
    if (!d || !d.C) {
      await this.load();
      return;
    }
    const seq = this.seq;
    const views = this.views;
    const query = { ...this.query, after_step: d.bucket_end[d.C - 1], bucket_width: d.bucket_width };
    const tail = await fetchHeatmap(this.runId, query);
    // a drawing asked for meanwhile (another metric, a zoom) wins; so does a refresh that merged first
    if (seq !== this.seq || views !== this.views || this.dead) return;
    if (tail.after_step === null) {
      this.take(tail.byMetric);
    } else if (tail.C) {
      this.take(Object.fromEntries(Object.entries(views).map(([m, view]) => [m, mergeTail(view, tail.byMetric[m])])));
    } else {
      return; // no new bucket
    }
    await this.render();
  }

  /** The displayed rows: tensors (or collapsed layers) after grouping and filtering. */
  computeRows() {
    const d = this.data;
    const match = (t) => !this.filter || t.name.toLowerCase().includes(this.filter) || t.layer.toLowerCase().includes(this.filter);
    const layerOrder = new Map();
    for (const t of d.tensors) if (!layerOrder.has(t.layer)) layerOrder.set(t.layer, layerOrder.size);
    const tensors = d.tensors.filter(match);
    const rows = [];
    if (this.groupBy === "role") {
      tensors.sort((a, b) => (ROLE_ORDER[a.role] - ROLE_ORDER[b.role]) || (layerOrder.get(a.layer) - layerOrder.get(b.layer)) || (a.index - b.index));
      for (const t of tensors) rows.push({ kind: "tensor", indices: [t.index], label: t.name, layer: t.layer, tensor: t });
      return rows;
    }
    const byLayer = new Map();
    for (const t of tensors) {
      if (!byLayer.has(t.layer)) byLayer.set(t.layer, []);
      byLayer.get(t.layer).push(t);
    }
    const layers = [...byLayer.keys()].sort((a, b) => layerOrder.get(a) - layerOrder.get(b));
    for (const layer of layers) {
      const ts = byLayer.get(layer).sort((a, b) => (ROLE_ORDER[a.role] - ROLE_ORDER[b.role]) || (a.index - b.index));
      if (this.collapsed.has(layer)) {
        rows.push({ kind: "layer", indices: ts.map((t) => t.index), label: `▸ ${layer} (${ts.length})`, layer });
      } else {
        for (const t of ts) rows.push({ kind: "tensor", indices: [t.index], label: t.name, layer, tensor: t });
      }
    }
    return rows;
  }

  /** Raw value of `row` at column c in parsed heatmap `d` (aggregated over a collapsed layer). */
  rowValue(d, row, c, metric) {
    const C = d.C;
    if (d.emptyCol[c]) return [NaN, true];
    if (row.indices.length === 1) return [d.vals[d.rowOf[row.indices[0]] * C + c], false];
    return [aggregate(METRICS[metric].agg, row.indices.map((t) => d.vals[d.rowOf[t] * C + c])), false];
  }

  /** The colour matrix of the displayed rows: z (rows of colour values, null where no data) and the cells
   * drawn in their own colours, by overlay code. */
  matrix() {
    const d = this.data;
    const rows = this.computeRows();
    const R = rows.length;
    const C = d.C;
    const z = new Array(R);
    const specials = new Map(Object.keys(SPECIAL).map((code) => [Number(code), []])); // code -> [[r, c]]
    let nSpecial = 0;
    const logScale = this.metric === "amax" || this.metric === "scale";
    const headroom = this.metric === "headroom";
    const nf = this.nonfinite && this.nonfinite.C === C ? this.nonfinite.vals : null;
    const nfRow = nf ? this.nonfinite.rowOf : null;
    const hasNonfinite = (row, c) => row.indices.some((t) => nf[nfRow[t] * C + c] > 0);
    for (let r = 0; r < R; r++) {
      const zr = new Array(C);
      const single = rows[r].indices.length === 1 ? d.rowOf[rows[r].indices[0]] * C : -1;
      for (let c = 0; c < C; c++) {
        let v;
        if (d.emptyCol[c]) {
          zr[c] = null;
          continue;
        }
        if (single >= 0) v = d.vals[single + c];
        else v = this.rowValue(d, rows[r], c, this.metric)[0];
        const flagged = nf !== null && hasNonfinite(rows[r], c);
        // the common case inline (finite positive amax/scale); everything else through cellColour
        if (logScale && v > 0 && v < Infinity && !flagged) {
          zr[c] = Math.log2(v);
          continue;
        }
        let [colour, code] = cellColour(this.metric, v, false);
        if (code === null && headroom && this.saturated(d, rows[r], c)) code = 4;
        if (code === null && flagged) code = 5;
        zr[c] = colour;
        if (code !== null) {
          specials.get(code).push([r, c]);
          nSpecial++;
        }
      }
      z[r] = zr;
    }
    return { rows, z, specials, nSpecial };
  }

  /** Whether a tensor of `row` lost values to saturation in column c of headroom data `d`: its headroom
   * below its format's `SATURATED_BELOW` (each tensor against its own format in a collapsed layer). */
  saturated(d, row, c) {
    if (!this.formats || this.formats.data !== d) {
      this.formats = { data: d, of: new Map(d.tensors.map((t) => [t.index, t.format])) };
    }
    return row.indices.some((t) => d.vals[d.rowOf[t] * d.C + c] < (SATURATED_BELOW[this.formats.of.get(t)] ?? 0));
  }

  /** Row height in pixels, plot height, and the rows labelled on the y axis ([[row, label]]). */
  geometry(rows) {
    const R = rows.length;
    const rowH = R > 0 ? rowHeight(R, scrollRoom(this.scroller), MARGIN.t + MARGIN.b) : 18;
    const height = Math.max(160, R * rowH + MARGIN.t + MARGIN.b);
    const every = Math.max(1, Math.ceil(11 / rowH)); // keep tick labels at least 11 px apart
    const labels = [];
    rows.forEach((row, i) => {
      if (i % every === 0) labels.push([i, row.label.length > 34 ? `…${row.label.slice(-33)}` : row.label]);
    });
    return { rowH, height, labels };
  }

  /** The first frame on a canvas, before plotly.js has loaded; removed once plotly has drawn. Returns the
   * canvas (null when none is painted). */
  paintPreview() {
    if (!this.data || this.plotted || this.dead) return this.previewCanvas;
    const { rows, z, specials } = this.matrix();
    const cells = [];
    for (const [code, list] of specials) for (const [r, c] of list) cells.push([r, c, SPECIAL[code][1]]);
    const { rowH, height, labels } = this.geometry(rows);
    const canvas = heatmapPreview({
      width: this.scroller.clientWidth || 900, height, z, C: this.data.C, specials: cells, labels,
      margin: MARGIN, right: COLORBAR_PX, metric: this.metric, colorscale: METRICS[this.metric].colorscale,
      markerSize: markerSize(rowH), range: colourRange(this.metric, z),
    });
    if (this.previewCanvas) this.previewCanvas.replaceWith(canvas);
    else this.scroller.prepend(canvas);
    this.previewCanvas = canvas;
    return canvas;
  }

  async render() {
    const d = this.data;
    if (!d) return;
    const Plotly = await plotly();
    if (!this.data || this.dead) return;
    const { rows, z, specials, nSpecial } = this.matrix();
    this.rows = rows;
    const grid = bucketGrid(d);
    const { rowH, height, labels } = this.geometry(rows);
    const m = METRICS[this.metric];
    const range = colourRange(this.metric, z);
    const traces = [
      {
        type: "heatmap", name: "values", x0: grid.x0 + grid.w / 2, dx: grid.w, y0: 0, dy: 1, z, colorscale: m.colorscale, hoverinfo: "none",
        ...(range ? { zmin: range[0], zmax: range[1] } : {}),
        colorbar: { title: { text: m.colorbar, side: "right" }, thickness: 12, len: Math.min(1, 400 / height), y: 1, yanchor: "top" },
        zsmooth: false,
      },
      ...specialTraces({ specials, nSpecial, R: rows.length, grid, headroom: this.metric === "headroom", size: markerSize(rowH) }),
    ];
    const changes = this.changes || [];
    if (changes.length) {
      // each change named where its line meets the top row (the lines themselves are shapes: no hover)
      traces.push(changeMarkers(changes, changes.map(() => -0.5), { name: "recipe changes", cliponaxis: false }));
    }
    const layout = {
      height,
      margin: MARGIN,
      xaxis: { title: { text: "step" }, range: this.range ? [this.range[0], this.range[1] + 1] : undefined, autorange: !this.range, zeroline: false },
      yaxis: {
        tickvals: labels.map(([i]) => i), ticktext: labels.map(([, label]) => plotlyText(label)), range: [rows.length - 0.5, -0.5],
        fixedrange: true, zeroline: false, tickfont: { size: Math.min(11, Math.max(7, rowH)) },
      },
      legend: { orientation: "h", x: 0, y: 1, yanchor: "bottom" },
      dragmode: "zoom",
      ...this.outlines(rows, grid, changes),
    };
    this.info.textContent = infoText(rows.length, grid, specials);
    if (this.dead) return;
    noteMark("heatmap-traces");
    await this.plotTraces(Plotly, traces, layout);
  }

  /** The shapes and annotations over the cells: a line at each recipe change, and the marked cell
   * (`setMarker`) outlined with its label. */
  outlines(rows, grid, changes) {
    const shapes = changeLines(changes);
    const annotations = [];
    if (this.marker && grid.C) {
      const { x0, w } = grid;
      const r = rows.findIndex((row) => row.indices.includes(this.marker.tensorIndex));
      const c = Math.floor(this.marker.step / w) - grid.firstBucket;
      if (r >= 0 && c >= 0 && c < grid.C) {
        shapes.push({ type: "rect", x0: x0 + c * w, x1: x0 + (c + 1) * w, y0: r - 0.5, y1: r + 0.5, line: { color: "#000", width: 3 } });
        annotations.push({ x: grid.centre(c), y: r, text: plotlyText(this.marker.label), showarrow: true, arrowhead: 2, ax: 60, ay: -30, bgcolor: "#fff", bordercolor: "#000" });
      }
    }
    return { shapes, annotations };
  }

  /** The first drawing (which hands over from the canvas first frame and binds the plot's events), or a
   * redraw in place. */
  async plotTraces(Plotly, traces, layout) {
    if (!this.plotted) {
      this.inflight = Plotly.newPlot(this.plot, traces, layout, { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] });
      await this.inflight;
      this.plotted = true;
      // hand over: plotly's plot takes the first frame's place (the same size, the same cells)
      if (this.previewCanvas) this.previewCanvas.remove();
      this.previewCanvas = null;
      this.bindEvents();
    } else {
      this.inflight = Plotly.react(this.plot, traces, layout, { displaylogo: false, responsive: true });
      await this.inflight;
    }
  }

  /** Stop drawing (the page is being left); resolves once no plotly call is in flight. */
  async close() {
    this.dead = true;
    this.seq = (this.seq || 0) + 1;
    await Promise.allSettled([this.inflight]);
  }

  bindEvents() {
    const gd = this.plot;
    gd.on("plotly_afterplot", () => {
      this.drawAxis();
      if (this.data) this.onDrawn("heatmap");
    });
    this.drawAxis();
    this.onDrawn("heatmap");
    gd.on("plotly_relayout", (ev) => {
      if (this.ignoreRelayout) return;
      if (ev["xaxis.autorange"]) {
        if (this.range) {
          this.range = null;
          this.load();
        }
        return;
      }
      const r0 = ev["xaxis.range[0]"] ?? (ev["xaxis.range"] || [])[0];
      const r1 = ev["xaxis.range[1]"] ?? (ev["xaxis.range"] || [])[1];
      if (r0 === undefined || r1 === undefined) return;
      const from = Math.max(0, Math.floor(r0));
      const to = Math.max(from, Math.ceil(r1) - 1);
      this.range = [from, to];
      this.load();
    });
    gd.on("plotly_hover", (ev) => this.hover(ev));
    gd.on("plotly_unhover", () => {
      this.tooltip.hidden = true;
    });
    gd.on("plotly_click", (ev) => {
      const pt = ev.points && ev.points[0];
      if (!pt || this.groupBy !== "layer") return;
      const row = this.rows[Array.isArray(pt.customdata) ? pt.customdata[0] : Math.round(pt.y)];
      if (!row) return;
      if (this.collapsed.has(row.layer)) this.collapsed.delete(row.layer);
      else this.collapsed.add(row.layer);
      this.render();
    });
  }

  /** The plot's step ticks in the sticky axis strip (shown only while the plot is taller than its box). */
  drawAxis() {
    drawStepAxis(this.axis, this.plot, this.scroller);
  }

  /** The tooltip's other metrics (amax, scale and the counts) of one layer's tensors, in the layout of
   * `data`: one request of only that layer's rows, once per layer and layout; null where it cannot be had. */
  async companion(layer) {
    if (this.companions.has(layer)) return this.companions.get(layer);
    const d = this.data;
    const views = this.views;
    const metrics = HOVER_METRICS.filter((m) => m !== this.metric && !(m in views));
    if (!metrics.length || !d.C) {
      this.companions.set(layer, null);
      return null;
    }
    // the held buckets' own range: the same layout even when the run has grown since
    const query = { metrics: metrics.join(","), layer, from: d.bucket_start[0], to: d.bucket_end[d.C - 1], max_cols: this.query.max_cols };
    const promise = fetchHeatmap(this.runId, query).then(
      (c) => (c.C === d.C && c.bucket_width === d.bucket_width && c.bucket_start[0] === d.bucket_start[0] ? c.byMetric : null),
      () => null,
    );
    this.companions.set(layer, promise);
    const c = await promise;
    if (this.views === views) this.companions.set(layer, c);
    return c;
  }

  hover(ev) {
    const pt = ev.points && ev.points[0];
    const d = this.data;
    if (!pt || !d) return;
    const cell = Array.isArray(pt.customdata) ? pt.customdata : pt.pointNumber;
    if (!Array.isArray(cell)) return;
    const [r, c] = cell;
    const row = this.rows[r];
    if (!row || c < 0 || c >= d.C) return;
    const show = () => {
      const lines = [];
      if (row.kind === "tensor") lines.push([row.tensor.name, `${row.tensor.role} · ${row.tensor.format} · #${row.tensor.index}`]);
      else lines.push([row.layer, `${row.indices.length} tensors (collapsed; bucket ${METRICS[this.metric].agg})`]);
      lines.push(["steps", `${d.bucket_start[c]}–${d.bucket_end[c]} (${d.bucket_steps[c]} stored)`]);
      const [v, isEmpty] = this.rowValue(d, row, c, this.metric);
      const note = this.metric === "headroom" && v === Infinity ? " (amax 0: nothing to saturate)" : "";
      lines.push([this.metric, isEmpty ? "no data" : `${fmt(v)}${Number.isFinite(v) ? METRICS[this.metric].unit : note}`]);
      const comp = this.companions.get(row.layer);
      for (const metric of HOVER_METRICS) {
        if (metric === this.metric) continue;
        const view = this.views[metric] || (comp && !(comp instanceof Promise) ? comp[metric] : undefined);
        if (view) {
          const [cv, ce] = this.rowValue(view, row, c, metric);
          lines.push([metric, ce ? "no data" : fmt(cv)]);
        } else if (comp === undefined || comp instanceof Promise) {
          lines.push([metric, "…"]);
        }
      }
      if (comp === undefined) this.companion(row.layer).then(() => { if (this.hovering === key) show(); });
      this.tooltip.replaceChildren(...lines.map(([k, v], i) => el("div", { class: i === 0 ? "tt-head" : "" }, el("b", {}, k), " ", v)));
      this.tooltip.hidden = false;
    };
    const key = `${r}:${c}`;
    this.hovering = key;
    const e = ev.event;
    if (e) {
      this.tooltip.style.left = `${Math.min(window.innerWidth - 320, e.clientX + 14)}px`;
      this.tooltip.style.top = `${e.clientY + 14}px`;
    }
    show();
  }

  /** The applied recipe changes ({step, text}): a dashed line across the rows at each. */
  setChanges(changes) {
    if (JSON.stringify(changes) === JSON.stringify(this.changes || [])) return;
    this.changes = changes;
    if (this.data) this.render();
  }

  /** Outline the cell of (step, tensor) with a label (the first non-finite value). */
  setMarker(marker) {
    this.marker = marker;
    if (this.data) this.render();
  }

  /** Zoom to steps [from, to] (refetching them at finer resolution). */
  zoomTo(from, to) {
    this.range = [Math.max(0, from), to];
    return this.load();
  }
}
