// The pages' shared state: each view creates a store, its panels subscribe to the keys they render from
// and are notified on every change, so no panel keeps a private copy. The run page's holds the run, its
// tensors, events, incidents, alerts, layer ranking and recipe commands, each with the error of its last
// failed request. The tensor list is fetched once per page (or taken from the heatmap's header, which
// carries it) and shared by the recipe editor and the block histogram; a drill-down's answer names its
// layer's tensors itself. The incidents and alerts are read together, one request each per refresh, and
// serve the incidents panel, the verdict, the curves' markers, the post-mortem and the layers' table; the
// layer ranking serves that table and the block histogram.

import { api } from "./api.js";

const byStepThenId = (a, b) => a.step - b.step || a.id - b.id;
const newestFirst = (a, b) => b.id - a.id;
/** Open incidents before acknowledged ones, newest first within each. */
const openThenNewest = (a, b) => (a.state === b.state ? b.id - a.id : a.state === "open" ? -1 : 1);
const ALERTS_LIMIT = 500; // the alerts a refresh reads (newest first)
const INCIDENTS_LIMIT = 200;

/** A list `read` from the service merged with the copies the page holds (`known`): a known copy updated later
 * than the read's (`updated_at`) is kept, as is one the read does not list (it came after the read). */
function newerCopies(read, known) {
  const knownById = new Map(known.map((x) => [x.id, x]));
  const newer = (k, x) => k !== undefined && Date.parse(k.updated_at) > Date.parse(x.updated_at);
  const merged = read.map((x) => (newer(knownById.get(x.id), x) ? knownById.get(x.id) : x));
  const listed = new Set(read.map((x) => x.id));
  return merged.concat(known.filter((k) => !listed.has(k.id)));
}

/** A page's state: named values, each with the error of its last failed request, and the functions to call
 * when one changes. Every view creates one; its panels render from it. */
export class Store {
  constructor(state = {}) {
    this.state = { ...state };
    this.errors = {}; // key -> the Error of its last failed request (cleared by the next set)
    this.listeners = new Map(); // key -> Set of fn(value, store)
  }

  get(key) {
    return this.state[key];
  }

  error(key) {
    return this.errors[key] || null;
  }

  set(key, value) {
    this.state[key] = value;
    delete this.errors[key];
    this.notify(key);
  }

  /** Record a failed request for `key` (its panels show an error state); the value is kept. */
  fail(key, err) {
    this.errors[key] = err;
    this.notify(key);
  }

  /** Call `fn(value, store)` on every change of one of `keys`; returns the unsubscribe function. */
  subscribe(keys, fn) {
    for (const key of [].concat(keys)) {
      if (!this.listeners.has(key)) this.listeners.set(key, new Set());
      this.listeners.get(key).add(fn);
    }
    return () => {
      for (const key of [].concat(keys)) this.listeners.get(key).delete(fn);
    };
  }

  /** Set several keys at once: a function subscribed to more than one of them is called once. */
  setAll(values) {
    Object.assign(this.state, values);
    const called = new Set();
    for (const key of Object.keys(values)) {
      delete this.errors[key];
      for (const fn of this.listeners.get(key) || []) {
        if (called.has(fn)) continue;
        called.add(fn);
        fn(this.state[key], this);
      }
    }
  }

  notify(key) {
    for (const fn of this.listeners.get(key) || []) fn(this.state[key], this);
  }
}

/** The run page's store, with the requests that fill it. */
export class RunStore extends Store {
  constructor(runId) {
    // incidents: null until their first load; nonfinite: the nonfinite alerts a full alert list may have
    // left out (read only when the list came back full)
    super({ run: null, tensors: null, events: [], incidents: null, alerts: [], nonfinite: [], layers: null, commands: new Map() });
    this.runId = runId;
    this.tensorsRequest = null;
    this.runReads = 0; // reads of the run and changes to it, numbered as they start (see loadRun)
    this.incidentsLoaded = false; // a load of the incidents has succeeded (live ones alone do not count)
    this.nonfiniteLoaded = false;
  }

  /** The run's tensors, fetched at most once (a failed request is retried on the next call). */
  tensors() {
    if (this.state.tensors) return Promise.resolve(this.state.tensors);
    this.tensorsRequest ||= api(`/runs/${this.runId}/tensors`).then(
      (tensors) => {
        if (!this.state.tensors) this.set("tensors", tensors);
        return this.state.tensors;
      },
      (err) => {
        this.tensorsRequest = null;
        this.fail("tensors", err);
        throw err;
      },
    );
    return this.tensorsRequest;
  }

  /** The run as a change the page made or was told of (a save's answer, the stream's "run" event): a read of
   * the run that started before it no longer replaces it. */
  setRun(run) {
    this.runReads += 1;
    this.set("run", run);
  }

