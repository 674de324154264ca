// The run page's first paint: the heatmap and the curves on canvases as soon as their data is here, plotly.js
// (loaded meanwhile by the page's preload) compiled only after that frame is on screen; and when each plot
// was drawn with its data and when its pixels were on screen, for the tests and the benchmark.

import { deferPlotly } from "./dom.js";
import { noteDrawn, notePainted, previewWanted } from "./hooks.js";
import { afterPaint } from "./preview.js";

const FIRST_FRAMES = ["heatmap", "curves"];

export class PaintTiming {
  constructor() {
    this.drawnAt = {};
    this.paintedAt = {};
    this.dataLoaded = {};
    // first paint without plotly.js: only when it has not loaded yet and the page was not asked to wait for it
    this.preview = previewWanted() && !window.Plotly;
    this.firstFrames = {};
    const framed = FIRST_FRAMES.map((kind) => new Promise((resolve) => {
      this.firstFrames[kind] = (painted) => {
        if (painted) this.painted(kind);
        resolve();
      };
    }));
    if (this.preview) deferPlotly(Promise.all(framed).then(() => new Promise(afterPaint)));
    /** Plot `kind` drawn: counted once its data is loaded too (a plot's callback, hence bound). */
    this.onDrawn = (kind) => {
      if (kind in this.drawnAt || !this.dataLoaded[kind]) return;
      this.drawnAt[kind] = performance.now();
      noteDrawn(kind, { at: this.drawnAt[kind] });
      this.painted(kind);
    };
  }

  /** The moment a plot's pixels are on screen: after the frame that follows drawing it (canvas or plotly). */
  painted(kind) {
    if (kind in this.paintedAt) return;
    this.paintedAt[kind] = null;
    afterPaint(() => {
      this.paintedAt[kind] = performance.now();
      notePainted(kind, this.paintedAt[kind]);
    });
  }

  /** Plot `kind`'s data is loaded (and drawn with it). */
  loaded(kind) {
    this.dataLoaded[kind] = true;
    this.onDrawn(kind);
  }

  /** The first-frame callback plot `kind` is to call, or null when the page paints no canvas frame. */
  firstPaint(kind) {
    return this.preview ? this.firstFrames[kind] : null;
  }

  /** Plot `kind`'s load failed: it has no first frame, and plotly.js is not held back for it. */
  noFrame(kind) {
    this.firstFrames[kind](false);
  }
}
