// The recipe editor: the run's effective recipe (model and per-layer overrides), a form that sends a
// change as a command (POST /runs/{id}/commands), and the audit trail of every command with its live
// state (pending -> delivered -> applied at step N, or rejected with the reason) and a rollback action.

import { api, auth } from "./api.js";
import { badge, el, plotlyText, replace } from "./dom.js";

const FIELDS = ["margin", "amax_history_len", "amax_compute_algo", "interval", "scaling", "fp8_enabled"];
// settings of delayed scaling alone: current scaling derives each scale from the tensor's own amax, and
// block scaling (mxfp8, block) each block's from the block's own
const DELAYED_ONLY = new Set(["margin", "amax_history_len", "amax_compute_algo", "interval"]);
const unusedBy = (scalings) => `not used by ${scalings.join(" or ")} scaling (in force again after a switch to delayed)`;
const STATE_KIND = { pending: "info", delivered: "info", applied: "ok", rejected: "bad" };

function show(value) {
  if (value === true) return "on";
  if (value === false) return "off";
  return value === undefined || value === null ? "–" : String(value);
}

function changesText(changes) {
  if (!changes) return "–";
  return Object.entries(changes).map(([k, v]) => `${k} = ${show(v)}`).join(", ");
}

/** The run's applied recipe changes (a Map or an array of commands) as {step, id, short, text}, in step
 * order: where each took effect, what it changed and what it replaced (markers on the curves and the
 * heatmap; `short` for a table cell). */
export function appliedChanges(commands) {
  return [...commands.values()]
    .filter((c) => c.state === "applied" && Number.isFinite(c.applied_step))
    .sort((a, b) => a.applied_step - b.applied_step || a.id - b.id)
    .map((c) => {
      const what = `${c.kind === "rollback" ? `rollback of #${c.rollback_of}: ` : ""}${changesText(c.changes)}`;
      const where = c.target === "model" ? "" : ` on ${c.target}`;
      return {
        step: c.applied_step, id: c.id, short: `${what}${where} at step ${c.applied_step}`,
        text: `recipe change #${c.id} (${c.target}) at step ${c.applied_step}: ${what} (was ${changesText(c.previous)})`,
      };
    });
}

const CHANGE_COLOUR = "#17becf";

/** A dashed vertical line across a plot (shapes of its x axis, in steps) at each applied recipe change. */
export function changeLines(changes, colour = CHANGE_COLOUR) {
  return changes.map((c) => ({
    type: "line", xref: "x", yref: "paper", x0: c.step, x1: c.step, y0: 0, y1: 1, layer: "above",
    line: { color: colour, width: 1.5, dash: "dash" },
  }));
}

/** A plotly marker trace of applied recipe changes: a star at each change's step, at `ys` (one per change),
 * its hover the change's text after `prefix`; `colour` and the rest of the options (name, legend group, ...)
 * merged in. */
export function changeMarkers(changes, ys, { colour = CHANGE_COLOUR, prefix = "", ...extra } = {}) {
  return {
    type: "scatter", mode: "markers", x: changes.map((c) => c.step), y: ys,
    text: changes.map((c) => plotlyText(`${prefix}${c.text}`)), hovertemplate: "%{text}<extra></extra>",
    marker: { symbol: "star", size: 12, color: colour, line: { width: 1, color: "#fff" } }, ...extra,
  };
}

/** The state of a command as one line: "applied at step 120", "rejected: reason", ... */
export function stateText(c) {
  if (c.state === "applied") return `applied at step ${c.applied_step}`;
  if (c.state === "rejected") return `rejected: ${c.reason || "no reason given"}`;
  return c.state;
}

