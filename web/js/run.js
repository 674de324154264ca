// The run page: header, loss / lr / grad-norm curves with spike and alert markers, the heatmap, the
// diverging-layers table with a drill-down, incidents (their alerts, root cause first) with acknowledge,
// the recipe editor and the post-mortem, all kept live by the run's event stream.

import { api, auth, num, subscribe } from "./api.js";
import { badge, deferPlotly, el, fmt, mark, panel, plotly, plotlyText, replace, sourceBadge, statusBadge, throttle } from "./dom.js";
import { BlockHistPanel } from "./blockhist.js";
import { Heatmap, SPECIAL, fetchHeatmap } from "./heatmap.js";
import { bandShapes, bucketSpans, finiteNear, nonfiniteSpans, spanMarkers, spanText } from "./nonfinite.js";
import { afterPaint, curvesPreview } from "./preview.js";
import { IncidentsPanel, SEVERITY_KIND } from "./incidents.js";
import { PostMortem } from "./postmortem.js";
import { RecipeEditor, appliedChanges, changeLines, changeMarkers } from "./recipe.js";
import { RunStore } from "./store.js";
import { configText, flattenConfig, parseTags } from "./config.js";
import { downloadMenu } from "./download.js";
import { Verdict } from "./verdict.js";
import { mountNotes } from "./notes.js";

function stepSeen(runId, step) {
  const key = `${runId}:${step}`;
  if (!(key in window.fp8scope.stepSeen)) window.fp8scope.stepSeen[key] = Date.now();
}

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

/** (steps, values) of the number `key` in the run's custom events named `name` (e.g. eval / val_loss). */
export function eventSeries(events, name, key) {
  const points = events
    .filter((e) => e.kind === "custom" && e.details && e.details.name === name && typeof num(e.details[key]) === "number")
    .map((e) => [e.step, num(e.details[key])])
    .sort((a, b) => a[0] - b[0]);
  return { steps: points.map((p) => p[0]), values: points.map((p) => p[1]) };
}

/** The chartable numbers of the run's custom events, as "<event name>.<detail key>". */
function eventScalarNames(events) {
  const names = new Set();
  for (const e of jobEvents(events)) {
    for (const [k, v] of Object.entries(e.details)) if (k !== "name" && typeof v === "number") names.add(`${e.details.name}.${k}`);
  }
  return [...names].sort();
}

/** The job's own named events (checkpoints, evaluations, injections), not the monitor's histogram captures. */
function jobEvents(events) {
  return events.filter((e) => e.kind === "custom" && e.details && typeof e.details.name === "string" && !("histogram" in e.details));
}

