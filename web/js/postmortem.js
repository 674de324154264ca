// Post-mortem: the run's first non-finite value (step, tensor), outlined on the heatmap, and a timeline of
// the steps before each loss spike, from the client event's flight recorder ("last_steps") when it sent
// one, else from the stored loss series.

import { api, num, qs } from "./api.js";
import { el, fmt, plotly, plotlyText, replace } from "./dom.js";

const SPIKE_WINDOW = 64; // steps shown before a spike when no flight recorder came with it
const MAX_TIMELINES = 6;
const MAX_STRIPS = 12; // series drawn per timeline (a flight recorder may carry any number)
const STRIP_PX = 48; // height of one series' strip
const STRIP_GAP = 0.18; // of a strip, left empty below it

/** The run's first non-finite value: {step, tensorIndex, name} from the nonfinite alerts (their evidence
 * names the run's first) or, failing that, from the earliest nonfinite client event. */
export function firstNonfinite(alerts, events, tensors) {
  let best = null;
  for (const a of alerts) {
    if (a.kind !== "nonfinite") continue;
    const first = (a.evidence && a.evidence.run_first) || { step: a.first_step, tensor_index: a.tensor_index, name: a.tensor_name };
    if (best === null || first.step < best.step) best = { step: first.step, tensorIndex: first.tensor_index, name: first.name || "loss" };
  }
  if (best) return best;
  for (const e of events) {
    if (e.kind !== "nonfinite") continue;
    if (best === null || e.step < best.step) {
      const d = e.details || {};
      const name = typeof d.tensor === "string" ? d.tensor : typeof d.name === "string" ? d.name : null;
      const t = name && tensors ? tensors.find((x) => x.name === name) : null;
      best = { step: e.step, tensorIndex: t ? t.index : null, name: name || "unknown tensor" };
    }
  }
  return best;
}

/** Flight-recorder steps of an event as {steps, series: {name: values}}; accepts a list of per-step
 * objects ([{step, loss, ...}]) or an object of columns ({step(s): [...], loss: [...]}). */
export function flightSteps(details) {
  const rec = details && details.last_steps;
  if (!rec) return null;
  const series = {};
  let steps = [];
  if (Array.isArray(rec)) {
    const rows = rec.filter((r) => r && typeof r === "object" && Number.isFinite(Number(r.step)));
    steps = rows.map((r) => Number(r.step));
    for (const r of rows) {
      const scalars = r.scalars && typeof r.scalars === "object" ? { ...r, ...r.scalars } : r;
      for (const [k, v] of Object.entries(scalars)) {
        if (k === "step" || (typeof v !== "number" && typeof v !== "string")) continue;
        if (num(v) === null) continue;
        (series[k] ||= new Array(rows.length).fill(null));
      }
    }
    rows.forEach((r, i) => {
      const scalars = r.scalars && typeof r.scalars === "object" ? { ...r, ...r.scalars } : r;
      for (const k of Object.keys(series)) series[k][i] = num(scalars[k]);
    });
  } else if (typeof rec === "object") {
    steps = (rec.steps || rec.step || []).map(Number);
    const scalars = rec.scalars && typeof rec.scalars === "object" ? { ...rec, ...rec.scalars } : rec;
    for (const [k, v] of Object.entries(scalars)) {
      if (k === "steps" || k === "step" || !Array.isArray(v) || v.length !== steps.length) continue;
      if (v.every((x) => typeof x === "number" || typeof x === "string" || x === null)) series[k] = v.map(num);
    }
  }
  return steps.length ? { steps, series } : null;
}

export class PostMortem {
  constructor(container, runId, heatmap) {
    this.runId = runId;
    this.heatmap = heatmap;
    this.container = container;
    this.body = el("div", { id: "postmortem-body" });
    container.append(this.body);
    container.hidden = true;
    this.drawnSpikes = "";
  }

  /** Re-derive the post-mortem from the run, its alerts, its client events and the nonfinite alerts a full
   * alert list may have left out (the page's store reads them apart then: each names the run's first
   * non-finite value in its evidence). */
  update(run, alerts, events, nonfinite = []) {
    if (!run) return;
    this.run = run;
    const byId = new Map((nonfinite || []).map((a) => [a.id, a]));
    for (const a of alerts) if (a.kind === "nonfinite") byId.set(a.id, a);
    const first = firstNonfinite([...byId.values()], events, this.heatmap.data && this.heatmap.data.tensors);
    const spikes = new Map();
    for (const e of events) if (e.kind === "loss_spike" && !spikes.has(e.step)) spikes.set(e.step, { step: e.step, event: e });
    for (const a of alerts) {
      if (a.kind !== "loss_spike") continue;
      const s = spikes.get(a.first_step) || { step: a.first_step };
      s.alert = a;
      spikes.set(a.first_step, s);
    }
    const list = [...spikes.values()].sort((a, b) => a.step - b.step).slice(0, MAX_TIMELINES);
    // how the run ended is the verdict's line under the header: this panel shows only what it adds
    this.container.hidden = !first && !list.length;
    const key = JSON.stringify([first, list.map((s) => [s.step, Boolean(s.event), Boolean(s.alert)])]);
    if (key === this.drawnSpikes) return;
    this.drawnSpikes = key;
    const parts = [];
    if (first) {
      const label = `first non-finite: ${first.name} at step ${first.step}`;
      const go = el("button", { type: "button", class: "small", id: "show-first-nonfinite" }, "Show in heatmap");
      go.addEventListener("click", () => {
        this.heatmap.zoomTo(first.step - 32, first.step + 32);
        this.heatmap.plot.scrollIntoView({ behavior: "smooth", block: "center" });
      });
      parts.push(el("div", { class: "first-nonfinite", id: "first-nonfinite" },
        el("b", {}, "First non-finite value: "), el("span", { class: "name" }, first.name), ` at step ${first.step} `, go));
      if (first.tensorIndex !== null && first.tensorIndex !== undefined) this.heatmap.setMarker({ step: first.step, tensorIndex: first.tensorIndex, label });
    }
    const timelines = el("div", { class: "timelines" });
    if (list.length) parts.push(el("h3", {}, "Before each loss spike"), timelines);
    replace(this.body, parts);
    for (const s of list) this.timeline(timelines, s);
  }

