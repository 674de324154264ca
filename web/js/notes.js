// A run's notes: free text kept with the run (PATCH /runs/{id} {notes}), shown under the run page's header and
// edited there by a caller with the control scope (or the job's own token); the runs list shows them cut short.

import { api, auth } from "./api.js";
import { el } from "./dom.js";

/** monitor_server.storage.schemas.MAX_NOTES: the service refuses longer notes (422). */
export const MAX_NOTES = 10_000;

/** Notes on one line cut to `n` characters ("…" marks the cut), for a list cell. */
export function shortNotes(text, n = 80) {
  const line = (text || "").replace(/\s+/g, " ").trim();
  return line.length > n ? `${line.slice(0, n - 1)}…` : line;
}

const editors = new WeakMap(); // the element the notes follow on a run page -> the notes editor

/** Show `run`'s notes right after `anchor` (an element of the run page's head: one editor per page, placed
 * once, so the header's redraws on a live run leave what is being typed alone). `onSaved(run)` gets the run
 * as the service saved it. */
export function mountNotes(anchor, run, onSaved) {
  let editor = editors.get(anchor);
  if (!editor || editor.runId !== run.id) {
    editor?.node.remove();
    editor = notesEditor(run, onSaved);
    editors.set(anchor, editor);
  }
  if (!editor.node.isConnected) anchor.after(editor.node);
  editor.update(run);
}

function notesEditor(run, onSaved) {
  let current = run;
  let editing = false;
  const text = el("p", { id: "run-notes-text", class: "notes-text" });
  const edit = el("button", { type: "button", class: "small", id: "run-notes-edit" }, "Edit notes");
  const area = el("textarea", { id: "run-notes-input", rows: 5, maxlength: MAX_NOTES, "aria-label": "notes" });
  const save = el("button", { type: "button", class: "small", id: "run-notes-save" }, "Save");
  const cancel = el("button", { type: "button", class: "small", id: "run-notes-cancel" }, "Cancel");
  const count = el("span", { class: "muted" });
  const error = el("span", { class: "error", id: "run-notes-error" });
  const form = el("div", { class: "notes-form", hidden: true }, area, el("div", { class: "controls" }, save, cancel, count, error));
  const node = el("section", { class: "run-notes", id: "run-notes" }, el("div", { class: "notes-view" }, text, edit), form);

  function show() {
    text.textContent = current.notes || "No notes.";
    text.classList.toggle("muted", !current.notes);
    const reason = auth.readOnlyReason();
    edit.disabled = Boolean(reason);
    edit.title = reason || "edit this run's notes";
    text.hidden = editing;
    edit.hidden = editing;
    form.hidden = !editing;
  }
  const counted = () => {
    count.textContent = `${area.value.length} / ${MAX_NOTES}`;
  };
  edit.addEventListener("click", () => {
    editing = true;
    area.value = current.notes || "";
    counted();
    show();
    area.focus();
  });
  cancel.addEventListener("click", () => {
    editing = false;
    error.textContent = "";
    show();
  });
  area.addEventListener("input", counted);
  save.addEventListener("click", async () => {
    save.disabled = true;
    error.textContent = "";
    try {
      current = await api(`/runs/${current.id}`, { method: "PATCH", body: { notes: area.value } });
      editing = false;
      show();
      onSaved(current);
    } catch (err) {
      error.textContent = `saving the notes failed: ${err.detail || err.message}`;
    } finally {
      save.disabled = false;
    }
  });
  return {
    runId: run.id,
    node,
    update(r) {
      current = r;
      show();
    },
  };
}
