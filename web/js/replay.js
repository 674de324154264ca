// The replay of an incident, on its entry in the incidents panel: the verdict first (fp8-caused, not-fp8,
// not-reproducible, with the reason), then the culprit tensors with their evidence (the failing step's loss
// with each returned to high precision, against the loss in FP8 and in high precision; its layer's output
// SQNR against high precision in the FP8 replay), then the bundle replayed. Without a replay: "No replay
// yet", the bundles the job wrote for the incident, a Replay button that asks a replay worker to replay
// the newest (POST /incidents/{id}/replay-requests; the worker is `fp8-monitor replay-worker`, on a machine
// that sees the bundles) with the request's state, and the command that replays one by hand.
//
// The incident (GET /incidents, or its live event) carries `replay_verdict` and `bundles`; the report
// itself is read once per incident and verdict (GET /incidents/{id}/replay) and kept here, with what the
// run's remediation policy made of it (GET /policy-actions?incident_id=): the change it queued and how its
// check went, or the change it proposes with an Apply button (POST /policy-actions/{id}/apply).

import { api, auth } from "./api.js";
import { badge, el, fmt } from "./dom.js";

const VERDICT = {
  "fp8-caused": ["FP8-caused", "bad", "the fault comes back in FP8 and is gone in high precision"],
  "not-fp8": ["not FP8", "ok", "the fault comes back in high precision too"],
  "not-reproducible": ["not reproducible", "warn", "the replay did not bring the fault back"],
};
const ROLES = ["input", "weight", "grad_output"];

/** The layer a culprit names: "blocks.3.mlp.fc2.input" and "blocks.3.mlp.fc2" both name blocks.3.mlp.fc2. */
export function culpritLayer(culprit) {
  const first = culprit.split("+")[0];
  const dot = first.lastIndexOf(".");
  return dot > 0 && ROLES.includes(first.slice(dot + 1)) ? first.slice(0, dot) : first;
}

/** The configuration that shows a culprit's evidence: the one that returned exactly it to high precision
 * ("cast L.input", "casts L.a+b", "layer L"), else the smallest fault-free one that returned it. */
export function culpritConfig(report, culprit) {
  const want = culprit.split("+").sort().join(",");
  const configs = report.configs || [];
  const exact = configs.find((c) => [...(c.high_precision || [])].sort().join(",") === want);
  if (exact) return exact;
  const holding = configs.filter((c) => !c.fault && (c.high_precision || []).includes(culprit));
  return holding.sort((a, b) => a.high_precision.length - b.high_precision.length)[0] || null;
}

export class ReplayViews {
  /** @param onLoad called after a report arrives (the panel draws again) */
  constructor(runId, onLoad) {
    this.runId = runId;
    this.onLoad = onLoad;
    this.reports = new Map(); // "<incident id>:<verdict>" -> report | Error | "loading"
    this.actions = new Map(); // "<incident id>:<verdict>" -> the policy's actions on the incident
    this.requests = null; // incident id -> its newest replay request (GET /replay-requests, once; then live)
  }

  /** The run's replay requests, read once (the live stream's `replay_request` events keep them). */
  async loadRequests() {
    this.requests = new Map();
    try {
      for (const r of await api(`/runs/${this.runId}/replay-requests`)) this.requests.set(r.incident_id, r);
    } catch (err) {
      this.requestsError = err;
    }
    this.onLoad();
  }

  /** A request as the live stream sends it. */
  upsertRequest(r) {
    if (this.requests === null) this.requests = new Map();
    this.requests.set(r.incident_id, r);
    this.onLoad();
  }

  async requestReplay(i) {
    try {
      this.upsertRequest(await api(`/runs/${this.runId}/incidents/${i.id}/replay-requests`, { method: "POST", body: {} }));
    } catch (err) {
      this.upsertRequest({ incident_id: i.id, state: "error", detail: `Could not ask for a replay: ${err.message}` });
    }
  }

  /** The Replay button and the state of the incident's newest request. */
  requestLine(i) {
    if (this.requests === null) {
      this.loadRequests();
      this.requests = new Map();
    }
    const r = this.requests.get(i.id);
    const STATE = {
      pending: "replay requested: waiting for a replay worker (fp8-monitor replay-worker)",
      running: `replaying on ${r && r.claimed_by ? `the worker of ${r.claimed_by}` : "a worker"}…`,
      done: "replayed: the report is on its way",
      failed: `the replay failed: ${r && r.detail ? r.detail : "no reason given"}`,
      error: r && r.detail,
    };
    const open = r && (r.state === "pending" || r.state === "running");
    const denied = auth.readOnlyReason && auth.readOnlyReason();
    const button = el("button", {
      class: "replay-request", type: "button", disabled: open || Boolean(denied), title: denied || "",
      onclick: () => this.requestReplay(i),
    }, r && !open ? "Replay again" : "Replay");
    return el("div", { class: "replay-request-line", dataset: { state: r ? r.state : "none" } }, button,
      r ? el("span", { class: `replay-request-state${r.state === "failed" || r.state === "error" ? " error" : " muted"}` }, ` ${STATE[r.state] || r.state}`) : null);
  }

