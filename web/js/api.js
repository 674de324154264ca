// The monitor service's /api/v1 for the dashboard: JSON requests with the bearer token, wire floats,
// the caller's scopes, and server-sent events read through fetch (EventSource cannot send the
// Authorization header, and a token in the URL would end up in logs).

import { noteStreams } from "./hooks.js";

// fp8_protocol.api.API_PREFIX (tests/protocol/test_client_events.py keeps the two equal)
const API = "/api/v1";
const TOKEN_KEY = "fp8scope.token";

export class ApiError extends Error {
  constructor(status, detail) {
    super(`${status}: ${detail}`);
    this.status = status;
    this.detail = detail;
  }
}

export const auth = {
  principal: null, // {name, scopes, auth} from /whoami
  listeners: new Set(),
  token() {
    return localStorage.getItem(TOKEN_KEY) || "";
  },
  setToken(token) {
    if (token) localStorage.setItem(TOKEN_KEY, token);
    else localStorage.removeItem(TOKEN_KEY);
  },
  canControl() {
    return Boolean(this.principal && this.principal.scopes.includes("control"));
  },
  /** Why actions are disabled (null when they are not). */
  readOnlyReason() {
    if (this.canControl()) return null;
    if (!this.principal) return "not signed in: enter a token with the control scope";
    return `read-only: token "${this.principal.name}" lacks the control scope`;
  },
  changed() {
    for (const fn of this.listeners) fn(this.principal);
  },
};

/** Signalled when the server answers 401: the page asks for a token. */
export const unauthorized = new EventTarget();

function headers(extra = {}) {
  const h = { Accept: "application/json", ...extra };
  const token = auth.token();
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

async function errorDetail(response) {
  try {
    const body = await response.json();
    if (typeof body.detail === "string") return body.detail;
    return JSON.stringify(body.detail ?? body);
  } catch {
    return response.statusText;
  }
}

/** Throw an ApiError with the server's reason for an answer that is not 2xx (and signal a 401 first). */
async function refuseFailure(response) {
  if (response.ok) return;
  const detail = await errorDetail(response);
  if (response.status === 401) unauthorized.dispatchEvent(new CustomEvent("unauthorized", { detail }));
  throw new ApiError(response.status, detail);
}

/** A request to a path under /api/v1 (JSON `body` for POST / PATCH); resolves to the parsed JSON (null for
 * an answer without content), or with `page: true` to {data, next}: `next` is the X-Next-Cursor of a paged
 * list (null on its last page). */
export async function api(path, { method = "GET", body, signal, page = false } = {}) {
  const init = { method, signal, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(API + path, init);
  await refuseFailure(response);
  const data = response.status === 204 ? null : await response.json();
  return page ? { data, next: response.headers.get("X-Next-Cursor") } : data;
}

/** GET a binary answer under /api/v1 as an ArrayBuffer. */
export async function apiBinary(path, { signal } = {}) {
  const response = await fetch(API + path, { signal, headers: headers({ Accept: "application/octet-stream" }) });
  await refuseFailure(response);
  return response.arrayBuffer();
}

/** Save the file a GET under /api/v1 answers (an attachment). Without a token the browser fetches it
 * itself and streams it to disk; with one (which a plain link cannot send) it is fetched here with the
 * Authorization header and handed over whole. */
export async function download(path) {
  const link = document.createElement("a");
  if (!auth.token()) {
    link.href = API + path;
    link.download = "";
    link.click();
    return;
  }
  const response = await fetch(API + path, { headers: headers({ Accept: "*/*" }) });
  await refuseFailure(response);
  const named = /filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "");
  link.href = URL.createObjectURL(await response.blob());
  link.download = named ? named[1] : "";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}

/** Ask the server who we are; sets auth.principal (null on 401). */
export async function whoami() {
  try {
    auth.principal = await api("/whoami");
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 401) throw err;
    auth.principal = null;
  }
  auth.changed();
  return auth.principal;
}

/** A wire float ("NaN", "Infinity", "-Infinity" or a number; null stays null) as a JS number. */
export function num(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "number") return value;
  if (value === "NaN") return NaN;
  if (value === "Infinity") return Infinity;
  if (value === "-Infinity") return -Infinity;
  const n = Number(value);
  return Number.isNaN(n) ? null : n;
}

/** Query string from an object, leaving out null/undefined values. */
export function qs(params) {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined) p.set(k, String(v));
  const s = p.toString();
  return s ? `?${s}` : "";
}

const openStreams = new Set();

/** Track open streams for the live indicator (and for tests: window.fp8scope.streams). */
function streamState(path, open) {
  if (open) openStreams.add(path);
  else openStreams.delete(path);
  noteStreams(openStreams);
  const indicator = document.getElementById("live-indicator");
  if (indicator) indicator.className = openStreams.size ? "live on" : "live off";
}

/**
 * Follow a server-sent event stream at `path` (e.g. "/runs/3/stream").
 * `handlers` maps event names to functions of the parsed data; `onopen` runs on every (re)connection,
 * so a view can refetch what it may have missed while disconnected. Returns {close()}.
 */
export function subscribe(path, handlers, { onopen, retryMs = 2000 } = {}) {
  let closed = false;
  let controller = null;
  let timer = null;

  async function connect() {
    if (closed) return;
    controller = new AbortController();
    try {
      const response = await fetch(API + path, {
        headers: headers({ Accept: "text/event-stream" }),
        signal: controller.signal,
        cache: "no-store",
      });
      if (!response.ok) {
        if (response.status === 401) unauthorized.dispatchEvent(new CustomEvent("unauthorized"));
        throw new ApiError(response.status, await errorDetail(response));
      }
      streamState(path, true);
      if (onopen) onopen();
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          dispatch(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
    } catch (err) {
      if (closed) return;
      if (!(err instanceof DOMException && err.name === "AbortError")) console.warn("stream", path, err);
    }
    streamState(path, false);
    if (!closed) timer = setTimeout(connect, retryMs);
  }

  function dispatch(frame) {
    let name = "message";
    const data = [];
    for (const line of frame.split("\n")) {
      if (line.startsWith(":")) continue;
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (!data.length || !handlers[name]) return;
    let parsed;
    try {
      parsed = JSON.parse(data.join("\n"));
    } catch {
      return;
    }
    try {
      handlers[name](parsed);
    } catch (err) {
      console.error("stream handler", name, err);
    }
  }

  connect();
  return {
    close() {
      closed = true;
      clearTimeout(timer);
      streamState(path, false);
      if (controller) controller.abort();
    },
  };
}
