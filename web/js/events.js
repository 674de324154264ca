// The job's own events (`kind: "custom"`, named in `details.name`: checkpoints, evaluations, injected faults)
// as the run page reads them: a named number as a series, the numbers a chart can be made of, a line of
// text for a marker's hover. Shared by the curves (markers, the val loss) and the scalars picker.

import { num } from "./api.js";

/** (steps, values) of the number `key` in the run's custom events named `name` (e.g. eval / val_loss). */
export function eventSeries(events, name, key) {
  const points = events
    .filter((e) => e.kind === "custom" && e.details && e.details.name === name && typeof num(e.details[key]) === "number")
    .map((e) => [e.step, num(e.details[key])])
    .sort((a, b) => a[0] - b[0]);
  return { steps: points.map((p) => p[0]), values: points.map((p) => p[1]) };
}

/** The chartable numbers of the run's custom events, as "<event name>.<detail key>". */
export function eventScalarNames(events) {
  const names = new Set();
  for (const e of jobEvents(events)) {
    for (const [k, v] of Object.entries(e.details)) if (k !== "name" && typeof v === "number") names.add(`${e.details.name}.${k}`);
  }
  return [...names].sort();
}

/** The job's own named events (checkpoints, evaluations, injections), not the monitor's histogram captures. */
export function jobEvents(events) {
  return events.filter((e) => e.kind === "custom" && e.details && typeof e.details.name === "string" && !("histogram" in e.details));
}

export function eventText(e) {
  const rest = Object.entries(e.details).filter(([k]) => k !== "name").map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`);
  return `${e.details.name} at step ${e.step}${rest.length ? `: ${rest.join(", ")}` : ""}`;
}
