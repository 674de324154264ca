// The run page's diverging-layers table: the service's ranking of the layers, with the run's open alerts
// counted at once (a layer never shows healthier than its own open alerts), SQNR and block range columns,
// the reasons folded into one line; a click on a layer opens its drill-down.

import { num } from "./api.js";
import { badge, el, fmt, replace } from "./dom.js";
import { SEVERITY_KIND } from "./incidents.js";

const SEVERITY_RANK = { ok: 0, info: 1, warning: 2, critical: 3 };

/** The diverging-layers table; clicking a layer opens its drill-down. The ranking (which the block
 * histogram reads too) and the alerts it counts are the page store's. */
export class Layers {
  constructor(container, store, onPick) {
    this.runId = store.runId;
    this.store = store;
    this.onPick = onPick;
    this.showAll = false;
    this.body = el("tbody");
    this.more = el("button", { type: "button", class: "small", hidden: true }, "Show all layers");
    this.more.addEventListener("click", () => {
      this.showAll = !this.showAll;
      this.fill();
    });
    container.append(
      el("table", { id: "layers-table", class: "layers" }, el("thead", {}, el("tr", {}, el("th", {}, "Layer"), el("th", {}, "Severity"),
        el("th", { title: "the worst latest SQNR of the layer's tensors (blank: the run sends no quality statistics)" }, "SQNR (dB)"),
        el("th", { title: "the widest latest block range log2(max/min|x|) of the layer's block-scaled tensors, and the largest share of blocks with the scale at a limit (blank: the run sends no block statistics)" }, "Block range"),
        el("th", {}, "Reasons"))), this.body),
      this.more,
    );
  }

  /** The engine's ranking, with every open alert counted at once: a layer never shows healthier than its
   * own open alerts while the ranking is being refreshed (the alerts and the table share one store). */
  merged() {
    const byLayer = new Map();
    for (const a of this.store.get("alerts")) {
      if (a.state !== "open" || !a.layer) continue;
      const worst = byLayer.get(a.layer);
      if (!worst || SEVERITY_RANK[a.severity] > SEVERITY_RANK[worst.severity]) byLayer.set(a.layer, a);
    }
    const layers = (this.store.get("layers") || []).map((l) => {
      const a = byLayer.get(l.layer);
      if (!a || SEVERITY_RANK[a.severity] <= SEVERITY_RANK[l.severity]) return l;
      return { ...l, severity: a.severity, reasons: [`${a.kind}: ${a.message}`, ...(l.reasons || [])] };
    });
    return layers.sort((x, y) => SEVERITY_RANK[y.severity] - SEVERITY_RANK[x.severity]);
  }

  /** Draw the store's ranking; a failed request shows its error above the last ranking loaded. */
  fill() {
    const error = this.store.error("layers");
    const layers = this.merged();
    const shown = this.showAll ? layers : layers.slice(0, 25);
    this.more.hidden = layers.length <= 25;
    this.more.textContent = this.showAll ? "Show the 25 worst" : `Show all ${layers.length} layers`;
    replace(
      this.body,
      error ? errorRow(5, "layers-error", `Could not load the layers: ${error.message}`) : null,
      shown.map((l) =>
        el(
          "tr",
          { class: "clickable", onclick: () => this.onPick(l.layer), title: "open the drill-down" },
          el("td", { class: "name" }, l.layer),
          el("td", {}, badge(l.severity, SEVERITY_KIND[l.severity] || "")),
          el("td", { class: "num sqnr" }, sqnrText(l.sqnr_db)),
          el("td", { class: "num block-range" }, blockText(l.block_range, l.block_at_limit, l.block_zero)),
          el("td", { class: "reasons-cell" }, reasonsList(l.reasons || [])),
        ),
      ),
    );
  }
}

/** A layer's SQNR in dB to one decimal ("" when it has none, "+Inf" for an exact round trip). */
function sqnrText(value) {
  if (value === null || value === undefined) return "";
  const v = num(value);
  return Number.isFinite(v) ? v.toFixed(1) : fmt(v);
}

/** A layer's worst block range in binades, with its share of blocks at a scale limit (values the format
 * could not follow) and, apart, its share of all-zero blocks (sparsity, padding: nothing lost), when there
 * are any. */
function blockText(range, atLimit, zero) {
  if (range === null || range === undefined) return "";
  const r = num(range);
  const text = Number.isFinite(r) ? r.toFixed(1) : fmt(r);
  const parts = [[atLimit, "at limit"], [zero, "zero"]]
    .filter(([share]) => num(share) > 0)
    .map(([share, what]) => `${percent(num(share))}% ${what}`);
  return parts.length ? `${text} (${parts.join(", ")})` : text;
}

/** A share in percent to one decimal; under 0.05% it is not "0.0%": some blocks are there. */
function percent(share) {
  return share < 0.0005 ? "<0.1" : (100 * share).toFixed(1);
}

/** A table row that says a request failed (instead of an empty table). */
export function errorRow(colspan, id, text) {
  return el("tr", { class: "error-row" }, el("td", { colspan, class: "error", id }, text));
}

/** A layer's reasons folded into one line: the first, cut to the cell's width, and a button that unfolds
 * the rest (a NaN run's 16 layers repeating every alert's text filled pages); a click on the line itself
 * opens the layer's drill-down as anywhere on the row. */
function reasonsList(reasons) {
  if (!reasons.length) return el("span", { class: "muted" }, "healthy");
  const line = el("span", { class: "reason-line", title: reasons[0] }, reasons[0]);
  if (reasons.length === 1) return el("div", { class: "reasons-fold" }, line);
  const rest = el("ul", { class: "reasons", hidden: true }, reasons.slice(1).map((r) => el("li", {}, r)));
  const more = el("button", {
    type: "button", class: "small reasons-more", "aria-expanded": "false", title: "show every reason",
    onclick: (ev) => {
      ev.stopPropagation();
      rest.hidden = !rest.hidden;
      more.setAttribute("aria-expanded", String(!rest.hidden));
      more.textContent = rest.hidden ? `+${reasons.length - 1}` : "less";
    },
  }, `+${reasons.length - 1}`);
  return [el("div", { class: "reasons-fold" }, line, more), rest];
}
