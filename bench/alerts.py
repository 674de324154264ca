"""Alert precision and recall on real trainings: healthy runs must stay quiet, every fault must raise the
right alert on the right tensor within a few steps, as one incident with exactly one webhook message.

Every scenario is a real training run through the real client (`fp8-train` subprocesses, `torchrun` with
two gloo ranks, or `fp8_trainer.Monitor` around a small model in this process) streaming into one real
`fp8-monitor serve` whose webhook points at a local receiver counting the posts. Healthy scenarios: delayed
and current scaling, gradient accumulation with and without ``step_boundary=False``, two ranks, an
MoE-style expert that skips steps, a frozen weight, activation checkpointing, the first 50 steps of
warm-up. Faults: a NaN in one layer's input, a weight scaled x1e4, learning-rate spikes x100 and x1000, a
slow activation drift that ends in saturation. The healthy `fp8-train` runs act on their incidents
(``--remediation act``): a healthy run must not get a remediation policy action either (counted from
``GET /runs/{id}/policy-actions``; measured ``--quick --only
delayed,current,grad-accum,checkpointing,warm-up-50,two-ranks``: 0 actions on 6 runs, 182 s).

    python bench/alerts.py            # 3 seeds, 120 steps of 16 x 64 tokens (30-35 min on 2 cores)
    python bench/alerts.py --quick    # 1 seed, 60 steps of 8 x 64 tokens (3-5 min)

Prints a table per scenario and the precision / recall summary; writes bench/results/alerts.json.
Counting, at the level a person sees: an *alarm* is an incident of severity warning or critical. A true
alarm is the first incident of a fault run that holds the expected alert (kind, tensor, onset within the
allowed steps); every other alarm is false (any in a healthy run, any before the fault, a second one for
the same fault). precision = true alarms / alarms; recall = faults found / faults. A fault's row is ok when
its run raised exactly one alarm, the true one, and exactly one webhook post; "root" says whether the
incident's root cause (its headline) is at the fault's step and on the fault's tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Cases, seeded_args, seeded_parser, write_json  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402  (the tests' `fp8-monitor serve` launcher)

API = "/api/v1"
ALARM = ("warning", "critical")
PUBLIC_URL = "https://fp8scope.example.org"


# ---- the webhook receiver -------------------------------------------------------------------------------
class Receiver(ThreadingHTTPServer):
    """A Slack stand-in on 127.0.0.1: keeps every JSON body posted to it."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.posts: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def texts(self) -> list[str]:
        with self.lock:
            return [p.get("text", "") for p in self.posts]


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.posts.append(body)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


# ---- scenarios ------------------------------------------------------------------------------------------
@dataclass
class Expect:
    """What a fault must raise: an alert of one of `kinds` (on `tensor`, unless None) whose onset lies in
    [`first`, `last`]."""

    kinds: tuple[str, ...]
    tensor: str | None
    first: int
    last: int


@dataclass
class Scenario:
    name: str
    group: str  # "healthy" or "fault"
    how: str  # the command line or loop, for the table
    run: Callable[[str, str], None]  # (run name, service URL) -> trains to the end
    expect: Expect | None = None
    results: list[dict[str, Any]] = field(default_factory=list)


def train_cmd(quick: bool) -> list[str]:
    batch = ["--batch-size", "8", "--seq-len", "64"] if quick else ["--batch-size", "16", "--seq-len", "64"]
    return ["--preset", "tiny", *batch, "--eval-interval", "0", "--no-progress", "--log-interval", "1000"]


def fp8_train(flags: list[str], quick: bool, ranks: int = 1) -> Callable[[str, str], None]:
    """A runner: `fp8-train` (under torchrun with gloo when ranks > 1) against the service."""

    def run(name: str, url: str) -> None:
        launcher = [sys.executable, "-m", "fp8_trainer.app.cli"]
        if ranks > 1:
            launcher = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(ranks),
                "-m",
                "fp8_trainer.app.cli",
            ]
        cmd = [*launcher, *train_cmd(quick), *flags, "--monitor-url", url, "--run-name", name]
        # one intra-op thread per process: on a small, shared machine more threads only spin
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with tempfile.TemporaryDirectory() as cwd:
            proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")

    return run


