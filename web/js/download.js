// The run page's download menu: one table of the run (per-tensor statistics, scalars, events, alerts,
// incident replays) as CSV or Parquet, from GET /runs/{id}/export, optionally over a step range.

import { download, qs } from "./api.js";
import { el } from "./dom.js";

const TABLES = [
  ["stats", "long", "statistics, a row per step and tensor"],
  ["stats", "wide", "statistics, a row per step"],
  ["scalars", null, "scalars (loss, lr, ...)"],
  ["events", null, "events"],
  ["alerts", null, "alerts"],
  ["replays", null, "incident replays"],
];

/** The menu (a <details> in the run's header). */
export function downloadMenu(runId) {
  const table = el("select", { id: "download-table" }, TABLES.map(([name, layout, text], i) => el("option", { value: String(i) }, text)));
  const format = el("select", { id: "download-format" }, el("option", { value: "csv" }, "CSV"), el("option", { value: "parquet" }, "Parquet"));
  const from = el("input", { id: "download-from", type: "number", min: 0, step: 1, placeholder: "first step" });
  const to = el("input", { id: "download-to", type: "number", min: 0, step: 1, placeholder: "last step" });
  const error = el("p", { class: "error", id: "download-error" });
  const go = el("button", { type: "submit", id: "download-go" }, "Download");
  const form = el("form", { class: "download-form" }, table, format, from, "–", to, go, error);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    error.textContent = "";
    const [name, layout] = TABLES[Number(table.value)];
    const bound = (input) => (input.value.trim() === "" ? undefined : Number(input.value));
    const [first, last] = [bound(from), bound(to)];
    if (first !== undefined && last !== undefined && last < first) {
      error.textContent = `The last step (${last}) comes before the first (${first}).`;
      return;
    }
    const query = qs({ table: name, format: format.value, layout: layout || undefined, from: first, to: last });
    go.disabled = true;
    try {
      await download(`/runs/${runId}/export${query}`);
    } catch (err) {
      error.textContent = `Could not download: ${err.detail || err.message}`;
    } finally {
      go.disabled = false;
    }
  });
  return el("details", { class: "download", id: "run-download" }, el("summary", {}, "Download…"), form);
}
