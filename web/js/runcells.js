// How the runs list shows a run's values: dates, durations and the loss sparkline.

/** An ISO date as local "YYYY-MM-DD HH:MM". */
export function dateTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  const two = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}`;
}

/** A run's duration in seconds: from its registration to its last telemetry (so a live run's grows); the
 * service sorts by the same. */
export function durationSeconds(run) {
  const start = Date.parse(run.created_at);
  return Math.max(0, (Date.parse(run.last_telemetry_at || run.created_at) - start) / 1000);
}

/** Seconds as "42 s", "12 min 05 s", "3 h 07 min", "2 d 4 h". */
export function durationText(seconds) {
  const s = Math.round(seconds);
  const two = (n) => String(n).padStart(2, "0");
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${two(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${two(Math.floor(s / 60) % 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor(s / 3600) % 24} h`;
}

const SVG = "http://www.w3.org/2000/svg";
const SPARK_W = 140;
const SPARK_H = 28;

/** An inline SVG sparkline of (steps, values); non-finite values are marked with a red dot. */
export function sparkline(steps, values) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", SPARK_W);
  svg.setAttribute("height", SPARK_H);
  svg.setAttribute("class", "sparkline");
  const pts = [];
  let lo = Infinity;
  let hi = -Infinity;
  steps.forEach((s, i) => {
    const v = values[i];
    if (Number.isFinite(v)) {
      lo = Math.min(lo, v);
      hi = Math.max(hi, v);
    }
  });
  if (!steps.length || !Number.isFinite(lo)) return svg;
  const s0 = steps[0];
  const s1 = steps[steps.length - 1];
  const x = (s) => (s1 > s0 ? ((s - s0) / (s1 - s0)) * (SPARK_W - 4) + 2 : SPARK_W / 2);
  const y = (v) => (hi > lo ? SPARK_H - 2 - ((v - lo) / (hi - lo)) * (SPARK_H - 4) : SPARK_H / 2);
  const bad = [];
  steps.forEach((s, i) => {
    const v = values[i];
    if (Number.isFinite(v)) pts.push(`${x(s).toFixed(1)},${y(v).toFixed(1)}`);
    else bad.push(x(s));
  });
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", pts.join(" "));
  line.setAttribute("class", "spark-line");
  svg.appendChild(line);
  for (const bx of bad) {
    const dot = document.createElementNS(SVG, "circle");
    dot.setAttribute("cx", bx.toFixed(1));
    dot.setAttribute("cy", String(SPARK_H / 2));
    dot.setAttribute("r", "2.5");
    dot.setAttribute("class", "spark-bad");
    svg.appendChild(dot);
  }
  return svg;
}
