// The run page's loss, grad-norm and learning-rate curves: smoothing and a log axis kept across pages, spike,
// alert, event and recipe-change markers on the loss, non-finite spans as bands, live loss points appended,
// and a canvas first frame before plotly.js loads.

import { api, num } from "./api.js";
import { el, plotly, plotlyText } from "./dom.js";
import { eventSeries, eventText, jobEvents } from "./events.js";
import { noteMark } from "./hooks.js";
import { bandShapes, finiteNear, nonfiniteSpans, spanMarkers } from "./nonfinite.js";
import { curvesPreview, paintFirstFrame } from "./preview.js";
import { changeLines, changeMarkers } from "./recipe.js";

/** An explicit axis range for a constant series (plotly would centre it in [v - 1, v + 1], which for a
 * learning rate of 3e-4 hides it); undefined (autorange) otherwise. */
function constantRange(values) {
  // a loop, not Math.min(...values): a live series can grow past the arguments a call may spread
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (!Number.isFinite(v)) continue;
    lo = Math.min(lo, v);
    hi = Math.max(hi, v);
  }
  if (lo === Infinity) return undefined;
  if (lo !== hi) return undefined;
  return lo === 0 ? [-1, 1] : [Math.min(0, 2 * lo), Math.max(0, 2 * lo)];
}

const finiteOrNull = (v) => (Number.isFinite(v) ? v : null);

const CURVES_HEIGHT = 340;
const CURVES_MARGIN = { l: 60, r: 60, t: 10, b: 40 };
const CURVES_KEY = "fp8scope.curves"; // the curves' smoothing and log-y, kept across pages and reloads

/** The loss smoothed as TensorBoard does: an exponential moving average with weight `w` on the past,
 * debiased at the start (so the first points are not pulled towards 0); a non-finite value is skipped
 * (null where it stands) and the average carries on past it. */
export function smoothed(values, w) {
  if (!(w > 0)) return values.map((v) => (Number.isFinite(v) ? v : null));
  let avg = 0;
  let n = 0;
  return values.map((v) => {
    if (!Number.isFinite(v)) return null;
    avg = w * avg + (1 - w) * v;
    n += 1;
    return avg / (1 - w ** n);
  });
}

/** Loss, lr and grad-norm curves; live loss points are appended; markers for spikes and alerts. The loss
 * can be smoothed and drawn on a log axis; the grad-norm panel is drawn only when the run sent a grad norm. */
export class Curves {
  /** With `firstPaint`, the first data is drawn on a canvas at once (before plotly.js loads), then
   * `firstPaint(painted)` is called. `onLoss(loss)` is called with the loss series whenever it changes. */
  constructor(container, runId, onDrawn, firstPaint = null, onLoss = () => {}) {
    this.runId = runId;
    this.onDrawn = onDrawn;
    this.firstPaint = firstPaint;
    this.onLoss = onLoss;
    this.view = { smoothing: 0, logY: false };
    try {
      Object.assign(this.view, JSON.parse(localStorage.getItem(CURVES_KEY) || "{}"));
    } catch {
      // a value this page did not write: the defaults
    }
    this.view.smoothing = Math.min(0.99, Math.max(0, Number(this.view.smoothing) || 0));
    this.view.logY = this.view.logY === true;
    this.plot = el("div", { id: "curves", class: "curves-plot" });
    container.append(this.controls(), this.plot);
    this.loss = { steps: [], values: [] };
    this.grad = { steps: [], values: [] };
    this.markers = [];
    this.changes = [];
  }

  /** The smoothing slider and the log-y box above the plot. */
  controls() {
    const shown = el("span", { id: "curves-smoothing-value", class: "num" }, this.view.smoothing.toFixed(2));
    const slider = el("input", {
      id: "curves-smoothing", type: "range", min: 0, max: 0.99, step: 0.01, value: this.view.smoothing,
      "aria-label": "loss smoothing", title: "exponential moving average of the loss (0: none)",
      oninput: (ev) => {
        this.view.smoothing = Number(ev.target.value);
        shown.textContent = this.view.smoothing.toFixed(2);
        this.saveView();
      },
    });
    const logY = el("input", {
      id: "curves-log-y", type: "checkbox", checked: this.view.logY,
      onchange: (ev) => {
        this.view.logY = ev.target.checked;
        this.saveView();
      },
    });
    return el("div", { class: "controls curves-controls" },
      el("label", {}, "smoothing ", slider, " ", shown), el("label", {}, logY, " log y (loss)"));
  }

  saveView() {
    try {
      localStorage.setItem(CURVES_KEY, JSON.stringify(this.view));
    } catch {
      // storage off: the view holds for this page
    }
    if (this.drawn) this.draw();
  }