def monitor_loop(kind: str, steps: int, seed: int, **opts: Any) -> Callable[[str, str], None]:
    """A runner: a small FP8 MLP trained in this process with `fp8_trainer.Monitor` (see `train_small`)."""

    def run(name: str, url: str) -> None:
        train_small(kind, name, url, steps=steps, seed=seed, **opts)

    return run


def train_small(
    kind: str, name: str, url: str, *, steps: int, seed: int, drift_from: int | None = None
) -> None:
    """A classifier MLP (64 -> 256 -> 256 -> 16 classes, three FP8 Linears: fc1, fc2, fc3) learning a fixed
    random teacher's labels with cross-entropy (as a language model does: its logits' gradient is bounded),
    AdamW, delayed scaling with a 16-step history, reported with `fp8_trainer.Monitor`:

    - ``accum_te``: 4 micro-batches per optimizer step, each in its own ``fp8_autocast`` (Transformer
      Engine's loop: every micro-batch is an FP8 step; the client merges them per optimizer step);
    - ``moe``: fc2 is two experts; the second runs only every third step (a zero amax in between);
    - ``frozen``: fc2's weight does not train;
    - ``drift``: from step `drift_from` on, fc2's input is multiplied by ``exp(0.033 k^2)`` (k steps in):
      slow at first (3% in the first step), 2x per step ten steps in, when it saturates.
    """
    import torch
    from torch import nn

    from fp8_trainer import DelayedScaling, Monitor, convert_to_fp8, fp8_autocast

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(64, 256)
            self.fc2 = nn.Linear(256, 256)
            self.expert = nn.Linear(256, 256) if kind == "moe" else None
            self.fc3 = nn.Linear(256, 16)
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.gelu(self.fc1(x))  # (B, 256)
            if drift_from is not None and self.step >= drift_from:
                h = h * float(torch.exp(torch.tensor(0.033 * (self.step - drift_from) ** 2)))
            z = self.fc2(h)
            if self.expert is not None and self.step % 3 == 0:
                z = 0.5 * (z + self.expert(h))
            return self.fc3(torch.nn.functional.gelu(z))

    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16)).requires_grad_(False)
    recipe = DelayedScaling(amax_history_len=16)
    model = convert_to_fp8(Net(), recipe=recipe)
    if kind == "frozen":
        model.fc2.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + seed)
    micro = 4 if kind == "accum_te" else 1
    with Monitor(
        url, name, model, recipe, config={"bench": "alerts", "kind": kind}, flush_interval=0.2
    ) as mon:
        for step in range(1, steps + 1):
            model.step = step
            total = torch.zeros(())
            for _ in range(micro):
                x = torch.randn(64, 64, generator=gen)
                with fp8_autocast(fp8_recipe=recipe):  # step_boundary=True: each micro-batch closes a step
                    loss = torch.nn.functional.cross_entropy(model(x), teacher(x).argmax(-1)) / micro
                loss.backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step(step, loss=total, lr=1e-3)