  /** GET /runs/{id}; failures are recorded and rethrown; resolves to the page's run. Reads are numbered as
   * they start: an answer that a later read or a change (`setRun`) overtook is dropped (a read in flight
   * during a rename put the old name and tags back). An answer older than the steps the stream has brought
   * meanwhile keeps their last step, loss and count (the header does not step back). */
  async loadRun() {
    const read = ++this.runReads;
    try {
      const run = await api(`/runs/${this.runId}`);
      if (read !== this.runReads) return this.state.run;
      const known = this.state.run;
      if (known && known.id === run.id && known.last_step !== null && !(run.last_step >= known.last_step)) {
        Object.assign(run, { last_step: known.last_step, last_loss: known.last_loss, steps_stored: known.steps_stored });
      }
      this.set("run", run);
    } catch (err) {
      this.fail("run", err);
      throw err;
    }
    return this.state.run;
  }

  /** The run's events (the first 1000 in step order), merged with any the stream delivered meanwhile; a
   * failure is recorded, not thrown. */
  async loadEvents() {
    try {
      const loaded = await api(`/runs/${this.runId}/events?limit=1000`);
      const ids = new Set(loaded.map((e) => e.id));
      const streamed = (this.state.events || []).filter((e) => !ids.has(e.id));
      this.set("events", streamed.length ? [...loaded, ...streamed].sort(byStepThenId) : loaded);
    } catch (err) {
      this.fail("events", err);
    }
  }

  /** The run's incidents (open first, newest first) and alerts (newest first), one request each; a failure
   * is recorded under `incidents` (the panel and the verdict show it), not thrown, and what was loaded before
   * (and live alerts) stays. When the alert list comes back full, a flood of other alerts may have pushed the
   * nonfinite ones (which name the run's first non-finite value) out of it: those are read once apart. */
  async loadAlerts() {
    let incidents;
    let alerts;
    try {
      [incidents, alerts] = await Promise.all([
        api(`/runs/${this.runId}/incidents?limit=${INCIDENTS_LIMIT}`),
        api(`/runs/${this.runId}/alerts?limit=${ALERTS_LIMIT}`),
      ]);
    } catch (err) {
      this.fail("incidents", err);
      return;
    }
    this.incidentsLoaded = true;
    // a read is not the last word: an acknowledgement's answer or the stream may have brought a later copy
    // meanwhile (two quick acknowledgements: the first one's read answered after the second was shown)
    this.setAll({
      incidents: newerCopies(incidents, this.state.incidents || []).sort(openThenNewest),
      alerts: newerCopies(alerts, this.state.alerts || []).sort(newestFirst),
    });
    if (alerts.length >= ALERTS_LIMIT && !this.nonfiniteLoaded) await this.loadNonfinite();
  }

  async loadNonfinite() {
    try {
      this.set("nonfinite", await api(`/runs/${this.runId}/alerts?kind=nonfinite&limit=50`));
      this.nonfiniteLoaded = true;
    } catch (err) {
      console.warn("nonfinite alerts", err);
    }
  }

  /** An alert from an acknowledgement's answer or the stream, in place of its older copy. */
  upsertAlert(alert) {
    const alerts = (this.state.alerts || []).filter((a) => a.id !== alert.id);
    this.set("alerts", [...alerts, alert].sort(newestFirst));
  }

  /** An incident from an acknowledgement's answer or the stream, in place of its older copy. A failed first
   * load stays reported (the list may still lack older incidents). */
  upsertIncident(incident) {
    const incidents = (this.state.incidents || []).filter((i) => i.id !== incident.id);
    this.state.incidents = [...incidents, incident].sort(openThenNewest);
    this.notify("incidents");
  }

  /** The service's ranking of the run's layers (GET /runs/{id}/layers: the layers table and the block
   * histogram); a failure is recorded (the last ranking stays, under the error), not thrown. */
  async loadLayers() {
    try {
      this.set("layers", await api(`/runs/${this.runId}/layers`));
    } catch (err) {
      this.fail("layers", err);
    }
  }

  /** The run's recipe commands (id -> command); a failure is recorded (the audit trail shows it), not thrown. */
  async loadCommands() {
    try {
      const commands = await api(`/runs/${this.runId}/commands`);
      this.set("commands", new Map(commands.map((c) => [c.id, c])));
    } catch (err) {
      this.fail("commands", err);
    }
  }

  /** A command from a POST answer or the stream. The two may arrive in either order: a state is never
   * stepped back (pending -> delivered -> applied / rejected). */
  upsertCommand(command) {
    const commands = this.state.commands;
    const old = commands.get(command.id);
    const rank = { pending: 0, delivered: 1, applied: 2, rejected: 2 };
    if (old && rank[command.state] < rank[old.state]) return;
    this.state.commands = new Map(commands).set(command.id, command);
    this.notify("commands"); // a failed load stays reported: the trail may still lack older commands
  }

  /** A live event from the stream, under its stored id (as `GET /runs/{id}/events/{event_id}` knows it); one
   * the list already holds (a load and the stream may both deliver it) is not added twice. */
  pushEvent(e) {
    const events = this.state.events || [];
    if (events.some((x) => x.id === e.id)) return;
    this.set("events", [...events, e]);
  }
}
