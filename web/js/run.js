// The run page: header, loss / lr / grad-norm curves with spike and alert markers, the heatmap, the
// diverging-layers table with a drill-down, incidents (their alerts, root cause first) with acknowledge,
// the recipe editor and the post-mortem, all kept live by the run's event stream.
//
// The view creates the page's store (store.js), lays out and builds the panels, wires the store's changes
// to them and follows the run's stream; each panel lives in its own module and renders what it is given.

import { auth, num, subscribe } from "./api.js";
import { BlockHistPanel } from "./blockhist.js";
import { ConfigPanel } from "./configpanel.js";
import { Curves } from "./curves.js";
import { el, panel, replace, throttle } from "./dom.js";
import { drillDown } from "./drilldown.js";
import { Heatmap } from "./heatmap.js";
import { noteStepSeen } from "./hooks.js";
import { IncidentsPanel } from "./incidents.js";
import { Layers } from "./layers.js";
import { PaintTiming } from "./painttiming.js";
import { PostMortem } from "./postmortem.js";
import { RecipeEditor, appliedChanges } from "./recipe.js";
import { RunHeader } from "./runhead.js";
import { Scalars } from "./scalars.js";
import { RunStore } from "./store.js";
import { Verdict } from "./verdict.js";

/** A step of the run shown on this page (the first time counts: the tests' and benchmark's latency). */
const stepSeen = (runId, step) => noteStepSeen(runId, step, { first: true });

/** The page's sections, in reading order: what went wrong first (the verdict under the header, the incidents
 * before the per-layer table). */
function runLayout(container, page) {
  const section = (title, id = null) => {
    const node = panel(title);
    if (id) node.id = id;
    return node;
  };
  const nodes = {
    post: section("Post-mortem", "postmortem"),
    curves: section("Loss, grad norm and learning rate"),
    scalars: section("Scalars", "scalars"),
    config: section("Config", "config"),
    heat: section("Per-tensor heatmap"),
    block: section("Block scale exponents", "block-hist"),
    layers: section("Diverging layers"),
    drill: el("section", { class: "panel", id: "drilldown", hidden: true }),
    alerts: section("Incidents", "incidents"),
    recipe: section("Recipe", "recipe"),
  };
  replace(
    container,
    page.header.node,
    page.verdict.node,
    nodes.curves,
    nodes.heat,
    el("div", { class: "two-col" }, nodes.alerts, nodes.layers),
    nodes.drill,
    nodes.post,
    nodes.block,
    nodes.scalars,
    el("div", { class: "two-col" }, nodes.config, nodes.recipe),
  );
  return nodes;
}

/** Open layer `layer`'s drill-down in `node` (one request of only its rows), scrolled into view. */
async function openDrillDown(node, runId, layer) {
  node.hidden = false;
  try {
    await drillDown(node, runId, layer);
    node.scrollIntoView({ behavior: "smooth", block: "start" });
  } catch (err) {
    replace(node, el("p", { class: "error" }, `drill-down failed: ${err.message}`));
  }
}

/** Build the page's panels into `page` (header and verdict first, then the sections they sit above). */
function buildPanels(container, page, store, { incident, metric, timing }) {
  const runId = store.runId;
  page.verdict = new Verdict((id) => page.alerts.reveal(id));
  page.header = new RunHeader(store, page.verdict.node, () => page.alerts.reveal(null));
  const nodes = runLayout(container, page);
  page.curves = new Curves(nodes.curves, runId, timing.onDrawn, timing.firstPaint("curves"),
    (loss) => page.verdict.setLoss(loss.steps, loss.values));
  page.scalars = new Scalars(nodes.scalars, runId);
  page.config = new ConfigPanel(nodes.config, runId, (run) => store.setRun(run));
  page.heatmap = new Heatmap(nodes.heat, { runId, metric, onDrawn: timing.onDrawn, firstPaint: timing.firstPaint("heatmap") });
  page.layers = new Layers(nodes.layers, store, (layer) => openDrillDown(nodes.drill, runId, layer));
  page.post = new PostMortem(nodes.post, runId, page.heatmap);
  page.alerts = new IncidentsPanel(nodes.alerts, store, { focus: incident });
  page.recipe = new RecipeEditor(nodes.recipe, runId, store);
  page.blockHist = new BlockHistPanel(nodes.block, runId, store);
  // the events feed the curves' markers and evaluation curve: a failed request says so under the curves
  page.eventsError = el("p", { class: "error", id: "events-error", hidden: true });
  nodes.curves.append(page.eventsError);
  // the layers table says whether the run sends block statistics (and which tensor has the widest blocks)
  page.loadLayers = () => store.loadLayers().then(() => page.blockHist.update(store.get("layers"))).catch((err) => console.warn("block histogram", err));
  return page;
}

