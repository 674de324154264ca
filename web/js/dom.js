// DOM helpers. Every piece of user-controlled text (run, layer and tensor names, messages, event details)
// reaches the page through textContent or attribute setters, never through innerHTML.

import { noteMark } from "./hooks.js";

/** Create an element: el("td", {class: "x", title: "..."}, "text", childNode, ...). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "disabled" || key === "checked" || key === "selected") node[key] = Boolean(value);
    else if (key === "value") node.value = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(node, child);
    else if (child instanceof Node) node.appendChild(child);
    else node.appendChild(document.createTextNode(String(child)));
  }
}

/** Replace all children of `node`. */
export function replace(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

/** Text for plotly (hover text, tick labels, trace names): plotly interprets a few HTML-like tags in its
 * strings, so user text is entity-escaped; plotly shows the entities as the original characters. */
export function plotlyText(value) {
  return String(value)
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&#34;")
    .replace(/'/g, "&#39;");
}

/** A number for display: NaN/Infinity spelled out, small/large numbers in exponent form. */
export function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "string") return value;
  if (Number.isNaN(value)) return "NaN";
  if (value === Infinity) return "+Inf";
  if (value === -Infinity) return "-Inf";
  if (Number.isInteger(value) && Math.abs(value) < 1e9) return String(value);
  const a = Math.abs(value);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return value.toExponential(digits - 1);
  return String(Number(value.toPrecision(digits)));
}

/** Relative time ("12 s ago") of an ISO date. */
export function ago(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 129600) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

/** Call `fn` at most once per `ms` (a number, or a function giving it), always with the latest
 * arguments (trailing call guaranteed). */
export function throttle(fn, ms) {
  let timer = null;
  let last = 0;
  let pending = null;
  return (...args) => {
    pending = args;
    if (timer) return;
    const wait = Math.max(0, last + (typeof ms === "function" ? ms() : ms) - Date.now());
    timer = setTimeout(() => {
      timer = null;
      last = Date.now();
      const a = pending;
      pending = null;
      fn(...a);
    }, wait);
  };
}

/** The colours of runs drawn side by side (the comparison's runs, the runs list's groups): plotly's own. */
export const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/** A titled panel section. */
export function panel(title, ...children) {
  return el("section", { class: "panel" }, el("h2", {}, title), ...children);
}

/** A small status badge, e.g. badge("applied", "ok"). */
export function badge(text, kind = "") {
  return el("span", { class: `badge ${kind}` }, text);
}

/** True for a non-finite number, as a number or as the service spells it in JSON ("NaN", "Infinity",
 * "-Infinity"); false for a finite one and for none (null, undefined). */
export function nonfiniteValue(value) {
  if (typeof value !== "number" && typeof value !== "string") return false;
  return !Number.isFinite(Number(value));
}

/** A run's status as a badge: interrupted (Ctrl-C) is a warning, crashed and halted (a non-finite loss) bad.
 * Given the run's last loss: a run that ended on a non-finite loss is not a green "finished" (it diverged,
 * whatever the job said at its end). */
export function statusBadge(status, lastLoss = undefined) {
  const kind = { running: "info", finished: "ok", interrupted: "warn", crashed: "bad", halted: "bad" };
  if (status !== "running" && nonfiniteValue(lastLoss)) {
    const loss = Number(lastLoss);
    const b = badge(`${status}, loss ${fmt(loss)}`, "bad");
    b.title = `the run ended with a non-finite loss (${fmt(loss)})`;
    return b;
  }
  return badge(status, kind[status] || "");
}

const SOURCES = {
  shadow: "shadow mode: FP8 what-if statistics; the model itself trains in its own precision",
  torchao: "statistics of torchao's Float8Linear layers, with the scales torchao used; weights are counted " +
    "at every forward, as torchao casts them (per micro-batch, where fp8scope counts them once per step)",
  caller: "statistics computed by the training script (another runtime)",
  transformer_engine: "read from Transformer Engine's amax histories and scales (no element counts)",
};

/** A badge naming where a run's FP8 statistics come from, unless from fp8scope's own FP8 layers. */
export function sourceBadge(run) {
  const source = run && run.config && run.config.fp8_source;
  if (typeof source !== "string" || !source) return null;
  const b = badge(source, "source");
  b.title = SOURCES[source] || "FP8 statistics source";
  return b;
}

let plotlyLoading = null;
let plotlyGate = Promise.resolve();

/** Hold plotly.js back until `promise` settles (the run page's first frame is painted first: compiling
 * plotly blocks the page for a good part of a second). No effect once loading has started. */
export function deferPlotly(promise) {
  if (!plotlyLoading) plotlyGate = Promise.allSettled([promise]);
}

/** plotly.js, loaded once. It is a 4.8 MB script: loading it without blocking lets the page's data
 * requests run while the browser compiles it. */
export function plotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!plotlyLoading) {
    plotlyLoading = plotlyGate.then(() => new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = "/static/vendor/plotly.min.js";
      script.onload = () => {
        noteMark("plotly-ready");
        resolve(window.Plotly);
      };
      script.onerror = () => reject(new Error("plotly.js could not be loaded"));
      document.head.appendChild(script);
    }));
  }
  return plotlyLoading;
}
