// Boot and routing: #/ (runs list), #/runs/<id>[?incident=<id>] (run page, an incident open),
// #/compare?runs=<id>,<id>,...[&a=<id>&b=<id>][&metric=<name>] (up to 8 runs; a and b: the heatmap
// difference's pair, metric: what it is the difference of).

import { ApiError, auth, unauthorized, whoami } from "./api.js";
import { el, plotly, replace } from "./dom.js";
import { mountCompare } from "./compare.js";
import { mountRun } from "./run.js";
import { mountRuns } from "./runs.js";
import { noteError, previewWanted } from "./hooks.js";

const app = document.getElementById("app");
let current = null; // {destroy()} of the mounted view

function route() {
  const hash = location.hash || "#/";
  const [path, query] = hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  if (parts[0] === "runs" && /^\d+$/.test(parts[1] || "")) {
    const incident = /^\d+$/.test(params.get("incident") || "") ? Number(params.get("incident")) : null;
    // ?metric=sqnr: the heatmap opens on that metric (an unknown name: amax)
    return { view: mountRun, args: { runId: Number(parts[1]), incident, metric: params.get("metric") } };
  }
  if (parts[0] === "compare") {
    const runs = (params.get("runs") || "").split(",").filter((id) => /^\d+$/.test(id));
    // ?metric=sqnr: the difference heatmap of that metric (an unknown name: amax)
    return { view: mountCompare, args: { runs, a: params.get("a"), b: params.get("b"), metric: params.get("metric") } };
  }
  return { view: mountRuns, args: {} };
}

async function show() {
  if (current) current.destroy();
  current = null;
  const { view, args } = route();
  replace(app);
  try {
    current = await view(app, args);
  } catch (err) {
    noteError(err);
    if (err instanceof ApiError && err.status === 401) {
      replace(app, el("p", { class: "muted" }, "This server needs an access token (see the dialog)."));
      return;
    }
    replace(app, el("p", { class: "error" }, `Could not load this page: ${err.message}`));
  }
}

function renderAuth() {
  const status = document.getElementById("auth-status");
  const p = auth.principal;
  if (!p) {
    replace(status, el("span", { class: "badge warn" }, "no token"));
  } else if (!p.auth) {
    replace(status, el("span", { class: "badge ok", title: "the server runs without tokens (loopback only)" }, "open server"));
  } else if (auth.canControl()) {
    replace(status, el("span", { class: "badge ok" }, `${p.name}: read + control`));
  } else {
    replace(status, el("span", { class: "badge warn", id: "read-only", title: auth.readOnlyReason() }, "read-only"));
  }
  document.getElementById("token-button").hidden = Boolean(p && !p.auth);
}

function openTokenDialog(reason) {
  const dialog = document.getElementById("token-dialog");
  if (reason) document.getElementById("token-error").textContent = reason;
  if (!dialog.open) dialog.showModal();
  document.getElementById("token-input").focus();
}

function setupTokenDialog() {
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  const error = document.getElementById("token-error");
  document.getElementById("token-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const previous = auth.token();
    auth.setToken(input.value.trim());
    const principal = await whoami();
    if (!principal) {
      auth.setToken(previous);
      error.textContent = "The server did not accept this token.";
      return;
    }
    input.value = "";
    error.textContent = "";
    dialog.close();
    show();
  });
  document.getElementById("token-clear").addEventListener("click", async () => {
    auth.setToken("");
    input.value = "";
    await whoami();
    dialog.close();
    show();
  });
  document.getElementById("token-cancel").addEventListener("click", () => dialog.close());
  document.getElementById("token-button").addEventListener("click", () => openTokenDialog(""));
  unauthorized.addEventListener("unauthorized", () => {
    auth.principal = null;
    auth.changed();
    openTokenDialog(auth.token() ? "The stored token was not accepted." : "");
  });
}

async function boot() {
  auth.listeners.add(renderAuth);
  setupTokenDialog();
  window.addEventListener("hashchange", show);
  // the view's requests go out together with /whoami (one round trip less before the first paint); when
  // the server wants a token they answer 401 and the token dialog opens
  const who = whoami();
  // the run page starts loading plotly.js itself, once its first frame is painted
  if (!(previewWanted() && route().view === mountRun)) plotly().catch(noteError);
  show();
  try {
    await who;
  } catch (err) {
    replace(app, el("p", { class: "error" }, `The monitor service does not answer: ${err.message}`));
    return;
  }
  if (!auth.principal) openTokenDialog("");
}

window.addEventListener("error", (ev) => noteError(ev.message));
window.addEventListener("unhandledrejection", (ev) => noteError(ev.reason));
boot();