/** What each change of the store redraws. Until the first loads are done (`gate.ready`) only the header,
 * the verdict and the events' error follow the run; the panels are filled in order by `firstLoad`. */
function wireStore(store, page, gate) {
  const { curves, post, layers, heatmap, recipe, config, scalars, alerts, verdict } = page;
  // the incidents and alerts (loaded and kept live by the store) in the incidents panel and the verdict
  store.subscribe(["incidents", "alerts"], () => alerts.fill());
  store.subscribe("incidents", (list, s) => {
    if (s.incidentsLoaded) verdict.setIncidents(list, null);
    else if (s.error("incidents")) verdict.setIncidents(null, s.error("incidents"));
  });
  // the layers' ranking (its block statistics also show the block histogram, once loaded: `loadLayers`)
  store.subscribe("layers", () => layers.fill());
  // the alerts as markers on the curves, in the post-mortem, and counted at once in the layers' ranking
  store.subscribe("alerts", (list, s) => {
    curves.setMarkers(list, s.get("events"));
    post.update(s.get("run"), list, s.get("events"), s.get("nonfinite"));
    layers.fill();
  });
  // the nonfinite alerts a full alert list may have left out, for the post-mortem's first non-finite value
  store.subscribe("nonfinite", (nonfinite, s) => post.update(s.get("run"), s.get("alerts"), s.get("events"), nonfinite));
  // where each applied recipe change took effect, on the curves and the heatmap (loaded, posted, streamed)
  store.subscribe("commands", (commands) => {
    const changes = appliedChanges(commands);
    curves.setChanges(changes);
    heatmap.setChanges(changes);
  });
  store.subscribe("run", (run) => {
    if (!run) return; // the first request failed: the page reports it
    page.header.render();
    page.verdict.setRun(run);
    if (!gate.ready) return;
    recipe.setRun(run);
    config.fill(run);
    scalars.setSources(run, store.get("events"));
    post.update(run, store.get("alerts"), store.get("events"), store.get("nonfinite"));
  });
  // the events feed the curves' markers and evaluation curve, the scalars picker and the post-mortem: a
  // failed request says so under the curves (the rest still draws, without them)
  store.subscribe("events", (events, s) => {
    const failed = s.error("events");
    page.eventsError.hidden = !failed;
    page.eventsError.textContent = failed ? `Could not load the run's events (markers, evaluations): ${failed.message}` : "";
    if (!gate.ready) return;
    post.update(s.get("run"), s.get("alerts"), events, s.get("nonfinite"));
    curves.setMarkers(s.get("alerts"), events);
    scalars.setSources(s.get("run"), events);
  });
}

/** The throttled re-reads that keep the panels following a live run. */
function liveRefresh(store, page) {
  const { curves, scalars, heatmap } = page;
  return {
    run: throttle(async () => {
      const run = await store.loadRun();
      if (run.last_step !== null) stepSeen(store.runId, run.last_step);
    }, 1000),
    // every trace follows a live run: the curves and the picked scalars are re-read every few seconds
    curves: throttle(() => {
      curves.load().catch((err) => console.warn("curves", err));
      scalars.load().catch((err) => console.warn("scalars", err));
    }, 3000),
    // live steps redraw the heatmap every few seconds, fetching only the buckets after those it holds; a
    // big one (500 tensors x 1000 buckets takes the browser most of a second to draw) less often, so the
    // page stays responsive during a run
    heatmap: throttle(() => {
      heatmap.refresh().catch((err) => console.warn("heatmap", err));
    }, () => Math.max(3000, heatmap.data ? (heatmap.data.T * heatmap.data.C) / 60 : 0)),
    layers: throttle(page.loadLayers, 4000),
  };
}

/** The first loads: the heatmap and the curves at once (their first frames), then, once the run and both
 * plots are in, the panels' data in order. Returns the run; a run that cannot be read throws (after the
 * plots are stopped and `onAuth` dropped). */