export class RecipeEditor {
  /** `store`: the page's RunStore; its tensor list (fetched once) and its commands, which this renders. */
  constructor(container, runId, store) {
    this.runId = runId;
    this.store = store;
    this.layers = [];
    this.effective = el("div", { id: "recipe-effective" });
    this.note = el("p", { class: "muted readonly-note", id: "recipe-readonly" });
    this.error = el("p", { class: "error", id: "recipe-error" });
    this.trail = el("tbody");
    this.form = this.buildForm();
    store.subscribe("commands", () => this.fill()); // POST answers, the stream and reloads all land there
    // the recipe in force above the form, not beside it: its table has a column per setting, which half of
    // this panel (itself half of the page) cannot show whole at a laptop's 1280 px
    container.append(
      el("h3", {}, "In force"), this.effective,
      el("h3", {}, "Change"), this.note, this.form, this.error,
      el("h3", {}, "Audit trail"),
      el("table", { id: "commands-table", class: "commands" },
        el("thead", {}, el("tr", {}, ...["#", "created", "by", "target", "change", "replaced", "state", ""].map((h) => el("th", {}, h)))),
        this.trail),
    );
  }

  buildForm() {
    this.inputs = {
      target: el("select", { id: "recipe-target", name: "target" }),
      margin: el("input", { id: "recipe-margin", name: "margin", type: "number", min: 0, step: 1, placeholder: "unchanged" }),
      amax_history_len: el("input", { id: "recipe-history", name: "amax_history_len", type: "number", min: 1, step: 1, placeholder: "unchanged" }),
      amax_compute_algo: el("select", { id: "recipe-algo", name: "amax_compute_algo" },
        el("option", { value: "" }, "unchanged"), el("option", { value: "max" }, "max"), el("option", { value: "most_recent" }, "most_recent")),
      interval: el("input", { id: "recipe-interval", name: "interval", type: "number", min: 1, step: 1, placeholder: "unchanged" }),
      scaling: el("select", { id: "recipe-scaling", name: "scaling" },
        el("option", { value: "" }, "unchanged"), el("option", { value: "delayed" }, "delayed"), el("option", { value: "current" }, "current"),
        // block scaling: MXFP8 (1x32 blocks, E8M0 scales) or FP8 block scaling (1x128 / 128x128)
        el("option", { value: "mxfp8" }, "mxfp8 (1x32 blocks)"), el("option", { value: "block" }, "block (1x128 / 128x128)")),
      fp8_enabled: el("select", { id: "recipe-fp8", name: "fp8_enabled" },
        el("option", { value: "" }, "unchanged"), el("option", { value: "on" }, "FP8 on"), el("option", { value: "off" }, "FP8 off")),
    };
    this.submit = el("button", { type: "submit", id: "recipe-submit" }, "Send change");
    const label = (text, input) => el("label", {}, el("span", {}, text), input);
    const form = el("form", { class: "recipe-form", id: "recipe-form", novalidate: true },
      label("target", this.inputs.target),
      label("margin", this.inputs.margin),
      label("amax history length", this.inputs.amax_history_len),
      label("amax algorithm", this.inputs.amax_compute_algo),
      label("interval", this.inputs.interval),
      label("scaling", this.inputs.scaling),
      label("FP8", this.inputs.fp8_enabled),
      this.submit);
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.send();
    });
    return form;
  }

  /** The changes the form asks for, or throws with a message naming the bad field. */
  changes() {
    const out = {};
    for (const key of ["margin", "amax_history_len", "interval"]) {
      const raw = this.inputs[key].value.trim();
      if (raw === "") continue;
      const n = Number(raw);
      const min = key === "margin" ? 0 : 1;
      if (!Number.isInteger(n) || n < min) throw new Error(`${key} must be an integer ≥ ${min}`);
      out[key] = n;
    }
    for (const key of ["amax_compute_algo", "scaling"]) if (this.inputs[key].value) out[key] = this.inputs[key].value;
    if (this.inputs.fp8_enabled.value) out.fp8_enabled = this.inputs.fp8_enabled.value === "on";
    if (!Object.keys(out).length) throw new Error("change at least one field");
    return out;
  }

  async send() {
    this.error.textContent = "";
    let changes;
    try {
      changes = this.changes();
    } catch (err) {
      this.error.textContent = err.message;
      return;
    }
    this.submit.disabled = true;
    try {
      const command = await api(`/runs/${this.runId}/commands`, { method: "POST", body: { target: this.inputs.target.value, changes } });
      this.store.upsertCommand(command);
      this.form.reset();
    } catch (err) {
      this.error.textContent = `The server refused the change: ${err.detail || err.message}`;
    } finally {
      this.fill();
    }
  }

  async rollback(command) {
    this.error.textContent = "";
    try {
      this.store.upsertCommand(await api(`/runs/${this.runId}/commands`, { method: "POST", body: { rollback: command.id } }));
    } catch (err) {
      this.error.textContent = `Rollback refused: ${err.detail || err.message}`;
    }
  }

  async load(run) {
    await this.store.loadCommands(); // a failure is shown in the audit trail; what was loaded before stays
    try {
      this.layers = [...new Set((await this.store.tensors()).map((t) => t.layer))];
    } catch {
      // the tensor list failed: the store has it as an error; the model stays a target
    }
    this.setRun(run);
  }

  setRun(run) {
    this.run = run;
    this.fill();
  }

  fill() {
    if (!this.run) return;
    const eff = this.run.effective_recipe || { model: {}, layers: {} };
    const rows = [["model", eff.model], ...Object.entries(eff.layers || {})];
    const notDelayed = (values) => Boolean(values.scaling) && values.scaling !== "delayed";
    const others = [...new Set(rows.filter(([, values]) => notDelayed(values)).map(([, values]) => values.scaling))];
    replace(
      this.effective,
      el("table", { class: "recipe" },
        el("thead", {}, el("tr", {}, el("th", {}, "target"), ...FIELDS.map((f) => el("th", {}, f.replace(/_/g, " "))))),
        el("tbody", {}, rows.map(([target, values]) =>
          el("tr", { dataset: { target } }, el("td", { class: "name" }, target), ...FIELDS.map((f) =>
            notDelayed(values) && DELAYED_ONLY.has(f)
              ? el("td", { class: "muted unused", title: unusedBy([values.scaling]) }, show(values[f]))
              : el("td", {}, show(values[f]))))))),
      others.length ? el("p", { class: "muted", id: "recipe-unused-note" }, `Greyed: ${unusedBy(others)}.`) : [],
    );
    const selected = this.inputs.target.value;
    replace(this.inputs.target, el("option", { value: "model" }, "whole model"), this.layers.map((l) => el("option", { value: l }, l)));
    if (selected) this.inputs.target.value = selected;
    const ended = this.run.status && this.run.status !== "running" ? `the run is ${this.run.status}: no job is there to apply them` : "";
    const reason = auth.readOnlyReason() || ended;
    this.note.textContent = reason ? `Changes are disabled (${reason}).` : "";
    for (const input of [...Object.values(this.inputs), this.submit]) {
      input.disabled = Boolean(reason);
      input.title = reason || "";
    }
    const commands = [...this.store.get("commands").values()].sort((a, b) => b.id - a.id);
    const loadError = this.store.error("commands");
    if (loadError) {
      replace(this.trail, el("tr", { class: "error-row" }, el("td", { colspan: 8, class: "error", id: "commands-error" }, `Could not load the audit trail: ${loadError.message}`)),
        commands.map((c) => this.row(c, reason)));
      return;
    }
    if (!commands.length) {
      replace(this.trail, el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No changes yet.")));
      return;
    }
    replace(this.trail, commands.map((c) => this.row(c, reason)));
  }

  /** One command of the audit trail, with its rollback button when it was applied. */
  row(c, reason) {
    const back = c.state === "applied"
      ? el("button", { type: "button", class: "small rollback", disabled: Boolean(reason), title: reason || `undo command ${c.id}` }, "Roll back")
      : null;
    if (back) back.addEventListener("click", () => this.rollback(c));
    return el("tr", { dataset: { commandId: c.id, state: c.state } },
      el("td", {}, String(c.id)),
      el("td", { class: "muted" }, new Date(c.created_at).toLocaleTimeString()),
      el("td", {}, c.created_by),
      el("td", { class: "name" }, c.target),
      el("td", {}, c.kind === "rollback" ? `rollback of #${c.rollback_of}: ` : "", changesText(c.changes)),
      el("td", { class: "muted" }, changesText(c.previous)),
      el("td", { class: "command-state" }, badge(stateText(c), STATE_KIND[c.state] || "")),
      el("td", {}, back));
  }
}
