// The run page's verdict: one line under the header that says how the run stands (running, finished,
// crashed; a loss gone non-finite) and names each incident, its root cause and step, each a link to the
// incident in the incidents panel. A user sees what went wrong before scrolling.

import { num } from "./api.js";
import { badge, el, fmt, nonfiniteValue, replace } from "./dom.js";
import { SEVERITY_KIND } from "./incidents.js";
import { nonfiniteSpans } from "./nonfinite.js";

const SHOWN = 3; // incidents named in the line; the rest are counted, with a link to the panel
const RANK = { critical: 3, warning: 2, info: 1, ok: 0 };
const ENDED = { finished: "Finished", crashed: "Crashed", interrupted: "Interrupted", halted: "Halted" };


/** The incidents in the order the line names them: open before acknowledged, worst first, then earliest. */
export function rankIncidents(incidents) {
  return [...incidents].sort((a, b) =>
    (a.state === "open" ? 0 : 1) - (b.state === "open" ? 0 : 1)
    || (RANK[b.severity] ?? 0) - (RANK[a.severity] ?? 0)
    || a.first_step - b.first_step
    || a.id - b.id);
}

/**
 * The verdict's parts: {kind: ok | info | warn | bad, head, incidents (ranked), more}.
 * @param run the run (GET /runs/{id})
 * @param incidents the run's incidents (GET /runs/{id}/incidents)
 * @param nonfiniteFrom the first step of the loss's last non-finite span when it reaches the run's last
 *   step (null: the loss ends finite or is not known yet)
 */
export function verdictOf(run, incidents, nonfiniteFrom = null) {
  const ranked = rankIncidents(incidents);
  const open = ranked.filter((i) => i.state === "open");
  // a run whose last loss is non-finite diverged, whatever its status says
  const diverged = nonfiniteValue(run.last_loss);
  let head = stateHead(run, nonfiniteFrom);
  let kind;
  if (diverged || run.status === "crashed" || run.status === "halted" || open.some((i) => i.severity === "critical")) kind = "bad";
  else if (open.length || run.status === "interrupted") kind = "warn";
  else kind = run.status === "running" ? "info" : "ok";
  if (!incidents.length) head += run.status === "running" ? ": no incident so far." : ": no incident.";
  else head += open.length ? `: ${open.length} open incident${open.length === 1 ? "" : "s"}` : `: ${incidents.length} incident${incidents.length === 1 ? "" : "s"}, all acknowledged`;
  return { kind, head, incidents: ranked.slice(0, SHOWN), more: Math.max(0, ranked.length - SHOWN) };
}

/** How the run stands, without its incidents: "Finished at step 16, with a NaN loss from step 9 to the
 * end". */
function stateHead(run, nonfiniteFrom) {
  const step = run.last_step === null || run.last_step === undefined ? null : run.last_step;
  let head;
  if (run.status === "running") head = step === null ? "Running, no step yet" : `Running, step ${step}`;
  else head = `${ENDED[run.status] || `Ended (${run.status})`}${step === null ? "" : ` at step ${step}`}`;
  if (!nonfiniteValue(run.last_loss)) return head;
  const loss = fmt(num(run.last_loss));
  return nonfiniteFrom !== null && nonfiniteFrom !== step
    ? `${head}, with a ${loss} loss from step ${nonfiniteFrom} to the end`
    : `${head}, with a ${loss} loss`;
}

/** The root cause of an incident in words, where its title does not say it already ("root cause
 * scale_collapse in blocks.2.mlp.fc.weight, step 121"); "" when the title names it. */
export function rootText(incident) {
  const root = incident.root;
  if (!root) return "";
  const step = root.onset_step ?? root.first_step;
  const named = root.kind === incident.kind && (!root.tensor_name || incident.title.includes(root.tensor_name))
    && incident.title.includes(`step ${step}`);
  if (named) return "";
  const where = root.tensor_name ? ` in ${root.tensor_name}` : "";
  return `root cause ${root.kind}${where}, step ${step}`;
}

export class Verdict {
  /** @param reveal called with an incident id when its link is clicked (opens it in the panel) */
  constructor(reveal) {
    this.reveal = reveal;
    this.node = el("div", { id: "run-verdict", class: "verdict", role: "status" });
    this.run = null;
    this.incidents = null; // null until the incidents have loaded: the line waits for them
    this.nonfiniteFrom = null;
  }

  setRun(run) {
    this.run = run;
    this.render();
  }

  /** The run's incidents, or (null, error) when they could not be loaded (the line says so). */
  setIncidents(incidents, error = null) {
    this.incidents = incidents;
    this.error = incidents === null ? error : null;
    this.render();
  }

  /** The loss series (steps, values): where its last non-finite span began, if it reaches the end. */
  setLoss(steps, values) {
    const last = nonfiniteSpans(steps, values).at(-1);
    const from = last && last[1] === steps.at(-1) ? last[0] : null;
    if (from === this.nonfiniteFrom) return;
    this.nonfiniteFrom = from;
    this.render();
  }

  render() {
    if (!this.run) return;
    if (this.incidents === null) {
      // the run is known, its incidents not yet (or not at all): its state alone, so the line takes its
      // place at once
      const head = stateHead(this.run, this.nonfiniteFrom);
      if (this.error) {
        this.node.className = "verdict warn";
        this.node.dataset.kind = "warn";
        replace(this.node, el("b", { class: "verdict-head" }, `${head}.`),
          el("span", { class: "error" }, ` Its incidents could not be loaded: ${this.error.message}`));
      } else {
        replace(this.node, el("b", { class: "verdict-head" }, `${head}…`));
      }
      return;
    }
    const v = verdictOf(this.run, this.incidents, this.nonfiniteFrom);
    this.node.className = `verdict ${v.kind}`;
    this.node.dataset.kind = v.kind;
    const items = v.incidents.map((i) => el("li", { class: `verdict-item ${i.state}` },
      badge(i.severity, SEVERITY_KIND[i.severity] || ""), " ",
      el("a", {
        href: `#/runs/${this.run.id}?incident=${i.id}`, class: "verdict-link", dataset: { incidentId: i.id },
        onclick: (ev) => {
          ev.preventDefault();
          this.reveal(i.id);
        },
      }, i.title),
      el("span", { class: "muted" }, [rootText(i), i.state === "open" ? "" : "acknowledged"].filter(Boolean).map((t) => ` · ${t}`).join(""))));
    const more = v.more
      ? el("li", { class: "verdict-more" }, el("a", {
        href: "#incidents", onclick: (ev) => {
          ev.preventDefault();
          this.reveal(null);
        },
      }, `and ${v.more} more in Incidents`))
      : null;
    replace(this.node, el("b", { class: "verdict-head" }, v.head), items.length || more ? el("ul", { class: "verdict-list" }, items, more) : null);
  }
}
