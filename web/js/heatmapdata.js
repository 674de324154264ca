// The heatmap's data, apart from its drawing: what each metric is (label, aggregation, colours), the
// packed answer of `GET /runs/{id}/heatmap/packed` unpacked into typed-array views, a live run's new buckets
// merged into those held, and a raw cell value turned into a colour or an overlay code. Shared by the run
// page's heatmap, its drill-down and the comparison's difference.

import { apiBinary, qs } from "./api.js";

// the quantization-quality scales, as plotly colour scales so that the canvas first frame draws the same
// colours: ColorBrewer RdYlGn (SQNR: low, the bad end, is red) and YlOrRd (the others: high is bad)
const RED_YELLOW_GREEN = [[0, "#a50026"], [0.25, "#f46d43"], [0.5, "#fee08b"], [0.75, "#66bd63"], [1, "#006837"]];
const YELLOW_ORANGE_RED = [[0, "#ffffcc"], [0.25, "#fed976"], [0.5, "#fd8d3c"], [0.75, "#e31a1c"], [1, "#800026"]];

/** Each heatmap metric: label, the server's bucket aggregation, colour scale and bar title, and the unit
 * its raw values are shown in (hover). */
export const METRICS = {
  amax: { label: "amax (log2)", agg: "max", colorscale: "Viridis", colorbar: "log2 amax", unit: "" },
  scale: { label: "scale (log2)", agg: "max", colorscale: "Cividis", colorbar: "log2 scale", unit: "" },
  overflow: { label: "overflow (count)", agg: "sum", colorscale: "Reds", colorbar: "log10(1+count)", unit: "" },
  underflow: { label: "underflow (count)", agg: "sum", colorscale: "Blues", colorbar: "log10(1+count)", unit: "" },
  nonfinite: { label: "non-finite (count)", agg: "sum", colorscale: "Purples", colorbar: "log10(1+count)", unit: "" },
  // the colours span at least -1 to 4 binades: current scaling's headrooms are all 0 up to float rounding,
  // which a range fitted to the data spread over the whole scale as a random pattern (±80 nano-binades)
  headroom: { label: "headroom log2(FP8_MAX/(amax·scale))", agg: "min", colorscale: "YlGnBu", colorbar: "headroom (binades)", unit: " binades", span: [-1, 4] },
  sqnr: { label: "SQNR (dB, worst of bucket)", agg: "min", colorscale: RED_YELLOW_GREEN, colorbar: "SQNR (dB)", unit: " dB" },
  subnormal: { label: "subnormal (% of values, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "% subnormal", unit: "" },
  dynamic_range: { label: "dynamic range log2(amax/min|x|) (binades, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "binades", unit: " binades" },
  outlier_ratio: { label: "outlier ratio amax/RMS (log10, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "log10(amax/RMS)", unit: "× RMS" },
  // block-scaled tensors (MXFP8, FP8 block scaling): shares of the tensor's blocks, and the worst block's range
  block_at_limit: { label: "blocks with the scale at a limit (% of blocks, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "% of blocks", unit: "" },
  block_overflow: { label: "blocks that saturated (% of blocks, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "% of blocks", unit: "" },
  block_underflow: { label: "blocks that flushed to zero (% of blocks, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "% of blocks", unit: "" },
  block_range: { label: "worst block's range log2(max/min|x|) (binades, max)", agg: "max", colorscale: YELLOW_ORANGE_RED, colorbar: "binades", unit: " binades" },
};
export const ROLE_ORDER = { input: 0, weight: 1, grad_output: 2 };
/** overlay categories: code -> [legend name, colour] */
export const SPECIAL = {
  1: ["NaN", "#ff00ff"],
  2: ["+Inf", "#111111"],
  3: ["-Inf", "#00bcd4"],
  4: ["saturated (values lost at the FP8 max)", "#ff7f00"],
  // a cell whose tensor had NaN/Inf elements (the nonfinite count), whatever the metric shows there: an amax
  // ignores NaN, so a tensor with a few has a normal one (a tensor gone all NaN has none: stored as NaN)
  5: ["non-finite elements", "#ff00ff", "square-open"],
};
/** Per FP8 format, the headroom below which values were lost to saturation: log2(FP8 max / the value where a
 * scaled element stops rounding to the max: 464 in e4m3, 61440 in e5m2). Between it and 0, amax·scale rounds
 * to the max and nothing is lost (delayed scaling with margin 0 sits there whenever the amax repeats its
 * history maximum): the service's saturation states say the same (`at_max` is not saturation). */
export const SATURATED_BELOW = { e4m3: Math.log2(448 / 464), e5m2: Math.log2(57344 / 61440) };

/** Fetch `GET /runs/{id}/heatmap/packed` and unpack it (layout: fp8_protocol/packed.py; `params.metrics`
 * several metrics of the same buckets, `params.tensors` or `params.layer` only some rows): the first metric's
 * view (`unpackHeatmap`), each metric's in `byMetric`. */
export async function fetchHeatmap(runId, params) {
  return unpackHeatmap(await apiBinary(`/runs/${runId}/heatmap/packed${qs(params)}`));
}

/** The views of a packed heatmap answer, one per metric over the same buffer: the JSON header's fields plus
 * T (rows: the answer's `tensors`), C, `vals` (Float64Array of the metric's T x C block, row-major, NaN/Inf
 * native), `emptyCol` (1 where a bucket holds no stored step of the metric), `bucket_steps` (the metric's)
 * and `rowOf` (tensor index -> row, -1 for a tensor not in the answer). Returns the first metric's view
 * with `byMetric` (metric -> view). */
export function unpackHeatmap(buffer) {
  const n = new DataView(buffer).getUint32(0, true);
  const head = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, n)));
  const offset = 4 + n + ((8 - ((4 + n) % 8)) % 8);
  const T = head.tensors.length;
  const C = head.cols;
  const rowOf = new Int32Array(T ? Math.max(...head.tensors.map((t) => t.index)) + 1 : 0).fill(-1);
  head.tensors.forEach((t, r) => {
    rowOf[t.index] = r;
  });
  const byMetric = {};
  head.metrics.forEach((metric, k) => {
    byMetric[metric] = {
      ...head, metric, aggregation: head.aggregations[k], bucket_steps: head.metric_steps[k], T, C, rowOf,
      vals: new Float64Array(buffer, offset + k * T * C * 8, T * C),
      emptyCol: Uint8Array.from(head.metric_steps[k], (s) => (s === 0 ? 1 : 0)),
    };
  });
  for (const view of Object.values(byMetric)) view.byMetric = byMetric;
  return byMetric[head.metrics[0]];
}

/** View `held` (`unpackHeatmap`) with the buckets of `tail` (an answer to `after_step`, same layout and rows)
 * in place of those it held from the first of them on, and after them. */
export function mergeTail(held, tail) {
  const w = held.bucket_width;
  const from = tail.C ? Math.floor(tail.bucket_start[0] / w) : Infinity;
  let keep = held.bucket_start.findIndex((s) => Math.floor(s / w) >= from);
  if (keep < 0) keep = held.C;
  const C = keep + tail.C;
  const vals = new Float64Array(held.T * C);
  for (let r = 0; r < held.T; r++) {
    vals.set(held.vals.subarray(r * held.C, r * held.C + keep), r * C);
    vals.set(tail.vals.subarray(r * tail.C, (r + 1) * tail.C), r * C + keep);
  }
  const join = (key) => [...held[key].slice(0, keep), ...tail[key]];
  const emptyCol = new Uint8Array(C);
  emptyCol.set(held.emptyCol.subarray(0, keep));
  emptyCol.set(tail.emptyCol, keep);
  return {
    ...held, C, vals, emptyCol, cols: C, after_step: null,
    bucket_start: join("bucket_start"), bucket_end: join("bucket_end"), bucket_steps: join("bucket_steps"),
  };
}

/** Aggregate cells the way the server's buckets do (NaN propagates). */
export function aggregate(how, values) {
  let out = how === "sum" ? 0 : how === "max" ? -Infinity : Infinity;
  for (const v of values) {
    if (Number.isNaN(v)) return NaN;
    if (how === "sum") out += v;
    else if (how === "max") out = Math.max(out, v);
    else out = Math.min(out, v);
  }
  return out;
}

/** [zmin, zmax] of the colours of `z` for `metric`: the data's own range, widened to the metric's `span`
 * where it has one; undefined (plotly fits the data) otherwise. */
export function colourRange(metric, z) {
  const span = METRICS[metric].span;
  if (!span) return undefined;
  let [lo, hi] = span;
  for (const row of z) {
    for (const v of row) {
      if (v === null) continue;
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
  }
  return [lo, hi];
}

/** (colour value or null, overlay code or null) of a raw cell value for `metric`. */
export function cellColour(metric, v, isEmpty) {
  if (isEmpty) return [null, null];
  // an amax of 0 (a tensor of zeros) has nothing to saturate: no colour, not the "+Inf" of a value gone
  // infinite
  if (metric === "headroom" && v === Infinity) return [null, null];
  if (Number.isNaN(v)) return [null, 1];
  if (v === Infinity) return [null, 2];
  if (v === -Infinity) return [null, 3];
  if (metric === "amax" || metric === "scale") return [v > 0 ? Math.log2(v) : null, null];
  if (metric === "headroom") return [v, null]; // saturation is per tensor and format (Heatmap.saturated)
  if (metric === "sqnr" || metric === "dynamic_range" || metric === "block_range") return [v, null];
  if (metric === "subnormal" || metric.startsWith("block_")) return [100 * v, null];
  if (metric === "outlier_ratio") return [v > 0 ? Math.log10(v) : null, null];
  return [Math.log10(1 + Math.max(0, v)), null];
}
