// The run page's header: the run's name, status, source and tags, its facts (last step and loss, steps
// stored, open incidents and alerts), the link to a comparison and the downloads; the run's notes under the
// verdict. Rendered from the page's store; live steps update the three numbers that follow them in place.

import { num } from "./api.js";
import { el, fmt, replace, sourceBadge, statusBadge } from "./dom.js";
import { downloadMenu } from "./download.js";
import { mountNotes } from "./notes.js";

export class RunHeader {
  /** `notesHost`: where the run's notes are shown (under the verdict); `showIncidents()`: a click on a
   * count (the incidents panel is revealed). */
  constructor(store, notesHost, showIncidents) {
    Object.assign(this, { store, notesHost, showIncidents });
    this.node = el("div", { class: "run-head" });
    // the same element each time: what is typed in it survives the header's redraws
    this.downloads = downloadMenu(store.runId);
  }

  /** A count in the header: a link to the incidents panel. */
  incidentsLink(id, count) {
    return el("a", {
      id, href: "#incidents", title: "show the incidents",
      onclick: (ev) => {
        ev.preventDefault();
        this.showIncidents();
      },
    }, String(count));
  }

  render() {
    const r = this.store.get("run");
    replace(
      this.node,
      el("h1", { id: "run-name" }, r.name),
      statusBadge(r.status, r.last_loss),
      sourceBadge(r),
      el("span", { id: "run-tags-list", class: "tags" }, (r.tags || []).map((t) => el("a", { class: "tag", href: `#/?tag=${encodeURIComponent(t)}` }, t))),
      el("dl", { class: "facts" },
        el("dt", {}, "last step"), el("dd", { id: "run-last-step" }, r.last_step === null ? "–" : String(r.last_step)),
        el("dt", {}, "last loss"), el("dd", { id: "run-last-loss" }, fmt(num(r.last_loss))),
        el("dt", {}, "steps stored"), el("dd", { id: "run-steps-stored" }, String(r.steps_stored)),
        el("dt", {}, "tensors"), el("dd", {}, String(r.num_tensors)),
        el("dt", {}, "host"), el("dd", {}, r.host || "–"),
        el("dt", {}, "open incidents"), el("dd", {}, this.incidentsLink("run-open-incidents", r.open_incidents ?? 0)),
        el("dt", {}, "open alerts"), el("dd", {}, this.incidentsLink("run-open-alerts", r.open_alerts))),
      el("a", { href: `#/compare?a=${r.id}`, class: "small" }, "Compare with another run…"),
      this.downloads,
    );
    // run notes (web/js/notes.js): shown and edited under the verdict, the editor kept across its redraws
    mountNotes(this.notesHost, r, (run) => this.store.setRun(run));
  }

  /** A live step `d` from the stream: the run's last step, loss and steps stored follow it (in the store's
   * run, without a redraw). */
  liveStep(d) {
    const r = this.store.get("run");
    if (r.last_step === null || d.step > r.last_step) {
      r.last_step = d.step;
      r.last_loss = d.loss;
      document.getElementById("run-last-step").textContent = String(d.step);
      document.getElementById("run-last-loss").textContent = fmt(num(d.loss));
    }
    if (d.steps_stored > r.steps_stored) {
      // beside the last step, the count follows it too (it stayed at the page's first fetch, so a live
      // run read "last step 263, steps stored 221": steps that looked lost)
      r.steps_stored = d.steps_stored;
      document.getElementById("run-steps-stored").textContent = String(r.steps_stored);
    }
  }
}