  /** The replay block of incident `i` (as GET /incidents gives it). */
  view(i) {
    const bundles = i.bundles || [];
    if (!i.replay_verdict) {
      const hint = bundles.length
        ? `fp8-train replay ${bundles[bundles.length - 1]} --monitor-url <this service> --run-id ${this.runId} --incident ${i.id}`
        : null;
      return el("div", { class: "incident-replay none", dataset: { verdict: "none" } },
        el("span", { class: "muted replay-none" }, "No replay yet."),
        this.bundleLine(bundles),
        bundles.length ? this.requestLine(i) : null,
        hint ? el("div", { class: "muted replay-hint" }, "or by hand: ", el("code", {}, hint)) : null);
    }
    const [label, kind, meaning] = VERDICT[i.replay_verdict] || [i.replay_verdict, "", ""];
    const key = `${i.id}:${i.replay_verdict}`;
    const report = this.reports.get(key);
    if (report === undefined) this.load(i.id, key);
    const head = el("div", { class: "replay-head" }, el("b", {}, "Replay: "),
      el("span", { class: "replay-verdict", title: meaning }, badge(label, kind)),
      report && report.reason ? el("span", { class: "replay-reason" }, ` ${report.reason}`) : null);
    let body = null;
    if (report instanceof Error) body = el("div", { class: "error" }, `Could not load the replay: ${report.message}`);
    else if (report && report !== "loading") body = this.evidence(report);
    const replayed = report && report.bundle ? [report.bundle] : bundles;
    return el("div", { class: "incident-replay", dataset: { verdict: i.replay_verdict } }, head, body,
      this.policyLines(key), this.bundleLine(replayed));
  }

  async load(id, key) {
    this.reports.set(key, "loading");
    try {
      const [report, actions] = await Promise.all([
        api(`/runs/${this.runId}/incidents/${id}/replay`),
        api(`/runs/${this.runId}/policy-actions?incident_id=${id}`),
      ]);
      this.reports.set(key, report);
      this.actions.set(key, actions);
    } catch (err) {
      this.reports.set(key, err);
    }
    this.onLoad();
  }

  /** The remediation policy's actions on the incident: the change, why, and its state; Apply on a proposal. */
  policyLines(key) {
    const actions = this.actions.get(key) || [];
    if (!actions.length) return null;
    const STATE = {
      proposed: "proposed: apply it to queue the command", queued: "queued", kept: "kept: the loss did not get worse",
      rolled_back: "rolled back: the loss got worse", capped: "not queued: the run's actions-per-hour cap",
      ended: "not queued: the run ended",
    };
    return el("ul", { class: "policy-actions" }, actions.map((a) => {
      const change = Object.entries(a.changes).map(([k, v]) => `${k} → ${v}`).join(", ");
      const check = a.loss_before != null && a.loss_after != null
        ? ` (mean loss ${fmt(a.loss_before)} before, ${fmt(a.loss_after)} after)` : "";
      const apply = a.state === "proposed"
        ? el("button", { class: "policy-apply", type: "button", onclick: () => this.apply(key, a) }, "Apply")
        : null;
      return el("li", { class: "policy-action", dataset: { state: a.state, rule: a.rule } },
        el("b", {}, "Policy: "), el("code", {}, a.target), ` ${change} · `,
        el("span", { class: "policy-state" }, STATE[a.state] || a.state), check, " ",
        el("span", { class: "muted policy-reason" }, a.reason), " ", apply,
        a.error ? el("span", { class: "error" }, ` ${a.error}`) : null);
    }));
  }

  async apply(key, action) {
    try {
      const done = await api(`/runs/${this.runId}/policy-actions/${action.id}/apply`, { method: "POST" });
      this.actions.set(key, (this.actions.get(key) || []).map((a) => (a.id === done.id ? done : a)));
    } catch (err) {
      const failed = { ...action, error: `Could not apply: ${err.message}` };
      this.actions.set(key, (this.actions.get(key) || []).map((a) => (a.id === action.id ? failed : a)));
    }
    this.onLoad();
  }

  bundleLine(bundles) {
    if (!bundles.length) return null;
    return el("div", { class: "replay-bundle muted" }, bundles.length === 1 ? "bundle: " : "bundles: ",
      bundles.map((b, k) => [k ? ", " : "", el("code", {}, b)]));
  }

  /** The culprits, each with the loss it leaves and its layer's SQNR; FP8's and high precision's losses. */
  evidence(report) {
    const configs = report.configs || [];
    const fp8 = configs.find((c) => c.name === "fp8");
    const hp = configs.find((c) => c.name === "high-precision");
    const losses = el("div", { class: "replay-losses muted" },
      `step ${report.step ?? "?"} loss: ${fmt(fp8 ? fp8.loss : null)} in FP8, ${fmt(hp ? hp.loss : null)} in high precision`,
      report.bitwise === true ? " · the FP8 replay matched the run's loss bit for bit" : "");
    const culprits = report.culprits || [];
    if (!culprits.length) return el("div", {}, losses);
    const rows = culprits.map((c, k) => {
      const config = culpritConfig(report, c);
      const layer = culpritLayer(c);
      const sqnr = fp8 && fp8.sqnr_db ? fp8.sqnr_db[layer] : undefined;
      return el("tr", { class: `replay-culprit${k === 0 ? " first" : ""}` },
        el("td", { class: "name" }, c),
        el("td", {}, config ? fmt(config.loss) : "–"),
        el("td", {}, sqnr === undefined ? "–" : `${fmt(sqnr, 3)} dB`));
    });
    return el("div", {}, losses,
      el("table", { class: "replay-culprits" },
        el("thead", {}, el("tr", {}, el("th", {}, "culprit (most likely first)"), el("th", {}, "loss with it in high precision"), el("th", {}, "layer output SQNR in FP8"))),
        el("tbody", {}, rows)));
  }
}
