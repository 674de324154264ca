// Where something went non-finite, as spans of consecutive steps: a loss that became NaN (one band per span,
// not a line per step), a tensor whose statistics counted NaN/Inf elements. An amax ignores NaN, so a
// tensor with a few keeps a normal one (and one gone all NaN has none, NaN): the non-finite counts, not the
// amax, say where it happened.

import { plotlyText } from "./dom.js";

/** Runs of consecutive indices i of `xs` where `bad(i)` holds, as [xs[first], xs[last]]. */
export function spansWhere(xs, bad) {
  const spans = [];
  let start = null;
  for (let i = 0; i <= xs.length; i++) {
    const isBad = i < xs.length && bad(i);
    if (isBad && start === null) start = i;
    if (!isBad && start !== null) {
      spans.push([xs[start], xs[i - 1]]);
      start = null;
    }
  }
  return spans;
}

/** Runs of consecutive non-finite values of a series (NaN, ±Inf, or null), as [first step, last step]. */
export function nonfiniteSpans(steps, values) {
  return spansWhere(steps, (i) => !Number.isFinite(values[i]));
}

/** Spans of the buckets of a parsed heatmap of nonfinite counts (`fetchHeatmap(..., {metric: "nonfinite"})`)
 * where any of the tensors `indices` counted non-finite elements, as [first step, last step]. */
export function bucketSpans(counts, indices) {
  const cols = [...Array(counts.C).keys()];
  const hit = (c) => !counts.emptyCol[c] && indices.some((t) => counts.vals[t * counts.C + c] > 0);
  return spansWhere(cols, hit).map(([a, b]) => [counts.bucket_start[a], counts.bucket_end[b]]);
}

/** "what at step a" or "what from step a to b". */
export function spanText(what, [a, b]) {
  return a === b ? `${what} at step ${a}` : `${what} from step ${a} to ${b}`;
}

/** The finite value of a series nearest to `step` (where a marker for a non-finite span sits), or null. */
export function finiteNear(steps, values, step) {
  let best = null;
  let dist = Infinity;
  for (let i = 0; i < steps.length; i++) {
    const d = Math.abs(steps[i] - step);
    if (d < dist && Number.isFinite(values[i])) {
      dist = d;
      best = values[i];
    }
  }
  return best;
}

/** Plotly rectangles over steps [a, b] of each span, behind the traces: `yref` "paper" (with `y0`, `y1`) or
 * an axis' domain ("y2 domain"), filled with `colour` at `opacity`, outlined in it (`dash` optional). */
export function bandShapes(spans, { colour = "#ff00ff", opacity = 0.15, yref = "paper", y0 = 0, y1 = 1, dash } = {}) {
  return spans.map(([a, b]) => ({
    type: "rect", xref: "x", yref, x0: a - 0.5, x1: b + 0.5, y0, y1, layer: "below", fillcolor: colour, opacity,
    line: { color: colour, width: 1, ...(dash ? { dash } : {}) },
  }));
}

/** A plotly marker trace for the spans of a series: a square at each span's first step on the series' nearest
 * finite value, its hover "<what> from step a to b"; `extra` (name, axis, meta, a marker of its own) merged in. */
export function spanMarkers(spans, steps, values, what, extra = {}) {
  return {
    type: "scatter", mode: "markers", x: spans.map(([a]) => a), y: spans.map(([a]) => finiteNear(steps, values, a)),
    text: spans.map((span) => plotlyText(spanText(what, span))), hovertemplate: "%{text}<extra></extra>",
    marker: { symbol: "square", size: 9, color: "#ff00ff" }, ...extra,
  };
}