  async timeline(container, spike) {
    const plot = el("div", { class: "timeline-plot" });
    const source = el("p", { class: "muted" });
    let details = spike.event ? spike.event.details : null;
    const box = el("div", { class: "timeline", dataset: { step: spike.step } }, el("h4", {}, `spike at step ${spike.step}`), source, plot);
    container.append(box);
    if (spike.event && spike.event.details_complete === false) {
      // lists carry big details (a flight recorder) as their summary: this one is fetched whole
      try {
        details = (await api(`/runs/${this.runId}/events/${spike.event.id}`)).details;
      } catch (err) {
        console.warn("event", err);
      }
    }
    let rec = flightSteps(details);
    if (rec) {
      source.textContent = `flight recorder: ${rec.steps.length} steps sent with the event`;
    } else {
      const from = Math.max(0, spike.step - SPIKE_WINDOW);
      const [loss, grad] = await Promise.all(
        ["loss", "grad_norm"].map((name) => api(`/runs/${this.runId}/series${qs({ name, from, to: spike.step, max_points: 500 })}`)),
      );
      rec = { steps: loss.steps, series: { loss: loss.values.map(num) } };
      if (grad.steps.length === loss.steps.length) rec.series.grad_norm = grad.values.map(num);
      source.textContent = `stored series: steps ${from}–${spike.step}`;
    }
    if (spike.alert) box.append(el("p", { class: "alert-msg" }, spike.alert.message));
    if (details && details.histograms && typeof details.histograms === "object") {
      box.append(el("details", {}, el("summary", {}, "exponent histograms sent with the event"),
        el("pre", { class: "json" }, JSON.stringify(details.histograms, null, 1).slice(0, 20000))));
    }
    // small multiples: a strip per series, each on its own y axis, all on the step axis (one axis for
    // series of different units hid most of them, and a legend of a dozen names covered the plot)
    const all = Object.keys(rec.series).sort((x, y) => (y === "loss") - (x === "loss"));
    const names = all.slice(0, MAX_STRIPS);
    if (all.length > names.length) {
      box.append(el("p", { class: "muted" }, `${all.length - names.length} more series in the event, not drawn`));
    }
    const strip = 1 / Math.max(1, names.length);
    const axis = (i) => (i === 0 ? "y" : `y${i + 1}`);
    const layout = {
      height: 45 + STRIP_PX * Math.max(2, names.length), margin: { l: 50, r: 10, t: 10, b: 35 },
      xaxis: { title: { text: "step" }, anchor: axis(names.length - 1) }, showlegend: false, hovermode: "x unified",
      annotations: [], shapes: [],
    };
    const traces = names.map((name, i) => {
      const top = 1 - i * strip;
      layout[i === 0 ? "yaxis" : `yaxis${i + 1}`] = {
        domain: [Math.max(0, top - strip + STRIP_GAP * strip), top], nticks: 3, tickfont: { size: 9 }, zeroline: false,
      };
      layout.annotations.push({
        xref: "paper", yref: "paper", x: 0.01, y: top, xanchor: "left", yanchor: "top", showarrow: false,
        text: plotlyText(name), font: { size: 10 }, bgcolor: "rgba(255,255,255,0.7)",
      });
      return {
        type: "scatter", mode: "lines+markers", name: plotlyText(name), x: rec.steps,
        y: rec.series[name].map((v) => (Number.isFinite(v) ? v : null)), yaxis: axis(i), marker: { size: 3 },
      };
    });
    const lossAt = names.indexOf("loss");
    if (lossAt >= 0) {
      traces.push({
        type: "scatter", mode: "markers", name: "spike", x: [spike.step], yaxis: axis(lossAt),
        y: [rec.series.loss[rec.steps.indexOf(spike.step)] ?? null],
        marker: { symbol: "x", size: 10, color: "#d62728" }, hovertemplate: `spike at step ${spike.step}<extra></extra>`,
      });
    }
    // the spike's step through every strip, and each step with a non-finite value in magenta
    layout.shapes.push({ type: "line", x0: spike.step, x1: spike.step, yref: "paper", y0: 0, y1: 1, line: { color: "#d62728", dash: "dot", width: 1 } });
    const nonfinite = rec.steps.filter((_, i) => names.some((n) => rec.series[n][i] !== null && !Number.isFinite(rec.series[n][i])));
    for (const s of nonfinite) layout.shapes.push({ type: "line", x0: s, x1: s, yref: "paper", y0: 0, y1: 1, line: { color: "#ff00ff", dash: "dash" } });
    await (await plotly()).newPlot(plot, traces, layout, { displaylogo: false, responsive: true });
    box.dataset.points = String(rec.steps.length);
    box.title = `values: ${names.map((n) => `${n} last ${fmt(rec.series[n][rec.series[n].length - 1])}`).join(", ")}`;
  }
}