  /** Whether the run sent a grad norm at all (no panel of made-up axes when it did not). */
  hasGrad() {
    return this.grad.values.some((v) => Number.isFinite(v));
  }

  /** The applied recipe changes ({step, text}): a marker on the loss and a line across the plot each. */
  setChanges(changes) {
    if (JSON.stringify(changes) === JSON.stringify(this.changes)) return;
    this.changes = changes;
    if (this.drawn) this.draw();
  }

  async load() {
    // one request, one pass over the steps on the server, for the three scalars
    const { series } = await api(`/runs/${this.runId}/series/multi?name=loss&name=lr&name=grad_norm&max_points=2000`);
    noteMark("curves-data");
    const take = (name) => ({ steps: series[name].steps, values: series[name].values.map(num) });
    this.loss = take("loss");
    this.lr = take("lr");
    this.grad = take("grad_norm");
    this.onLoss(this.loss);
    if (!this.drawn) this.firstPaint = paintFirstFrame(this.firstPaint, () => this.paintPreview());
    await this.draw();
  }

  /** The first frame: loss and grad norm in the places plotly draws them (layout below); no interaction.
   * Returns the canvas (null when none is painted). */
  paintPreview() {
    if (this.dead) return this.preview;
    this.preview = curvesPreview({
      width: this.plot.clientWidth || 900, height: CURVES_HEIGHT, margin: CURVES_MARGIN,
      lines: this.hasGrad()
        ? [{ ...this.loss, colour: "#1f77b4", domain: [0.4, 1] }, { ...this.grad, colour: "#2ca02c", domain: [0, 0.32] }]
        : [{ ...this.loss, colour: "#1f77b4", domain: [0, 1] }],
    });
    this.plot.before(this.preview);
    return this.preview;
  }

  /** Loss near `step` (for placing a marker on the curve). */
  lossAt(step) {
    return finiteNear(this.loss.steps, this.loss.values, step);
  }

  setMarkers(alerts, events) {
    const spikes = new Map();
    for (const e of events) if (e.kind === "loss_spike") spikes.set(e.step, `loss spike (client) at step ${e.step}`);
    for (const a of alerts) if (a.kind === "loss_spike") spikes.set(a.first_step, a.message);
    const others = alerts.filter((a) => a.kind !== "loss_spike");
    // the job's own events (checkpoints, injected faults, ...) as markers; evaluations as the val loss curve
    const custom = jobEvents(events);
    const val = eventSeries(events, "eval", "val_loss");
    const marks = custom.filter((e) => e.details.name !== "eval").map((e) => ({ step: e.step, text: eventText(e) }));
    this.markers = { spikes: [...spikes.entries()], others, marks, val };
    if (this.drawn) this.draw();
  }

  async draw() {
    const Plotly = await plotly();
    const grad = this.hasGrad();
    // the raw loss stays the first trace (live points are appended to it); faded under its smoothed line
    const traces = [...this.lineTraces(grad), ...this.markerTraces()];
    // each run of consecutive non-finite losses as one band (a line per step drew a forest of dashes
    // once a NaN stuck), named in its hover
    const changes = this.changes;
    traces.push(changeMarkers(changes, changes.map((c) => this.lossAt(c.step)),
      { name: "recipe changes", visible: changes.length ? true : "legendonly" }));
    const spans = nonfiniteSpans(this.loss.steps, this.loss.values);
    const shapes = [...bandShapes(spans, { y0: grad ? 0.4 : 0 }), ...changeLines(changes)];
    traces.push(spanMarkers(spans, this.loss.steps, this.loss.values, "non-finite loss",
      { name: "non-finite loss", visible: spans.length ? true : "legendonly" }));
    const layout = this.layout(grad, shapes);
    if (this.dead) return;
    if (!this.drawn) {
      this.inflight = Plotly.newPlot(this.plot, traces, layout, { displaylogo: false, responsive: true });
      await this.inflight;
      this.drawn = true;
      if (this.preview) this.preview.remove(); // hand over to plotly's plot, drawn in the same place
      this.preview = null;
      this.plot.on("plotly_afterplot", () => this.onDrawn("curves"));
      this.onDrawn("curves");
    } else {
      this.inflight = Plotly.react(this.plot, traces, layout, { displaylogo: false, responsive: true });
      await this.inflight;
    }
  }

