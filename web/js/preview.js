// The run page's first frame, drawn on a <canvas> before plotly.js has loaded: the heatmap from the packed
// heatmap data and the loss / grad-norm curves from the series the page fetched anyway. plotly.js (4.8 MB)
// takes longer to load and compile than the data takes to arrive; once it has, it draws the interactive
// plots in the same places and the canvases are removed. These drawings carry no interaction.

/** plotly's "Viridis" (the amax heatmap's colour scale), copied from plotly.js so both draw the same colours. */
const VIRIDIS = [
  [0, "#440154"], [0.06274509803921569, "#48186a"], [0.12549019607843137, "#472d7b"], [0.18823529411764706, "#424086"],
  [0.25098039215686274, "#3b528b"], [0.3137254901960784, "#33638d"], [0.3764705882352941, "#2c728e"],
  [0.4392156862745098, "#26828e"], [0.5019607843137255, "#21918c"], [0.5647058823529412, "#1fa088"],
  [0.6274509803921569, "#28ae80"], [0.6901960784313725, "#3fbc73"], [0.7529411764705882, "#5ec962"],
  [0.8156862745098039, "#84d44b"], [0.8784313725490196, "#addc30"], [0.9411764705882353, "#d8e219"], [1, "#fde725"],
];
const GREY = [[0, "#dddddd"], [1, "#333333"]]; // a named plotly scale other than Viridis: a neutral fallback

const hexRgb = (h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));

/** A 256-entry RGB lookup table of a colour scale ([[fraction, "#rrggbb"], ...]). */
function lut(scale) {
  const stops = scale.map(([f, h]) => [f, hexRgb(h)]);
  const out = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const f = i / 255;
    let k = 1;
    while (k < stops.length - 1 && stops[k][0] < f) k++;
    const [f0, c0] = stops[k - 1];
    const [f1, c1] = stops[k];
    const t = f1 > f0 ? Math.min(1, Math.max(0, (f - f0) / (f1 - f0))) : 0;
    for (let j = 0; j < 3; j++) out[i * 3 + j] = Math.round(c0[j] + t * (c1[j] - c0[j]));
  }
  return out;
}

/** A canvas of `width` x `height` CSS pixels, sharp on high-DPI screens; returns [canvas, 2d context]. */
function canvas(id, width, height) {
  const dpr = window.devicePixelRatio || 1;
  const c = document.createElement("canvas");
  c.id = id;
  c.className = "preview";
  c.width = Math.round(width * dpr);
  c.height = Math.round(height * dpr);
  c.style.width = `${width}px`;
  c.style.height = `${height}px`;
  const ctx = c.getContext("2d");
  ctx.scale(dpr, dpr);
  return [c, ctx];
}

/**
 * The heatmap's cells and row labels.
 *
 * Args:
 *   z: rows of colour values (null: no data), as the plotly trace gets them; `specials`: [[r, c, colour]]
 *   (non-finite cells, drawn in their own colours as squares of `markerSize` px, as plotly's marker traces
 *   are); `labels`: [[row, text]]; `margin` {l, r, t, b} and `right` (pixels right of the cells: the
 *   colour bar) as the plotly layout; `colorscale`: the plotly trace's, drawn as it is when given as
 *   [[fraction, "#rrggbb"], ...] (a named one: Viridis for amax, else grey).
 */