def scenarios(quick: bool, seeds: list[int]) -> list[Scenario]:
    steps = 60 if quick else 120
    at = 40 if quick else 80  # where faults are injected: past the warm-up grace and the loss window
    out: list[Scenario] = []
    for seed in seeds:
        s = ["--seed", str(seed), "--steps", str(steps)]
        h = [*s, "--remediation", "act"]  # healthy runs act on their incidents: a policy must not act on them
        healthy = [
            ("delayed", "fp8-train (delayed, history 16)", fp8_train(h, quick)),
            ("current", "fp8-train --recipe current", fp8_train([*h, "--recipe", "current"], quick)),
            (
                "grad-accum",
                "fp8-train --grad-accum 4 (step_boundary=False)",
                fp8_train([*h, "--grad-accum", "4"], quick),
            ),
            (
                "grad-accum-te",
                "Monitor loop, 4 micro-batches each its own fp8_autocast step",
                monitor_loop("accum_te", steps, seed),
            ),
            ("two-ranks", "torchrun --nproc-per-node 2 (gloo) fp8-train", fp8_train(h, quick, ranks=2)),
            (
                "moe-skips",
                "Monitor loop, an expert that runs every third step",
                monitor_loop("moe", steps, seed),
            ),
            (
                "frozen-weight",
                "Monitor loop, one FP8 Linear's weight frozen",
                monitor_loop("frozen", steps, seed),
            ),
            (
                "checkpointing",
                "fp8-train --activation-checkpointing non-reentrant",
                fp8_train([*h, "--activation-checkpointing", "non-reentrant"], quick),
            ),
            (
                "warm-up-50",
                "fp8-train --steps 50 --warmup-steps 50",
                fp8_train(["--seed", str(seed), "--steps", "50", "--warmup-steps", "50", *h[4:]], quick),
            ),
        ]
        for name, how, run in healthy:
            out.append(Scenario(f"{name}/s{seed}", "healthy", how, run))
        faults = [
            (
                "nan",
                f"fp8-train --inject nan:blocks.1.mlp.fc@{at}",
                fp8_train([*s, "--inject", f"nan:blocks.1.mlp.fc@{at}"], quick),
                Expect(("nonfinite",), "blocks.1.mlp.fc.input", at, at),
            ),
            (
                "weight-x1e4",
                f"fp8-train --inject overflow:blocks.2.attn.proj@{at}",
                fp8_train([*s, "--inject", f"overflow:blocks.2.attn.proj@{at}"], quick),
                Expect(("overflow_burst",), "blocks.2.attn.proj.weight", at, at),
            ),
            # lr x F in optimizer step `at`: the loss of step at+1 is the first computed with the new weights
            (
                "lr-x100",
                f"fp8-train --inject lr-spike@{at}x100",
                fp8_train([*s, "--inject", f"lr-spike@{at}x100"], quick),
                Expect(("loss_spike",), None, at + 1, at + 3),
            ),
            (
                "lr-x1000",
                f"fp8-train --inject lr-spike@{at}x1000",
                fp8_train([*s, "--inject", f"lr-spike@{at}x1000"], quick),
                Expect(("loss_spike",), None, at + 1, at + 3),
            ),
            (
                "drift",
                f"Monitor loop, fc2's input x exp(0.033 (step - {at})^2) from step {at}",
                monitor_loop("drift", at + 14, seed, drift_from=at),
                Expect(("amax_divergence", "overflow_burst"), "fc2.input", at, at + 12),
            ),
        ]
        for name, how, run, expect in faults:
            out.append(Scenario(f"{name}/s{seed}", "fault", how, run, expect))
    return out


# ---- evaluation -----------------------------------------------------------------------------------------
def get(client: httpx.Client, path: str, **params: Any) -> Any:
    r = client.get(f"{API}{path}", params=params)
    r.raise_for_status()
    return r.json()


