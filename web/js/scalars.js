// The run page's scalars: any scalar the job sent and the numbers of its custom events, picked from a list,
// one chart each on a shared step axis.

import { api, num } from "./api.js";
import { el, plotly, plotlyText, replace } from "./dom.js";
import { eventScalarNames, eventSeries } from "./events.js";
import { bandShapes, nonfiniteSpans, spanMarkers } from "./nonfinite.js";

/** Shown at first when the run has them: the values a user looks at beside the loss. */
const DEFAULT_SCALARS = ["eval.val_loss", "tokens_per_s", "step_time_s", "accuracy"];

/** Any scalar the job sent, and the numbers of its custom events (eval.val_loss, ...), picked from a list:
 * one chart each on a shared step axis, refreshed live. */
export class Scalars {
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