export function heatmapPreview({ width, height, z, C, specials, labels, margin, right, metric, colorscale, markerSize, range }) {
  const R = z.length;
  const [c, ctx] = canvas("heatmap-preview", width, height);
  const cellsW = Math.max(1, width - margin.l - margin.r - right);
  const cellsH = Math.max(1, height - margin.t - margin.b);
  if (R && C) {
    // the colours' range: as plotly's trace gets it (`range`), or fitted to the data
    let [lo, hi] = range || [Infinity, -Infinity];
    if (!range) for (const row of z) for (const v of row) if (v !== null) { if (v < lo) lo = v; if (v > hi) hi = v; }
    const span = hi > lo ? hi - lo : 1;
    const table = lut(Array.isArray(colorscale) ? colorscale : metric === "amax" ? VIRIDIS : GREY);
    // one pixel per cell, scaled up without smoothing: the same blocks plotly draws with zsmooth false
    const image = new ImageData(C, R);
    const px = image.data;
    for (let r = 0; r < R; r++) {
      const row = z[r];
      for (let k = 0; k < C; k++) {
        const v = row[k];
        if (v === null) continue; // transparent, as plotly leaves a gap
        const i = Math.round(((v - lo) / span) * 255) * 3;
        const o = (r * C + k) * 4;
        px[o] = table[i];
        px[o + 1] = table[i + 1];
        px[o + 2] = table[i + 2];
        px[o + 3] = 255;
      }
    }
    const cells = document.createElement("canvas");
    cells.width = C;
    cells.height = R;
    cells.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cells, margin.l, margin.t, cellsW, cellsH);
    // non-finite cells as plotly's markers: squares of `markerSize` px over the cell's centre
    const cellW = cellsW / C;
    const cellH = cellsH / R;
    for (const [r, k, colour] of specials) {
      const w = Math.max(cellW, markerSize);
      const h = Math.max(cellH, markerSize);
      ctx.fillStyle = colour;
      ctx.fillRect(margin.l + (k + 0.5) * cellW - w / 2, margin.t + (r + 0.5) * cellH - h / 2, w, h);
    }
  }
  ctx.fillStyle = "#444";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const rowH = R ? cellsH / R : 0;
  ctx.font = `${Math.min(11, Math.max(7, Math.floor(rowH)))}px sans-serif`;
  for (const [r, text] of labels) ctx.fillText(text, margin.l - 6, margin.t + (r + 0.5) * rowH);
  return c;
}

/** The curves: each line {steps, values, colour, domain: [bottom, top] as a fraction of the plot's height}. */
export function curvesPreview({ width, height, margin, lines }) {
  const [c, ctx] = canvas("curves-preview", width, height);
  const plotW = Math.max(1, width - margin.l - margin.r);
  const plotH = Math.max(1, height - margin.t - margin.b);
  let x0 = Infinity;
  let x1 = -Infinity;
  for (const { steps } of lines) if (steps.length) { x0 = Math.min(x0, steps[0]); x1 = Math.max(x1, steps[steps.length - 1]); }
  if (!(x1 >= x0)) return c;
  const xs = (s) => margin.l + ((s - x0) / (x1 > x0 ? x1 - x0 : 1)) * plotW;
  ctx.strokeStyle = "#e5e5e5";
  for (const { domain } of lines) {
    ctx.strokeRect(margin.l, margin.t + (1 - domain[1]) * plotH, plotW, (domain[1] - domain[0]) * plotH);
  }
  for (const { steps, values, colour, domain } of lines) {
    const finite = values.filter(Number.isFinite);
    if (!finite.length) continue;
    let lo = Infinity;
    let hi = -Infinity;
    for (const v of finite) { if (v < lo) lo = v; if (v > hi) hi = v; }
    const pad = hi > lo ? 0.05 * (hi - lo) : Math.abs(lo) || 1;
    const top = margin.t + (1 - domain[1]) * plotH;
    const h = (domain[1] - domain[0]) * plotH;
    const ys = (v) => top + (1 - (v - (lo - pad)) / (hi - lo + 2 * pad)) * h;
    ctx.strokeStyle = colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false; // a non-finite value breaks the line, as plotly's null does
    for (let i = 0; i < steps.length; i++) {
      const v = values[i];
      if (!Number.isFinite(v)) {
        pen = false;
        continue;
      }
      if (pen) ctx.lineTo(xs(steps[i]), ys(v));
      else ctx.moveTo(xs(steps[i]), ys(v));
      pen = true;
    }
    ctx.stroke();
  }
  return c;
}

/** Call `fn` once the browser has painted what is in the DOM now (the next frame, then a task). */
export function afterPaint(fn) {
  requestAnimationFrame(() => setTimeout(fn, 0));
}

/** Paint a plot's first frame once, from its first data, before plotly.js is used (the heatmap's and the
 * curves' one path): `paint()` draws it and returns the canvas it put on screen (null: none), and `done`
 * (the page's first-frame callback; null when the page wants none) is told whether there is one. Returns
 * the callback's new value, null: it is spent. */
export function paintFirstFrame(done, paint) {
  if (done) done(Boolean(paint()));
  return null;
}