  /** The loss (raw, then smoothed), grad-norm and lr lines. */
  lineTraces(grad) {
    const smooth = this.view.smoothing > 0;
    return [
      {
        type: "scatter", mode: "lines", name: "loss", x: this.loss.steps, y: this.loss.values.map(finiteOrNull),
        line: { color: "#1f77b4", width: smooth ? 1 : 1.5 }, opacity: smooth ? 0.3 : 1,
      },
      {
        type: "scatter", mode: "lines", name: `loss (smoothed ${this.view.smoothing.toFixed(2)})`, x: this.loss.steps,
        y: smoothed(this.loss.values, this.view.smoothing), line: { color: "#1f77b4", width: 1.8 }, visible: smooth,
      },
      { type: "scatter", mode: "lines", name: "grad norm", x: this.grad.steps, y: this.grad.values.map(finiteOrNull), yaxis: "y2", line: { color: "#2ca02c", width: 1 }, visible: grad },
      { type: "scatter", mode: "lines", name: "lr", x: this.lr.steps, y: this.lr.values.map(finiteOrNull), yaxis: "y3", line: { color: "#9467bd", width: 1, dash: "dot" } },
    ];
  }

  /** Spikes, alerts, the val loss and the job's events, each marker placed on the loss curve. */
  markerTraces() {
    const spikes = (this.markers.spikes || []).map(([step, text]) => ({ step, text, y: this.lossAt(step) }));
    const others = (this.markers.others || []).map((a) => ({ a, y: this.lossAt(a.first_step) }));
    const marks = (this.markers.marks || []).map((m) => ({ ...m, y: this.lossAt(m.step) }));
    const val = this.markers.val || { steps: [], values: [] };
    return [
      {
        type: "scatter", mode: "markers", name: "loss spike", x: spikes.map((s) => s.step), y: spikes.map((s) => s.y),
        text: spikes.map((s) => plotlyText(s.text)), hovertemplate: "%{text}<extra></extra>",
        marker: { symbol: "x", size: 11, color: "#d62728", line: { width: 2 } },
      },
      {
        type: "scatter", mode: "markers", name: "alerts", x: others.map((o) => o.a.first_step), y: others.map((o) => o.y),
        text: others.map((o) => plotlyText(`${o.a.kind}: ${o.a.message}`)), hovertemplate: "%{text}<extra></extra>",
        marker: { symbol: "triangle-down", size: 10, color: "#ff7f0e" },
      },
      {
        type: "scatter", mode: "lines+markers", name: "val loss", x: val.steps, y: val.values.map(finiteOrNull),
        line: { color: "#e377c2", width: 1.5 }, marker: { size: 5 }, visible: val.steps.length ? true : "legendonly",
      },
      {
        type: "scatter", mode: "markers", name: "events", x: marks.map((m) => m.step), y: marks.map((m) => m.y),
        text: marks.map((m) => plotlyText(m.text)), hovertemplate: "%{text}<extra></extra>",
        marker: { symbol: "diamond", size: 8, color: "#8c564b" },
      },
    ];
  }

  /** The loss panel above the grad norm's (when the run sent one), the lr on the right. */
  layout(grad, shapes) {
    return {
      height: CURVES_HEIGHT,
      margin: CURVES_MARGIN,
      xaxis: { title: { text: "step" }, anchor: grad ? "y2" : "y" },
      yaxis: { title: { text: "loss" }, domain: grad ? [0.4, 1] : [0, 1], type: this.view.logY ? "log" : "linear" },
      // no grad norm sent: no panel for it (an empty one had axes made up by plotly)
      yaxis2: { title: { text: "grad norm" }, domain: [0, 0.32], visible: grad },
      // never negative: the axis starts at 0 (autorange padded it to -0.0014 under an lr spike); its title
      // kept clear of its tick labels (automargin makes room for both)
      yaxis3: {
        title: { text: "lr", standoff: 6 }, overlaying: grad ? "y2" : "y", side: "right", showgrid: false,
        range: constantRange(this.lr.values), rangemode: "tozero", exponentformat: "e", automargin: true,
      },
      legend: { orientation: "h", y: 1.08 },
      shapes,
    };
  }

  async close() {
    this.dead = true;
    await Promise.allSettled([this.inflight]);
  }

  /** Append live steps' losses (from the stream). */
  appendLoss(points) {
    if (!this.drawn || this.dead || !points.length) return;
    for (const p of points) {
      this.loss.steps.push(p.step);
      this.loss.values.push(p.loss);
    }
    this.onLoss(this.loss);
    if (this.view.smoothing > 0) {
      this.draw(); // the smoothed line follows
      return;
    }
    window.Plotly.extendTraces(this.plot, { x: [points.map((p) => p.step)], y: [points.map((p) => (Number.isFinite(p.loss) ? p.loss : null))] }, [0]);
  }
}
