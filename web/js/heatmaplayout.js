// The geometry heatmaps share (the run page's and the comparison's difference): how high a row is, how big
// the square marking a cell, and the step axis kept in sight under a plot taller than its scroll box.

import { el, replace } from "./dom.js";

/** Side in pixels of the square marking a non-finite cell, for rows `rowH` pixels high. */
export const markerSize = (rowH) => Math.max(6, Math.min(14, rowH + 2));

/** The height in pixels scroll box `box` shows of what it holds (its max-height less its borders); Infinity
 * where it has no max-height. */
export function scrollRoom(box) {
  const style = getComputedStyle(box);
  const max = parseFloat(style.maxHeight);
  if (!Number.isFinite(max)) return Infinity;
  return max - parseFloat(style.borderTopWidth) - parseFloat(style.borderBottomWidth);
}

/** Row height in pixels of a heatmap of `R` rows, `margins` pixels of plot above and below them, in a scroll
 * box `room` pixels high: about 640 px of rows (18 px each at most, 3 at least), fewer where that is what
 * fits the box, so that a plot that can fit shows whole, its step axis and last row included, with no
 * scrolling and no axis strip over its bottom rows (a 48-tensor run on a laptop screen). */
export function rowHeight(R, room, margins) {
  const fit = Math.min(640, room - margins);
  return Math.max(3, Math.min(18, Math.floor(fit / Math.max(1, R))));
}

/** Copy plot `gd`'s step ticks into `strip`, a bar stuck to the bottom of the scroll box `box` that holds
 * both (`.heatmap-axis`: with hundreds of rows the plot's own axis is scrolled out of sight), at the same
 * horizontal positions; the strip is hidden while the whole plot fits in the box (its own axis is then in
 * sight: two would show). Call after every redraw of `gd`. */
export function drawStepAxis(strip, gd, box) {
  const ax = gd._fullLayout && gd._fullLayout.xaxis;
  if (!ax || !ax._vals) return;
  strip.hidden = gd.getBoundingClientRect().height <= scrollRoom(box);
  if (strip.hidden) return;
  const ticks = ax._vals.map((t) => {
    const x = ax._offset + ax.l2p(t.x);
    return el("span", { class: "tick", style: `left: ${x.toFixed(1)}px` }, t.text.replace(/<[^>]*>/g, ""));
  });
  replace(strip, ...ticks, el("span", { class: "axis-title", style: `left: ${(ax._offset + ax._length / 2).toFixed(0)}px` }, "step"));
}
