// Block-scaled tensors (MXFP8 1x32 blocks with E8M0 scales, FP8 block scaling 1x128 / 128x128): a tensor's
// block scale exponent histogram over steps (GET /runs/{id}/block-histogram) as a heatmap: x the step
// (bucket start), y the scale_inv's unbiased binary exponent (E8M0 code − 127), z the blocks there, summed
// over the bucket's steps. Shown only for a run that sends block statistics (the layers table says so).

import { api, num, qs } from "./api.js";
import { el, fmt, plotly, plotlyText, replace } from "./dom.js";
import { noteDrawn, noteQuery } from "./hooks.js";

export class BlockHistPanel {
  /** `container`: the panel (hidden until the run has block statistics); `store`: the page's RunStore. */
  constructor(container, runId, store) {
    this.container = container;
    this.runId = runId;
    this.store = store;
    this.tensor = null; // index shown; chosen once, then the user's
    this.drawnAt = -Infinity; // when the last answer came (performance.now())
    this.cost = 0; // how long it took: a long run's histogram is re-read less often
    this.select = el("select", { id: "block-hist-tensor", "aria-label": "tensor" });
    this.select.addEventListener("change", () => {
      this.tensor = Number(this.select.value);
      this.draw();
    });
    this.info = el("span", { class: "muted", id: "block-hist-info" });
    this.plot = el("div", { id: "block-hist-plot" });
    this.error = el("p", { class: "error", id: "block-hist-error", hidden: true });
    container.hidden = true;
    container.append(
      el("div", { class: "controls" }, this.select, this.info),
      el("p", { class: "hint muted" }, "Blocks per binade of their scale (unbiased exponent of scale_inv), per step bucket; a block scale pinned at the format's limit sits at the top or bottom row."),
      this.plot,
      this.error,
    );
  }

  /** Show the panel when the layers (GET /runs/{id}/layers) carry block statistics; the first time, pick
   * the tensor with the widest block range. */
  async update(layers) {
    const tensors = (layers || []).flatMap((l) => l.tensors || []);
    const blocky = tensors.filter((t) => t.block_range !== null && t.block_range !== undefined);
    if (!blocky.length) return;
    this.container.hidden = false;
    if (this.tensor === null) {
      const widest = blocky.reduce((a, b) => (num(b.block_range) > num(a.block_range) ? b : a));
      this.tensor = widest.index;
      const all = await this.store.tensors();
      replace(this.select, all.map((t) => el("option", { value: String(t.index) }, t.name)));
      this.select.value = String(this.tensor);
    }
    // live refreshes: at most one every 4 s, and a slow answer (a long run) spaced out to 1/20 of the time
    if (performance.now() - this.drawnAt < Math.max(4000, 20 * this.cost)) return;
    await this.draw();
  }

  async draw() {
    const width = Math.max(100, (this.plot.clientWidth || 900) - 160);
    const query = { tensor: this.tensor, max_steps: Math.round(width) };
    let h;
    const started = performance.now();
    try {
      h = await api(`/runs/${this.runId}/block-histogram${qs(query)}`);
      this.drawnAt = performance.now();
      this.cost = this.drawnAt - started;
      this.error.hidden = true;
    } catch (err) {
      this.error.hidden = false;
      this.error.textContent = `Could not load the block histogram: ${err.message}`;
      return;
    }
    noteQuery("blockHistQuery", query);
    if (!h.counts.length) {
      this.info.textContent = "no block histograms for this tensor";
      replace(this.plot);
      return;
    }
    this.info.textContent = `${h.bucket_steps.reduce((a, b) => a + b, 0)} steps, ${h.bucket_width} a bucket`;
    const exponents = [];
    for (let e = h.exponent_lo; e <= h.exponent_hi; e++) exponents.push(e - h.exponent_bias);
    // z[exponent][bucket]; an empty cell is left blank rather than drawn as the scale's low end
    const z = exponents.map((_, j) => h.counts.map((row) => (row[j] > 0 ? row[j] : null)));
    const trace = {
      type: "heatmap", x: h.bucket_start, y: exponents, z, colorscale: "Viridis",
      colorbar: { title: { text: "blocks" } }, xgap: 0, ygap: 0,
      hovertemplate: `${plotlyText(h.tensor.name)}<br>step %{x}<br>scale_inv 2^%{y}<br>%{z} blocks<extra></extra>`,
    };
    const layout = {
      height: 320, margin: { l: 60, r: 20, t: 10, b: 40 },
      xaxis: { title: { text: "step (bucket start)" } },
      yaxis: { title: { text: "log2 scale_inv" }, dtick: Math.max(1, Math.ceil(exponents.length / 12)) },
    };
    await (await plotly()).react(this.plot, [trace], layout, { displaylogo: false, responsive: true });
    noteDrawn("blockhist", { first: true });
    this.info.title = `exponents 2^${fmt(exponents[0])} to 2^${fmt(exponents[exponents.length - 1])}`;
  }
}