async function firstLoad(store, page, timing, runRequest, onAuth) {
  const { heatmap, curves, alerts, scalars, recipe, config } = page;
  const heatLoad = heatmap.load().then(() => timing.loaded("heatmap"));
  const curvesLoad = curves.load().then(() => timing.loaded("curves"));
  // when the run itself cannot be read (e.g. 401) these fail too; that failure is reported once, below.
  // A failed load has no first frame: plotly.js is not held back for it.
  heatLoad.catch(() => timing.noFrame("heatmap"));
  curvesLoad.catch(() => timing.noFrame("curves"));
  let run;
  try {
    run = await runRequest;
  } catch (err) {
    auth.listeners.delete(onAuth);
    heatmap.close();
    curves.close();
    throw err;
  }
  // the panels' requests go out once the plots have their data: they would compete with those for the
  // server's time and delay the first full paint
  await Promise.all([heatLoad, curvesLoad]);
  // the heatmap's header carries the tensor list: the page needs no request of its own for it
  if (heatmap.data && !store.get("tensors")) store.set("tensors", heatmap.data.tensors);
  config.fill(run);
  await Promise.all([
    store.loadEvents().then(() => {
      scalars.setSources(store.get("run"), store.get("events"));
      return Promise.all([alerts.load(), scalars.load()]);
    }),
    page.loadLayers(),
    recipe.load(run),
  ]);
  return run;
}

/** Follow the run's event stream: live steps, alerts, incidents, replay requests, recipe commands, events
 * and the run's own changes, each into the store or the panel that holds it. */
function followRun(store, page, refresh) {
  const { curves, alerts, heatmap } = page;
  const runId = store.runId;
  let opens = 0;
  const pendingLoss = [];
  const flushLoss = throttle(() => {
    curves.appendLoss(pendingLoss.splice(0));
  }, 250);
  const handlers = {
    step(d) {
      page.header.liveStep(d);
      stepSeen(runId, d.step);
      if (d.loss !== null && d.loss !== undefined) pendingLoss.push({ step: d.step, loss: num(d.loss) });
      flushLoss();
      refresh.curves();
      refresh.heatmap();
      refresh.layers();
    },
    alert(a) {
      store.upsertAlert(a);
      refresh.layers();
      refresh.run();
    },
    incident(i) {
      store.upsertIncident(i);
      refresh.run();
    },
    replay_request(r) {
      alerts.replays.upsertRequest(r);
    },
    command(c) {
      store.upsertCommand(c);
      if (c.state === "applied") refresh.run();
    },
    event(e) {
      store.pushEvent(e);
      refresh.curves();
    },
    run(d) {
      store.setRun({ ...store.get("run"), ...(d.status ? { status: d.status } : {}), ...(d.name ? { name: d.name } : {}), ...(d.tags ? { tags: d.tags } : {}) });
      refresh.run(); // tags, scalar names
    },
  };
  const onopen = () => {
    refresh.run(); // steps stored between the first fetch and the connection
    store.loadEvents().then(refresh.curves); // and events (merged by id with what the stream brings)
    if (opens++) {
      // reconnected: catch up on what the stream missed meanwhile
      alerts.load();
      store.loadCommands();
      if (!heatmap.range) heatmap.load().catch((err) => console.warn("heatmap", err)); // all of it: steps may have come in any order
    }
  };
  return subscribe(`/runs/${runId}/stream`, handlers, { onopen });
}

export async function mountRun(container, { runId, incident = null, metric = null }) {
  // the page's shared state (run, tensors, events, alerts, commands); the panels render from it
  const store = new RunStore(runId);
  const runRequest = store.loadRun(); // in flight while the page is laid out
  const timing = new PaintTiming();
  const page = buildPanels(container, {}, store, { incident, metric, timing });
  const gate = { ready: false };
  wireStore(store, page, gate);
  const refresh = liveRefresh(store, page);
  const onAuth = () => {
    page.alerts.fill();
    page.recipe.fill();
    if (store.get("run")) page.config.fill(store.get("run"));
  };
  auth.listeners.add(onAuth);
  await firstLoad(store, page, timing, runRequest, onAuth);
  gate.ready = true;
  const stream = followRun(store, page, refresh);
  return {
    destroy() {
      stream.close();
      auth.listeners.delete(onAuth);
      const plots = [...container.querySelectorAll(".js-plotly-plot")];
      // purge (dropping plotly's resize listeners) only once no redraw is half way
      Promise.allSettled([page.heatmap.close(), page.curves.close(), page.scalars.close()]).then(() => plots.forEach((gd) => window.Plotly.purge(gd)));
    },
  };
}
