// The page's instrumentation, read by the browser tests and bench/dashboard.py: one object,
// window.fp8scope, written only through the functions below, so that what a test can observe is listed in
// one place.
//
//   drawn[kind]     when plotly has drawn a plot with its data (curves, heatmap, blockhist, groups, compare)
//   painted[kind]   when a plot's pixels (the canvas first frame or plotly's) are on screen
//   stepSeen[key]   when the page first showed step `<run id>:<step>` of a live run
//   errors          uncaught errors and failed page loads, as text
//   marks[name]     the first time of a named moment of the first paint (the benchmark's breakdown)
//   streams         the event streams open now
//   heatmapQuery, blockHistQuery   the parameters of the last drawing's request
//   preview         whether the run page paints a canvas first frame before plotly.js loads (?paint=plotly:
//                   the path that waits for plotly.js; the benchmark measures both)

window.fp8scope ||= {
  drawn: {}, painted: {}, stepSeen: {}, errors: [],
  preview: new URLSearchParams(location.search).get("paint") !== "plotly",
};
const hooks = window.fp8scope;

/** Whether the run page is to paint its first frame on canvases before plotly.js loads (not ?paint=plotly). */
export function previewWanted() {
  return hooks.preview;
}

/** Plot `kind` drawn with its data, now (or at `at`); with `first`, only the first time counts. */
export function noteDrawn(kind, { at = performance.now(), first = false } = {}) {
  if (first && kind in hooks.drawn) return;
  hooks.drawn[kind] = at;
}

/** Plot `kind`'s pixels on screen at `at`. */
export function notePainted(kind, at) {
  hooks.painted[kind] = at;
}

/** Step `step` of run `runId` shown; with `first`, a step already noted keeps its first time. */
export function noteStepSeen(runId, step, { first = false } = {}) {
  const key = `${runId}:${step}`;
  if (first && key in hooks.stepSeen) return;
  hooks.stepSeen[key] = Date.now();
}

/** An error the page met (uncaught, or a view that could not load). */
export function noteError(text) {
  hooks.errors.push(String(text));
}

/** The first time of moment `name` (ms since navigation). */
export function noteMark(name) {
  const marks = (hooks.marks ||= {});
  if (!(name in marks)) marks[name] = performance.now();
}

/** The event streams open now. */
export function noteStreams(paths) {
  hooks.streams = [...paths];
}

/** The parameters of the last request of a drawing (`heatmapQuery`, `blockHistQuery`). */
export function noteQuery(name, query) {
  hooks[name] = query;
}