def evaluate(
    sc: Scenario, run: dict, alerts: list[dict], incidents: list[dict], posts: int, actions: int = 0
) -> dict[str, Any]:
    """One run's verdict (see the module docstring for what counts as true and false); ``actions``: the
    run's remediation policy actions (a healthy run must have none)."""
    alarms = sorted((i for i in incidents if i["severity"] in ALARM), key=lambda i: i["id"])
    loud = [a for a in alerts if a["severity"] in ALARM]
    row: dict[str, Any] = {
        "scenario": sc.name,
        "group": sc.group,
        "how": sc.how,
        "run_id": run["id"],
        "steps": run["steps_stored"],
        "alarms": len(alarms),
        "alerts": len(loud),
        "alerts_all": len(alerts),
        "webhook_posts": posts,
        "incidents": [
            {k: i[k] for k in ("id", "severity", "title", "first_step", "last_step", "alert_count", "url")}
            for i in alarms
        ],
    }
    row["policy_actions"] = actions
    if sc.group == "healthy":
        ok = not alarms and not loud and posts == 0 and actions == 0
        row.update(true_alarms=0, false_alarms=len(alarms), ok=ok)
        return row
    e = sc.expect
    match = [
        (i, a)
        for i in alarms
        for a in i["alerts"]
        if a["kind"] in e.kinds
        and (e.tensor is None or a["tensor_name"] == e.tensor)
        and e.first <= a["onset_step"] <= e.last
    ]
    found = match[0] if match else None
    true = 1 if found and found[0]["id"] == alarms[0]["id"] else 0  # the fault's incident is the first one
    root = alarms[0]["root"] if alarms else None
    row.update(
        expected=f"{'|'.join(e.kinds)} on {e.tensor or 'the loss'} at {e.first}"
        + (f"-{e.last}" if e.last != e.first else ""),
        found=(
            f"{found[1]['kind']} on {found[1]['tensor_name'] or 'the loss'} at {found[1]['onset_step']}"
            if found
            else None
        ),
        delay=found[1]["onset_step"] - e.first if found else None,
        root=f"{root['kind']} on {root['tensor_name'] or 'the loss'} at {root['onset_step']}"
        if root
        else None,
        # the incident's headline: at the fault's step, on the fault's tensor when it has one; an lr spike has
        # none, and its first effect in forward-then-backward order (a weight that saturates in the forward
        # pass after the step, or else the loss) is what the root-cause rule names
        root_ok=bool(
            root
            and e.first <= root["onset_step"] <= e.last
            and (e.tensor is None or root["tensor_name"] == e.tensor)
        ),
        true_alarms=true,
        false_alarms=len(alarms) - true,
    )
    row["ok"] = bool(true and len(alarms) == 1 and posts == 1)
    return row