function eventText(e) {
  const rest = Object.entries(e.details).filter(([k]) => k !== "name").map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`);
  return `${e.details.name} at step ${e.step}${rest.length ? `: ${rest.join(", ")}` : ""}`;
}

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
class Curves {
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
    mark("curves-data");
    const take = (name) => ({ steps: series[name].steps, values: series[name].values.map(num) });
    this.loss = take("loss");
    this.lr = take("lr");
    this.grad = take("grad_norm");
    this.onLoss(this.loss);
    if (this.firstPaint && !this.drawn) {
      const painted = this.firstPaint;
      this.firstPaint = null;
      this.paintPreview();
      painted(Boolean(this.preview));
    }
    await this.draw();
  }

  /** The first frame: loss and grad norm in the places plotly draws them (layout below); no interaction. */
  paintPreview() {
    if (this.dead) return;
    this.preview = curvesPreview({
      width: this.plot.clientWidth || 900, height: CURVES_HEIGHT, margin: CURVES_MARGIN,
      lines: this.hasGrad()
        ? [{ ...this.loss, colour: "#1f77b4", domain: [0.4, 1] }, { ...this.grad, colour: "#2ca02c", domain: [0, 0.32] }]
        : [{ ...this.loss, colour: "#1f77b4", domain: [0, 1] }],
    });
    this.plot.before(this.preview);
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
    const clean = (v) => (Number.isFinite(v) ? v : null);
    const spikes = (this.markers.spikes || []).map(([step, text]) => ({ step, text, y: this.lossAt(step) }));
    const others = (this.markers.others || []).map((a) => ({ a, y: this.lossAt(a.first_step) }));
    const marks = (this.markers.marks || []).map((m) => ({ ...m, y: this.lossAt(m.step) }));
    const val = this.markers.val || { steps: [], values: [] };
    const grad = this.hasGrad();
    const smooth = this.view.smoothing > 0;
    // the raw loss stays the first trace (live points are appended to it); faded under its smoothed line
    const traces = [
      {
        type: "scatter", mode: "lines", name: "loss", x: this.loss.steps, y: this.loss.values.map(clean),
        line: { color: "#1f77b4", width: smooth ? 1 : 1.5 }, opacity: smooth ? 0.3 : 1,
      },
      {
        type: "scatter", mode: "lines", name: `loss (smoothed ${this.view.smoothing.toFixed(2)})`, x: this.loss.steps,
        y: smoothed(this.loss.values, this.view.smoothing), line: { color: "#1f77b4", width: 1.8 }, visible: smooth,
      },
      { type: "scatter", mode: "lines", name: "grad norm", x: this.grad.steps, y: this.grad.values.map(clean), yaxis: "y2", line: { color: "#2ca02c", width: 1 }, visible: grad },
      { type: "scatter", mode: "lines", name: "lr", x: this.lr.steps, y: this.lr.values.map(clean), yaxis: "y3", line: { color: "#9467bd", width: 1, dash: "dot" } },
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
        type: "scatter", mode: "lines+markers", name: "val loss", x: val.steps, y: val.values.map(clean),
        line: { color: "#e377c2", width: 1.5 }, marker: { size: 5 }, visible: val.steps.length ? true : "legendonly",
      },
      {
        type: "scatter", mode: "markers", name: "events", x: marks.map((m) => m.step), y: marks.map((m) => m.y),
        text: marks.map((m) => plotlyText(m.text)), hovertemplate: "%{text}<extra></extra>",
        marker: { symbol: "diamond", size: 8, color: "#8c564b" },
      },
    ];
    // each run of consecutive non-finite losses as one band (a line per step drew a forest of dashes
    // once a NaN stuck), named in its hover
    const changes = this.changes;
    traces.push(changeMarkers(changes, changes.map((c) => this.lossAt(c.step)),
      { name: "recipe changes", visible: changes.length ? true : "legendonly" }));
    const spans = nonfiniteSpans(this.loss.steps, this.loss.values);
    const shapes = [...bandShapes(spans, { y0: grad ? 0.4 : 0 }), ...changeLines(changes)];
    traces.push(spanMarkers(spans, this.loss.steps, this.loss.values, "non-finite loss",
      { name: "non-finite loss", visible: spans.length ? true : "legendonly" }));
    const layout = {
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

/** Shown at first when the run has them: the values a user looks at beside the loss. */
const DEFAULT_SCALARS = ["eval.val_loss", "tokens_per_s", "step_time_s", "accuracy"];

/** Any scalar the job sent, and the numbers of its custom events (eval.val_loss, ...), picked from a list:
 * one chart each on a shared step axis, refreshed live. */
class Scalars {
  constructor(container, runId) {
    this.runId = runId;
    this.scalarNames = [];
    this.eventNames = [];
    this.events = [];
    this.selected = new Set();
    this.offered = new Set(); // every name the picker has shown: a default is checked when it first appears
    this.picker = el("div", { id: "scalars-picker", class: "picker" });
    this.empty = el("p", { class: "muted", id: "scalars-empty" }, "Pick the values to chart.");
    this.plot = el("div", { id: "scalars-plot" });
    container.append(this.picker, this.empty, this.plot);
  }

  /** The names on offer: the run's scalars and its events' numbers. */
  setSources(run, events) {
    this.events = events;
    const scalarNames = run.scalar_names || [];
    const eventNames = eventScalarNames(events);
    const changed = scalarNames.join("\n") !== this.scalarNames.join("\n") || eventNames.join("\n") !== this.eventNames.join("\n");
    this.scalarNames = scalarNames;
    this.eventNames = eventNames;
    // a default that appears later in a live run (the first evaluation's val loss) is checked as it would
    // be on a reload; one the user has seen and unchecked stays unchecked
    for (const name of [...scalarNames, ...eventNames]) {
      if (this.offered.has(name)) continue;
      this.offered.add(name);
      if (DEFAULT_SCALARS.includes(name)) this.selected.add(name);
    }
    if (changed) this.renderPicker();
  }

  renderPicker() {
    const box = (name, source) =>
      el("label", { class: "pick", dataset: { name, source } },
        el("input", {
          type: "checkbox", value: name, checked: this.selected.has(name),
          onchange: (ev) => {
            if (ev.target.checked) this.selected.add(name);
            else this.selected.delete(name);
            this.load();
          },
        }), name);
    replace(this.picker,
      this.scalarNames.map((n) => box(n, "scalar")),
      this.eventNames.map((n) => box(n, "event")));
  }

  async load() {
    // loads overlap (a pick, a live refresh): only the latest one draws, or an older one finishing last
    // would draw the values picked before it
    const seq = (this.loads = (this.loads || 0) + 1);
    const stale = () => seq !== this.loads;
    const chosen = [...this.selected].filter((n) => this.scalarNames.includes(n) || this.eventNames.includes(n)).sort();
    this.empty.hidden = chosen.length > 0;
    if (!chosen.length) {
      if (this.drawn) (await plotly()).purge(this.plot);
      this.drawn = false;
      return;
    }
    const fromRun = chosen.filter((n) => this.scalarNames.includes(n)).slice(0, 16);
    const got = {};
    if (fromRun.length) {
      const query = fromRun.map((n) => `name=${encodeURIComponent(n)}`).join("&");
      let series;
      try {
        ({ series } = await api(`/runs/${this.runId}/series/multi?${query}&max_points=1500`));
      } catch (err) {
        if (stale()) return;
        this.empty.hidden = false;
        this.empty.className = "error";
        this.empty.textContent = `Could not load the scalars: ${err.message}`;
        return;
      }
      if (stale()) return;
      this.empty.className = "muted";
      this.empty.textContent = "Pick the values to chart.";
      this.empty.hidden = true;
      for (const n of fromRun) got[n] = { steps: series[n].steps, values: series[n].values.map(num) };
    }
    for (const n of chosen.filter((c) => !(c in got) && this.eventNames.includes(c))) {
      const dot = n.indexOf(".");
      got[n] = eventSeries(this.events, n.slice(0, dot), n.slice(dot + 1));
    }
    const names = chosen.filter((n) => n in got);
    const Plotly = await plotly();
    if (stale()) return;
    const gap = 0.06;
    const h = (1 - gap * (names.length - 1)) / names.length;
    const layout = { height: 60 + 150 * names.length, margin: { l: 70, r: 20, t: 10, b: 40 }, showlegend: false, xaxis: { title: { text: "step" }, anchor: `y${names.length === 1 ? "" : names.length}` } };
    layout.shapes = [];
    const bad = []; // a marker per span of non-finite values, named in its hover, after the lines
    const traces = names.map((n, i) => {
      const axis = i === 0 ? "" : String(i + 1);
      const top = 1 - i * (h + gap);
      // "~g": 8000 and 0.0003 as written, 1.2e+7 beyond (plotly's exponent form labelled tokens/s "0.8e+4")
      layout[`yaxis${axis}`] = { title: { text: plotlyText(n), font: { size: 11 } }, domain: [Math.max(0, top - h), top], tickformat: "~g" };
      const ev = !this.scalarNames.includes(n);
      const { steps, values } = got[n];
      const spans = nonfiniteSpans(steps, values);
      if (spans.length) {
        layout.shapes.push(...bandShapes(spans, { yref: `y${axis} domain` }));
        bad.push(spanMarkers(spans, steps, values, `non-finite ${n}`,
          { name: plotlyText(`${n}: non-finite`), yaxis: `y${axis}`, meta: { scalar: n, spans } }));
      }
      return {
        type: "scatter", mode: ev ? "lines+markers" : "lines", name: plotlyText(n), x: steps,
        y: values.map((v) => (Number.isFinite(v) ? v : null)), yaxis: `y${axis}`, line: { width: 1.3 },
      };
    });
    traces.push(...bad);
    if (this.dead) return;
    this.inflight = this.drawn ? Plotly.react(this.plot, traces, layout, { displaylogo: false, responsive: true })
      : Plotly.newPlot(this.plot, traces, layout, { displaylogo: false, responsive: true });
    await this.inflight;
    this.drawn = true;
  }

  async close() {
    this.dead = true;
    await Promise.allSettled([this.inflight]);
  }
}

/** The run's config (every key), its name and tags, which a token with the control scope can change. */
class ConfigPanel {
  constructor(container, runId, onSaved) {
    this.runId = runId;
    this.onSaved = onSaved;
    this.table = el("tbody");
    this.nameInput = el("input", { id: "run-rename", type: "text", maxlength: 200, size: 30, "aria-label": "run name" });
    this.tagsInput = el("input", { id: "run-tags", type: "text", size: 40, placeholder: "tags, space-separated", "aria-label": "tags" });
    this.save = el("button", { type: "submit", id: "run-save", class: "small" }, "Save");
    this.note = el("p", { class: "muted readonly-note", id: "run-edit-readonly" });
    this.error = el("p", { class: "error", id: "run-edit-error" });
    const form = el("form", { class: "controls", id: "run-edit" }, el("label", {}, "name ", this.nameInput), el("label", {}, "tags ", this.tagsInput), this.save);
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.submit();
    });
    container.append(this.note, form, this.error, el("table", { id: "config-table", class: "config" }, el("thead", {}, el("tr", {}, el("th", {}, "key"), el("th", {}, "value"))), this.table));
  }

  fill(run) {
    this.run = run;
    const rows = flattenConfig(run.config);
    replace(this.table, rows.length ? rows.map(([k, v]) => el("tr", { dataset: { key: k } }, el("td", { class: "name" }, k), el("td", { class: "name" }, configText(v))))
      : el("tr", {}, el("td", { colspan: 2, class: "muted" }, "The job sent no config.")));
    if (document.activeElement !== this.nameInput) this.nameInput.value = run.name;
    if (document.activeElement !== this.tagsInput) this.tagsInput.value = (run.tags || []).join(" ");
    const reason = auth.readOnlyReason();
    this.note.textContent = reason ? `Editing is disabled (${reason}).` : "";
    for (const input of [this.nameInput, this.tagsInput, this.save]) input.disabled = Boolean(reason);
  }

  async submit() {
    const { tags, error } = parseTags(this.tagsInput.value);
    this.error.textContent = error ? `not saved: ${error}` : "";
    if (error) return;
    try {
      const run = await api(`/runs/${this.runId}`, { method: "PATCH", body: { name: this.nameInput.value.trim(), tags } });
      this.onSaved(run);
    } catch (err) {
      this.error.textContent = `not saved: ${err.detail || err.message}`;
    }
  }
}

const SEVERITY_RANK = { ok: 0, info: 1, warning: 2, critical: 3 };

/** The diverging-layers table; clicking a layer opens its drill-down. */
class Layers {
  constructor(container, runId, onPick, openAlerts = () => []) {
    this.runId = runId;
    this.onPick = onPick;
    this.openAlerts = openAlerts;
    this.showAll = false;
    this.body = el("tbody");
    this.more = el("button", { type: "button", class: "small", hidden: true }, "Show all layers");
    this.more.addEventListener("click", () => {
      this.showAll = !this.showAll;
      this.fill();
    });
    container.append(
      el("table", { id: "layers-table", class: "layers" }, el("thead", {}, el("tr", {}, el("th", {}, "Layer"), el("th", {}, "Severity"),
        el("th", { title: "the worst latest SQNR of the layer's tensors (blank: the run sends no quality statistics)" }, "SQNR (dB)"),
        el("th", { title: "the widest latest block range log2(max/min|x|) of the layer's block-scaled tensors, and the largest share of blocks with the scale at a limit (blank: the run sends no block statistics)" }, "Block range"),
        el("th", {}, "Reasons"))), this.body),
      this.more,
    );
  }

  async load() {
    try {
      this.layers = await api(`/runs/${this.runId}/layers`);
      this.error = null;
    } catch (err) {
      this.error = err; // the last ranking stays, under the error
    }
    this.fill();
  }

  /** The engine's ranking, with every open alert counted at once: a layer never shows healthier than its
   * own open alerts while the ranking is being refreshed (the alerts and the table share one store). */
  merged() {
    const byLayer = new Map();
    for (const a of this.openAlerts()) {
      if (a.state !== "open" || !a.layer) continue;
      const worst = byLayer.get(a.layer);
      if (!worst || SEVERITY_RANK[a.severity] > SEVERITY_RANK[worst.severity]) byLayer.set(a.layer, a);
    }
    const layers = (this.layers || []).map((l) => {
      const a = byLayer.get(l.layer);
      if (!a || SEVERITY_RANK[a.severity] <= SEVERITY_RANK[l.severity]) return l;
      return { ...l, severity: a.severity, reasons: [`${a.kind}: ${a.message}`, ...(l.reasons || [])] };
    });
    return layers.sort((x, y) => SEVERITY_RANK[y.severity] - SEVERITY_RANK[x.severity]);
  }

  fill() {
    const layers = this.merged();
    const shown = this.showAll ? layers : layers.slice(0, 25);
    this.more.hidden = layers.length <= 25;
    this.more.textContent = this.showAll ? "Show the 25 worst" : `Show all ${layers.length} layers`;
    replace(
      this.body,
      this.error ? errorRow(5, "layers-error", `Could not load the layers: ${this.error.message}`) : null,
      shown.map((l) =>
        el(
          "tr",
          { class: "clickable", onclick: () => this.onPick(l.layer), title: "open the drill-down" },
          el("td", { class: "name" }, l.layer),
          el("td", {}, badge(l.severity, SEVERITY_KIND[l.severity] || "")),
          el("td", { class: "num sqnr" }, sqnrText(l.sqnr_db)),
          el("td", { class: "num block-range" }, blockText(l.block_range, l.block_at_limit, l.block_zero)),
          el("td", { class: "reasons-cell" }, reasonsList(l.reasons || [])),
        ),
      ),
    );
  }
}

/** A layer's SQNR in dB to one decimal ("" when it has none, "+Inf" for an exact round trip). */
function sqnrText(value) {
  if (value === null || value === undefined) return "";
  const v = num(value);
  return Number.isFinite(v) ? v.toFixed(1) : fmt(v);
}

/** A layer's worst block range in binades, with its share of blocks at a scale limit (values the format
 * could not follow) and, apart, its share of all-zero blocks (sparsity, padding: nothing lost), when there
 * are any. */
function blockText(range, atLimit, zero) {
  if (range === null || range === undefined) return "";
  const r = num(range);
  const text = Number.isFinite(r) ? r.toFixed(1) : fmt(r);
  const parts = [[atLimit, "at limit"], [zero, "zero"]]
    .filter(([share]) => num(share) > 0)
    .map(([share, what]) => `${percent(num(share))}% ${what}`);
  return parts.length ? `${text} (${parts.join(", ")})` : text;
}

/** A share in percent to one decimal; under 0.05% it is not "0.0%": some blocks are there. */
function percent(share) {
  return share < 0.0005 ? "<0.1" : (100 * share).toFixed(1);
}

/** A table row that says a request failed (instead of an empty table). */
export function errorRow(colspan, id, text) {
  return el("tr", { class: "error-row" }, el("td", { colspan, class: "error", id }, text));
}

/** A layer's reasons folded into one line: the first, cut to the cell's width, and a button that unfolds
 * the rest (a NaN run's 16 layers repeating every alert's text filled pages); a click on the line itself
 * opens the layer's drill-down as anywhere on the row. */
function reasonsList(reasons) {
  if (!reasons.length) return el("span", { class: "muted" }, "healthy");
  const line = el("span", { class: "reason-line", title: reasons[0] }, reasons[0]);
  if (reasons.length === 1) return el("div", { class: "reasons-fold" }, line);
  const rest = el("ul", { class: "reasons", hidden: true }, reasons.slice(1).map((r) => el("li", {}, r)));
  const more = el("button", {
    type: "button", class: "small reasons-more", "aria-expanded": "false", title: "show every reason",
    onclick: (ev) => {
      ev.stopPropagation();
      rest.hidden = !rest.hidden;
      more.setAttribute("aria-expanded", String(!rest.hidden));
      more.textContent = rest.hidden ? `+${reasons.length - 1}` : "less";
    },
  }, `+${reasons.length - 1}`);
  return [el("div", { class: "reasons-fold" }, line, more), rest];
}

/** The drill-down's heading: the layer's name as it is spelled (not upper-cased as headings are), on one line. */
function drillHead(layer) {
  return el("h3", { class: "drill-head" }, "Layer ", el("span", { class: "name", id: "drilldown-layer", title: layer }, layer));
}

/** amax, scale, overflow, underflow, non-finite (and SQNR) lines of one layer's tensors; the steps where any
 * of them counted non-finite elements as bands across every panel (a tensor gone all NaN has no amax: NaN,
 * which the log axis leaves out, so the counts are what say where the values went). One request, of only
 * the layer's rows. */
async function drillDown(container, runId, layer) {
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

export async function mountRun(container, { runId, incident = null, metric = null }) {
  // the page's shared state (run, tensors, events); the panels render from it
  const store = new RunStore(runId);
  const runRequest = store.loadRun(); // in flight while the page is laid out
  const drawnAt = {};
  const paintedAt = {};
  // the moment a plot's pixels are on screen: after the frame that follows drawing it (canvas or plotly)
  const onPainted = (kind) => {
    if (kind in paintedAt) return;
    paintedAt[kind] = null;
    afterPaint(() => {
      paintedAt[kind] = performance.now();
      window.fp8scope.painted[kind] = paintedAt[kind];
    });
  };
  const onDrawn = (kind) => {
    if (!(kind in drawnAt) && dataLoaded[kind]) {
      drawnAt[kind] = performance.now();
      window.fp8scope.drawn[kind] = drawnAt[kind];
      onPainted(kind);
    }
  };
  const dataLoaded = {};
  // first paint without plotly.js: the heatmap and the curves on canvases as soon as their data is here;
  // plotly.js (loaded meanwhile by the page's preload) is compiled only after that frame is on screen
  const preview = window.fp8scope.preview && !window.Plotly;
  const firstFrames = { heatmap: null, curves: null };
  const framed = Object.fromEntries(Object.keys(firstFrames).map((kind) => [kind, new Promise((resolve) => {
    firstFrames[kind] = (painted) => {
      if (painted) onPainted(kind);
      resolve();
    };
  })]));
  if (preview) deferPlotly(Promise.all(Object.values(framed)).then(() => new Promise(afterPaint)));
  const header = el("div", { class: "run-head" });
  const postPanel = panel("Post-mortem");
  postPanel.id = "postmortem";
  const curvesPanel = panel("Loss, grad norm and learning rate");
  const scalarsPanel = panel("Scalars");
  scalarsPanel.id = "scalars";
  const configPanel = panel("Config");
  configPanel.id = "config";
  const heatPanel = panel("Per-tensor heatmap");
  const blockPanel = panel("Block scale exponents");
  blockPanel.id = "block-hist";
  const layersPanel = panel("Diverging layers");
  const drillPanel = el("section", { class: "panel", id: "drilldown", hidden: true });
  const alertsPanel = panel("Incidents");
  alertsPanel.id = "incidents";
  const recipePanel = panel("Recipe");
  recipePanel.id = "recipe";
  // what went wrong first: the verdict under the header, the incidents before the per-layer table
  const verdict = new Verdict((id) => alerts.reveal(id));
  replace(
    container,
    header,
    verdict.node,
    curvesPanel,
    heatPanel,
    el("div", { class: "two-col" }, alertsPanel, layersPanel),
    drillPanel,
    postPanel,
    blockPanel,
    scalarsPanel,
    el("div", { class: "two-col" }, configPanel, recipePanel),
  );

  const downloads = downloadMenu(runId);
  // a count in the header is a link to the incidents panel
  const toIncidents = (id, count) => el("a", {
    id, href: "#incidents", title: "show the incidents",
    onclick: (ev) => {
      ev.preventDefault();
      alerts.reveal(null);
    },
  }, String(count));
  function renderHeader() {
    const r = store.get("run");
    replace(
      header,
      el("h1", { id: "run-name" }, r.name),
      statusBadge(r.status, r.last_loss),
      sourceBadge(r),
      el("span", { id: "run-tags-list", class: "tags" }, (r.tags || []).map((t) => el("a", { class: "tag", href: `#/?tag=${encodeURIComponent(t)}` }, t))),
      el("dl", { class: "facts" },
        el("dt", {}, "last step"), el("dd", { id: "run-last-step" }, r.last_step === null ? "–" : String(r.last_step)),
        el("dt", {}, "last loss"), el("dd", { id: "run-last-loss" }, fmt(num(r.last_loss))),
        el("dt", {}, "steps stored"), el("dd", { id: "run-steps-stored" }, String(r.steps_stored)),
        el("dt", {}, "tensors"), el("dd", {}, String(r.num_tensors)),
        el("dt", {}, "host"), el("dd", {}, r.host || "–"),
        el("dt", {}, "open incidents"), el("dd", {}, toIncidents("run-open-incidents", r.open_incidents ?? 0)),
        el("dt", {}, "open alerts"), el("dd", {}, toIncidents("run-open-alerts", r.open_alerts))),
      el("a", { href: `#/compare?a=${r.id}`, class: "small" }, "Compare with another run…"),
      downloads, // the same element each time: what is typed in it survives the header's redraws
    );
    // run notes (web/js/notes.js): shown and edited under the verdict, the editor kept across its redraws
    mountNotes(verdict.node, r, (run) => store.set("run", run));
  }
  const curves = new Curves(curvesPanel, runId, onDrawn, preview ? firstFrames.curves : null,
    (loss) => verdict.setLoss(loss.steps, loss.values));
  const scalars = new Scalars(scalarsPanel, runId);
  const config = new ConfigPanel(configPanel, runId, (run) => store.set("run", run));
  const heatmap = new Heatmap(heatPanel, { runId, metric, onDrawn, firstPaint: preview ? firstFrames.heatmap : null });
  const layers = new Layers(layersPanel, runId, async (layer) => {
    drillPanel.hidden = false;
    try {
      await drillDown(drillPanel, runId, layer);
      drillPanel.scrollIntoView({ behavior: "smooth", block: "start" });
    } catch (err) {
      replace(drillPanel, el("p", { class: "error" }, `drill-down failed: ${err.message}`));
    }
  }, () => store.get("alerts"));
  const post = new PostMortem(postPanel, runId, heatmap);
  const alerts = new IncidentsPanel(alertsPanel, runId, {
    focus: incident,
    onChange: (list) => store.set("alerts", list),
    onIncidents: (list, err) => verdict.setIncidents(list, err),
  });
  // the alerts (kept by the incidents panel, which loads them and takes the live ones) as markers on the
  // curves, in the post-mortem, and counted at once in the layers' ranking
  store.subscribe("alerts", (list, s) => {
    curves.setMarkers(list, s.get("events"));
    post.update(s.get("run"), list, s.get("events"));
    layers.fill();
  });
  const recipe = new RecipeEditor(recipePanel, runId, store);
  // where each applied recipe change took effect, on the curves and the heatmap (loaded, posted, streamed)
  store.subscribe("commands", (commands) => {
    const changes = appliedChanges(commands);
    curves.setChanges(changes);
    heatmap.setChanges(changes);
  });
  const blockHist = new BlockHistPanel(blockPanel, runId, store);
  // the layers table says whether the run sends block statistics (and which tensor has the widest blocks)
  const loadLayers = () => layers.load().then(() => blockHist.update(layers.layers)).catch((err) => console.warn("block histogram", err));

  // until the first loads are done only the header follows the run; the panels are filled in order below
  let ready = false;
  store.subscribe("run", (run) => {
    if (!run) return; // the first request failed: the page reports it
    renderHeader();
    verdict.setRun(run);
    if (!ready) return;
    recipe.setRun(run);
    config.fill(run);
    scalars.setSources(run, store.get("events"));
    post.update(run, store.get("alerts"), store.get("events"));
  });
  // the events feed the curves' markers and evaluation curve, the scalars picker and the post-mortem: a
  // failed request says so under the curves (the rest still draws, without them)
  const eventsError = el("p", { class: "error", id: "events-error", hidden: true });
  curvesPanel.append(eventsError);
  store.subscribe("events", (events, s) => {
    const failed = s.error("events");
    eventsError.hidden = !failed;
    eventsError.textContent = failed ? `Could not load the run's events (markers, evaluations): ${failed.message}` : "";
    if (!ready) return;
    post.update(s.get("run"), s.get("alerts"), events);
    curves.setMarkers(s.get("alerts"), events);
    scalars.setSources(s.get("run"), events);
  });
  const refreshRun = throttle(async () => {
    const run = await store.loadRun();
    if (run.last_step !== null) stepSeen(runId, run.last_step);
  }, 1000);
  // every trace follows a live run: the curves and the picked scalars are re-read every few seconds
  const refreshCurves = throttle(() => {
    curves.load().catch((err) => console.warn("curves", err));
    scalars.load().catch((err) => console.warn("scalars", err));
  }, 3000);
  // live steps redraw the heatmap every few seconds, fetching only the buckets after those it holds; a big
  // one (500 tensors x 1000 buckets takes the browser most of a second to draw) less often, so the page
  // stays responsive during a run
  const refreshHeatmap = throttle(() => {
    heatmap.refresh().catch((err) => console.warn("heatmap", err));
  }, () => Math.max(3000, heatmap.data ? (heatmap.data.T * heatmap.data.C) / 60 : 0));
  const refreshLayers = throttle(loadLayers, 4000);

  const onAuth = () => {
    alerts.fill();
    recipe.fill();
    if (store.get("run")) config.fill(store.get("run"));
  };
  auth.listeners.add(onAuth);
  // first paint: heatmap and curves in parallel with the panels
  const heatLoad = heatmap.load().then(() => {
    dataLoaded.heatmap = true;
    onDrawn("heatmap");
  });
  const curvesLoad = curves.load().then(() => {
    dataLoaded.curves = true;
    onDrawn("curves");
  });
  // when the run itself cannot be read (e.g. 401) these fail too; that failure is reported once, below.
  // A failed load has no first frame: plotly.js is not held back for it.
  heatLoad.catch(() => firstFrames.heatmap(false));
  curvesLoad.catch(() => firstFrames.curves(false));
  let run;
  try {
    run = await runRequest;
  } catch (err) {
    auth.listeners.delete(onAuth);
    heatmap.close();
    curves.close();
    throw err;
  }
  // the panels' requests go out once the plots have their data: they would compete with those for the
  // server's time and delay the first full paint
  await Promise.all([heatLoad, curvesLoad]);
  // the heatmap's header carries the tensor list: the page needs no request of its own for it
  if (heatmap.data && !store.get("tensors")) store.set("tensors", heatmap.data.tensors);
  config.fill(run);
  await Promise.all([
    Promise.all([store.loadEvents(), post.loadNonfinite()]).then(() => {
      scalars.setSources(store.get("run"), store.get("events"));
      return Promise.all([alerts.load(), scalars.load()]);
    }),
    loadLayers(),
    recipe.load(run),
  ]);
  ready = true;

  let opens = 0;
  const pendingLoss = [];
  const flushLoss = throttle(() => {
    curves.appendLoss(pendingLoss.splice(0));
  }, 250);
  const stream = subscribe(
    `/runs/${runId}/stream`,
    {
      step(d) {
        const r = store.get("run");
        if (r.last_step === null || d.step > r.last_step) {
          r.last_step = d.step;
          r.last_loss = d.loss;
          document.getElementById("run-last-step").textContent = String(d.step);
          document.getElementById("run-last-loss").textContent = fmt(num(d.loss));
        }
        if (d.steps_stored > r.steps_stored) {
          // beside the last step, the count follows it too (it stayed at the page's first fetch, so a live
          // run read "last step 263, steps stored 221": steps that looked lost)
          r.steps_stored = d.steps_stored;
          document.getElementById("run-steps-stored").textContent = String(r.steps_stored);
        }
        stepSeen(runId, d.step);
        if (d.loss !== null && d.loss !== undefined) pendingLoss.push({ step: d.step, loss: num(d.loss) });
        flushLoss();
        refreshCurves();
        refreshHeatmap();
        refreshLayers();
      },
      alert(a) {
        alerts.upsertAlert(a);
        refreshLayers();
        refreshRun();
      },
      incident(i) {
        alerts.upsertIncident(i);
        refreshRun();
      },
      replay_request(r) {
        alerts.replays.upsertRequest(r);
      },
      command(c) {
        store.upsertCommand(c);
        if (c.state === "applied") refreshRun();
      },
      event(e) {
        store.pushEvent(e);
        refreshCurves();
      },
      run(d) {
        store.set("run", { ...store.get("run"), ...(d.status ? { status: d.status } : {}), ...(d.name ? { name: d.name } : {}) });
        refreshRun(); // tags, scalar names
      },
    },
    {
      onopen: () => {
        refreshRun(); // steps stored between the first fetch and the connection
        store.loadEvents().then(refreshCurves); // and events (merged by id with what the stream brings)
        if (opens++) {
          // reconnected: catch up on what the stream missed meanwhile
          alerts.load();
          store.loadCommands();
          if (!heatmap.range) heatmap.load().catch((err) => console.warn("heatmap", err)); // all of it: steps may have come in any order
        }
      },
    },
  );
  return {
    destroy() {
      stream.close();
      auth.listeners.delete(onAuth);
      const plots = [...container.querySelectorAll(".js-plotly-plot")];
      // purge (dropping plotly's resize listeners) only once no redraw is half way
      Promise.allSettled([heatmap.close(), curves.close(), scalars.close()]).then(() => plots.forEach((gd) => window.Plotly.purge(gd)));
    },
  };
}

