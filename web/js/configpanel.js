// The run page's config panel: every key of the run's config, and its name and tags, which a token with the
// control scope can change.

import { api, auth } from "./api.js";
import { configText, flattenConfig, parseTags } from "./config.js";
import { el, replace } from "./dom.js";

/** The run's config (every key), its name and tags, which a token with the control scope can change. */
export class ConfigPanel {
  constructor(container, runId, onSaved) {
    this.runId = runId;
    this.onSaved = onSaved;
    this.table = el("tbody");
    this.nameInput = el("input", { id: "run-rename", type: "text", maxlength: 200, size: 30, "aria-label": "run name" });
    this.tagsInput = el("input", { id: "run-tags", type: "text", size: 40, placeholder: "tags, space-separated", "aria-label": "tags" });
    this.save = el("button", { type: "submit", id: "run-save", class: "small" }, "Save");
    this.note = el("p", { class: "muted readonly-note", id: "run-edit-readonly" });
    this.error = el("p", { class: "error", id: "run-edit-error" });
    const form = el("form", { class: "controls", id: "run-edit" }, el("label", {}, "name ", this.nameInput), el("label", {}, "tags ", this.tagsInput), this.save);
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.submit();
    });
    container.append(this.note, form, this.error, el("table", { id: "config-table", class: "config" }, el("thead", {}, el("tr", {}, el("th", {}, "key"), el("th", {}, "value"))), this.table));
  }

  fill(run) {
    this.run = run;
    const rows = flattenConfig(run.config);
    replace(this.table, rows.length ? rows.map(([k, v]) => el("tr", { dataset: { key: k } }, el("td", { class: "name" }, k), el("td", { class: "name" }, configText(v))))
      : el("tr", {}, el("td", { colspan: 2, class: "muted" }, "The job sent no config.")));
    if (document.activeElement !== this.nameInput) this.nameInput.value = run.name;
    if (document.activeElement !== this.tagsInput) this.tagsInput.value = (run.tags || []).join(" ");
    const reason = auth.readOnlyReason();
    this.note.textContent = reason ? `Editing is disabled (${reason}).` : "";
    for (const input of [this.nameInput, this.tagsInput, this.save]) input.disabled = Boolean(reason);
  }

  async submit() {
    const { tags, error } = parseTags(this.tagsInput.value);
    this.error.textContent = error ? `not saved: ${error}` : "";
    if (error) return;
    try {
      const run = await api(`/runs/${this.runId}`, { method: "PATCH", body: { name: this.nameInput.value.trim(), tags } });
      this.onSaved(run);
    } catch (err) {
      this.error.textContent = `not saved: ${err.detail || err.message}`;
    }
  }
}