def run_all(quick: bool, seeds: list[int], names: list[str]) -> dict[str, Any]:
    receiver = Receiver()
    work = Path(tempfile.mkdtemp(prefix="fp8scope-bench-alerts-"))
    env = {"FP8SCOPE_WEBHOOK_SETTLE_SECONDS": "1", "FP8SCOPE_WEBHOOK_MIN_INTERVAL_SECONDS": "60"}
    server = ServerProcess(
        f"sqlite:///{work / 'alerts.db'}",
        "--webhook-url",
        receiver.url,
        "--public-url",
        PUBLIC_URL,
        log_path=work / "server.log",
        env=env,
    ).start()
    todo = [sc for sc in scenarios(quick, seeds) if sc.name.split("/")[0] in names]
    names: dict[str, Scenario] = {}
    started = time.monotonic()
    try:
        for k, sc in enumerate(todo):
            name = f"bench-{sc.name.replace('/', '-')}"
            names[name] = sc
            t0 = time.monotonic()
            sc.run(name, server.url)
            print(f"[{k + 1}/{len(todo)}] {sc.name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            runs = {r["name"]: r for r in get(client, "/runs", limit=1000)}
            data = {}
            for name in names:
                run = runs[name]
                data[name] = (
                    run,
                    get(client, f"/runs/{run['id']}/alerts", limit=5000),
                    get(client, f"/runs/{run['id']}/incidents", limit=1000),
                    len(get(client, f"/runs/{run['id']}/policy-actions")),
                )
            notified = sum(1 for _, _, incs, _ in data.values() for i in incs if i["notified_at"])
            # each notified incident's message is due a second after it opened (rate limit: 60 s per run)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(receiver.texts()) < min(notified, len(data)):
                time.sleep(0.2)
    finally:
        server.stop()  # a clean stop delivers messages still held by the per-run rate limit
    texts = receiver.texts()
    rows = []
    for name, (run, alerts, incidents, actions) in data.items():
        posts = sum(1 for t in texts if f" in run {name}" in t or f"incidents in run {name}:" in t)
        row = evaluate(names[name], run, alerts, incidents, posts, actions)
        names[name].results.append(row)
        rows.append(row)
    return {
        "rows": rows,
        "seconds": time.monotonic() - started,
        "webhook_posts": len(texts),
        "server_log_tail": server.log_text()[-2000:],
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    healthy = [r for r in rows if r["group"] == "healthy"]
    faults = [r for r in rows if r["group"] == "fault"]
    true = sum(r["true_alarms"] for r in rows)
    false = sum(r["false_alarms"] for r in rows)
    found = sum(1 for r in faults if r["true_alarms"])
    incidents = sum(r["alarms"] for r in faults)
    posts = sum(r["webhook_posts"] for r in faults)
    return {
        "healthy_runs": len(healthy),
        "healthy_runs_with_alarms": sum(
            1 for r in healthy if r["false_alarms"] or r["alerts"] or r["webhook_posts"]
        ),
        "healthy_policy_actions": sum(r["policy_actions"] for r in healthy),
        "false_alarms": false,
        "faults": len(faults),
        "faults_found": found,
        "roots_right": sum(1 for r in faults if r.get("root_ok")),
        "precision": true / (true + false) if true + false else 1.0,
        "recall": found / len(faults) if faults else 1.0,
        "incidents_per_fault": incidents / len(faults) if faults else 0.0,
        "webhook_posts_per_incident": posts / incidents if incidents else 0.0,
        "all_ok": all(r["ok"] for r in rows),
    }


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    cols = f"{'scenario':18s} {'group':7s} {'alarms':>6s} {'alerts':>6s} {'posts':>5s}  "
    head = cols + f"{'found (kind on tensor at onset step)':46s} {'delay':>5s} {'root':>4s}  ok   headline"
    print(head)
    print("-" * len(head))
    for r in rows:
        found = r.get("found") or ("-" if r["group"] == "healthy" else "MISSED " + r.get("expected", ""))
        delay = "" if r.get("delay") is None else str(r["delay"])
        root = "" if r["group"] == "healthy" else ("ok" if r.get("root_ok") else "no")
        counts = f"{r['alarms']:6d} {r['alerts']:6d} {r['webhook_posts']:5d}"
        verdict = "ok" if r["ok"] else "FAIL"
        print(
            f"{r['scenario']:18s} {r['group']:7s} {counts}  {found[:46]:46s} {delay:>5s} {root:>4s}  "
            f"{verdict:4s} {r['incidents'][0]['title'] if r['incidents'] else ''}"
        )
    s = summary
    print()
    print(
        f"healthy runs: {s['healthy_runs']}, with a warning/critical alarm: {s['healthy_runs_with_alarms']}"
    )
    print(f"policy actions on the healthy runs (fp8-train --remediation act): {s['healthy_policy_actions']}")
    print(f"faults: {s['faults']}, found: {s['faults_found']}, root cause named right: {s['roots_right']}")
    print(
        f"precision {s['precision']:.3f}  recall {s['recall']:.3f}  "
        f"incidents per fault {s['incidents_per_fault']:.2f}  "
        f"webhook posts per incident {s['webhook_posts_per_incident']:.2f}"
    )


def main() -> None:
    cases = Cases("scenario", tuple(dict.fromkeys(sc.name.split("/")[0] for sc in scenarios(False, [0]))))
    p = seeded_parser(__doc__, "alerts.json", ("--quick", "one seed, shorter runs, smaller batches"), cases)
    args, seeds, names = seeded_args(p, cases)
    result = run_all(args.small, seeds, names)
    summary = summarise(result["rows"])
    print_table(result["rows"], summary)
    out = {"quick": args.small, "seeds": len(seeds), "summary": summary, **result}
    write_json(args.out, out)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
