"""The closed remediation loop: do the policies bring an FP8-caused fault run back to its high-precision twin?

Goal: with policies on, >= 80% of FP8-caused fault runs end within 2% of their twin's final loss (and how
many without policies); 0 actions on healthy runs; every action audited (its command on ``/commands``) and
rolled back when it does not help.

Each run is a real ``fp8-train`` (tiny preset on the CPU, the counting corpus, batch 4 x 32,
``--capture-every 3``: bench/replay_verdicts.py's settings, but a learning rate that decays, ``SCHEDULE``)
reporting to one real ``fp8-monitor serve``, the fault on ``blocks.3.mlp.fc2`` at step 40 of 400. Per seed
and fault:

- ``act``: ``--remediation act``. Nobody runs ``fp8-train replay``: the job pauses at its incident, replays
  the bundle in a child process it waits for (``fp8_trainer/app/auto_replay.py``), the report lands on the
  incident, the service's policy queues its command, the job runs the failing step again under it
  (``fp8_trainer/app/retry.py``), and the service checks it 20 steps later;
- ``off``: the same run without remediation;
- ``twin``: the same run (the same ``--inject``, seed and batches) in float32 (``--recipe fp32``), where every
  one of these faults is undone up to rounding (docs/replay.md; a bf16 twin would keep ``lowprec``'s fault:
  the undo's own bf16 rounding, amplified 2**20 times, is as large as FP8's).

And per seed a healthy run (no fault) with ``--remediation act``: the policy must not act on it; its gap to
the seed's twin is the floor (what FP8 itself gives).

The final loss is the mean training loss of the last ``LAST`` (50) steps, as the service stored it; the gap
is (run - twin) / twin, within 2% when its magnitude is at most 0.02. The ``clean`` column: the gap to the
same seed's healthy FP8 run instead. The actions are read from ``GET /runs/{id}/policy-actions``; an action
is audited when its command (and its rollback's) is on ``GET /runs/{id}/commands`` with the policy as
author, and consistent when it was rolled back exactly when the mean loss of the 20 steps after its applied
step, recomputed here from the stored losses, is more than 2% (the policy's ``worse_by``) above that of the
20 steps before it.

    python bench/remediation.py            # 3 seeds x saturate, jump, lowprec, gradspike (+ 3 healthy)
    python bench/remediation.py --smoke    # 1 seed, lowprec with policies and its twin, 100 steps
    python bench/remediation.py --only saturate,lowprec --seeds 1

Writes bench/results/remediation.json.

Measured (3 seeds, 1327 s on 2 cores shared with a test run; the table in docs/replay.md):

    saturate  within 2% of the twin: with policies 3/3, without 3/3
    jump      within 2% of the twin: with policies 3/3, without 3/3
    lowprec   within 2% of the twin: with policies 3/3, without 0/3
    gradspike within 2% of the twin: with policies 3/3, without 3/3
    goal: with policies >= 80% of FP8-caused fault runs within 2% of the twin: 12/12 = 100% (met); without
    policies 9/12
    floor: healthy FP8 runs against their float32 twin: seed 0 +0.44%, seed 1 +0.46%, seed 2 +0.06%
    goal: 0 actions on healthy runs: 0 on 3 runs (met)
    goal: every action audited ...: audited 12/12, rolled back exactly when worse 12/12 (states {'kept': 12})

Every action at step 40, the failing step run again under it. Gaps with policies +0.00% to +0.45%; lowprec
without them +46% to +75%.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Cases, seeded_args, seeded_parser, write_json  # noqa: E402
from bench.replay_verdicts import LAYER, TRAIN, counting_corpus  # noqa: E402  (the same runs' settings)
from fp8_trainer.monitor.read import Reader  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402  (the tests' `fp8-monitor serve` launcher)

API = "/api/v1"
STEP = 40  # the fault's step: the spike rule scores from 20 losses on
STEPS = 400  # long enough after it for the replay (8-9 s alone, 170 steps; more when the cores are busy)
SMOKE_STEPS = 100  # --smoke: the action lands at step 40 (the job waits for it) and is checked at 60
LAST = 50  # the final loss: the mean of the last LAST steps
WITHIN = 0.02
CHECK = 20  # the policy's check_steps (its default)
GOAL_WITHIN = 0.80
FAULTS = {
    "saturate": f"saturate:{LAYER}@{STEP}",
    "jump": f"jump:{LAYER}@{STEP}",
    "lowprec": f"lowprec:{LAYER}@{STEP}",
    "gradspike": f"gradspike:{LAYER}@{STEP}",  # a statistics fault: no loss moved
}
CASES = Cases(
    "fault", tuple(FAULTS), default=("saturate", "jump", "lowprec", "gradspike"), small=("lowprec",)
)
#: over replay_verdicts' settings: a learning rate that decays (cosine from 5e-4 to 5e-5 over the run), so
#: that a run and its twin end where the training converged, not at a point of a constant-rate wander. Its
#: floor, a healthy FP8 run against its float32 twin: +0.06% to +0.46% for seeds 0-2 (the mean of the last
#: 50 losses), where the constant 1e-3 left them -1.9% to +6.6% apart (seed 1's own step-33 spike, in
#: float32 too, sends the two runs on different ways): the 2% goal is measured above that noise.
SCHEDULE = ["--lr-schedule", "cosine", "--lr", "5e-4"]


def train(name: str, flags: list[str], url: str, work: Path) -> tuple[float, str]:
    """One ``fp8-train`` run named ``name`` in its own directory; (seconds, its output)."""
    cwd = work / name
    cwd.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "fp8_trainer.app.cli", *TRAIN, *SCHEDULE, *flags]
    cmd += ["--monitor-url", url, "--run-name", name]
    t0 = time.monotonic()
    log = cwd / "train.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1800)
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-2000:]}")
    return time.monotonic() - t0, text


def run_row(
    kind: str, seed: int, mode: str, steps: int, url: str, corpus: Path, work: Path
) -> dict[str, Any]:
    """``mode``: "act", "off", "twin" (float32), or "healthy" (no fault, act)."""
    name = f"rem-{kind}-{mode}-s{seed}"
    flags = ["--steps", str(steps), "--seed", str(seed), "--data", str(corpus)]
    if kind != "healthy":
        flags += ["--inject", FAULTS[kind]]
    if mode in ("act", "healthy"):
        flags += ["--remediation", "act"]
    if mode == "twin":
        flags += ["--recipe", "fp32"]
    seconds, out = train(name, flags, url, work)
    with httpx.Client(base_url=url + API, timeout=30) as client:
        (run,) = [r for r in client.get("/runs", params={"limit": 1000}).json() if r["name"] == name]
        rid = run["id"]
        actions = client.get(f"/runs/{rid}/policy-actions").json()
        commands = {c["id"]: c for c in client.get(f"/runs/{rid}/commands").json()}
    with Reader(url) as reader:
        loss_steps, losses = reader.series(rid, "loss")
    series = dict(zip(loss_steps.tolist(), losses.tolist(), strict=True))
    bundles = sorted(p.name for p in (work / name / "incidents" / name).glob("incident-step*.pt"))
    replays = [ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("fp8-train: auto replay of")]
    return {
        "kind": kind,
        "seed": seed,
        "mode": mode,
        "run_id": rid,
        "steps": len(losses),
        "final": float(losses[-LAST:].mean()),
        "bundles": bundles,
        "replays": replays,
        "actions": [_action(a, commands, series) for a in actions],
        "seconds": seconds,
    }


def _mean(series: dict[int, float], lo: int, hi: int) -> float | None:
    """The mean loss of steps lo..hi (inclusive) as stored, None when any is missing."""
    got = [series[step] for step in range(lo, hi + 1) if step in series]
    return sum(got) / len(got) if got and len(got) == hi - lo + 1 else None


def _action(
    a: dict[str, Any], commands: dict[int, dict[str, Any]], series: dict[int, float]
) -> dict[str, Any]:
    """One policy action with its audit: its command (and rollback) on /commands, authored by the policy,
    and whether it was rolled back exactly when the loss after it, recomputed here from the stored losses
    (``CHECK`` steps after the applied step against ``CHECK`` before it), was more than 2% worse."""
    cmd = commands.get(a["command_id"]) if a["command_id"] is not None else None
    audited = cmd is not None and cmd["created_by"] == f"policy:{a['rule']}"
    rollback = commands.get(a["rollback_id"]) if a["rollback_id"] is not None else None
    if a["state"] == "rolled_back":
        audited = audited and rollback is not None and rollback["created_by"] == "policy:rollback"
    s = cmd["applied_step"] if cmd else None
    before = _mean(series, s - CHECK, s - 1) if s else None
    after = _mean(series, s + 1, s + CHECK) if s else None
    worse = before is not None and after is not None and after > before * (1 + WITHIN)
    checked = a["state"] in ("kept", "rolled_back") and after is not None
    return {
        "rule": a["rule"],
        "target": a["target"],
        "changes": a["changes"],
        "state": a["state"],
        "applied_step": cmd["applied_step"] if cmd else None,
        "rollback_step": rollback["applied_step"] if rollback else None,
        "loss_before": before,
        "loss_after": after,
        "service_before_after": [a.get("loss_before"), a.get("loss_after")],
        "audited": audited,
        "consistent": (not checked) or (worse == (a["state"] == "rolled_back")),
    }


def judge(rows: list[dict[str, Any]]) -> None:
    """Each fault run against its twin: ``gap`` and ``within``."""
    twins = {(r["kind"], r["seed"]): r["final"] for r in rows if r["mode"] == "twin"}
    clean = {r["seed"]: r["final"] for r in rows if r["mode"] == "healthy"}  # the same seed in FP8, no fault
    for r in rows:
        if r["seed"] in clean and r["mode"] != "twin":
            r["gap_clean"] = (r["final"] - clean[r["seed"]]) / clean[r["seed"]]
        twin = twins.get((r["kind"], r["seed"]))
        if r["mode"] == "healthy":  # the floor: FP8 itself against float32 (every twin undoes its fault)
            twin = next((v for (_, seed), v in twins.items() if seed == r["seed"]), None)
            if twin is not None:
                r["twin"], r["gap"] = twin, (r["final"] - twin) / twin
        elif r["mode"] in ("act", "off") and twin is not None:
            r["twin"] = twin
            r["gap"] = (r["final"] - twin) / twin
            r["within"] = abs(r["gap"]) <= WITHIN


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    act = [r for r in rows if r["mode"] == "act"]
    off = [r for r in rows if r["mode"] == "off"]
    healthy = [r for r in rows if r["mode"] == "healthy"]
    actions = [a for r in act + healthy for a in r["actions"]]
    per_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in act):
        per_kind[kind] = {
            "act_within": sum(r["within"] for r in act if r["kind"] == kind),
            "off_within": sum(r["within"] for r in off if r["kind"] == kind),
            "runs": sum(1 for r in act if r["kind"] == kind),
        }
    return {
        "per_kind": per_kind,
        "act_runs": len(act),
        "act_within": sum(r["within"] for r in act),
        "off_runs": len(off),
        "off_within": sum(r["within"] for r in off),
        "healthy_runs": len(healthy),
        "healthy_actions": sum(len(r["actions"]) for r in healthy),
        "actions": len(actions),
        "audited": sum(a["audited"] for a in actions),
        "consistent": sum(a["consistent"] for a in actions),
        "states": {
            s: sum(a["state"] == s for a in actions) for s in dict.fromkeys(a["state"] for a in actions)
        },
    }


def _actions_text(r: dict[str, Any]) -> str:
    if not r["actions"]:
        return "-"
    return "; ".join(
        f"{a['rule']} @{a['applied_step']} {a['state']}"
        + (f" @{a['rollback_step']}" if a["rollback_step"] else "")
        + ("" if a["audited"] else " UNAUDITED")
        for a in r["actions"]
    )


def print_table(rows: list[dict[str, Any]], s: dict[str, Any]) -> None:
    head = f"{'fault':9s} {'seed':>4s} {'mode':7s} {'final':>7s} {'twin':>7s} {'gap':>7s} {'2%':3s}"
    head += f" {'clean':>7s} {'s':>4s}  actions"
    print(head)
    print("-" * len(head))
    for r in rows:
        twin = f"{r['twin']:7.4f}" if "twin" in r else f"{'':7s}"
        gap = f"{r['gap']:+7.2%}" if "gap" in r else f"{'':7s}"
        within = ("yes" if r["within"] else "no") if "within" in r else ""
        clean = f"{r['gap_clean']:+7.2%}" if "gap_clean" in r else f"{'':7s}"
        print(
            f"{r['kind']:9s} {r['seed']:4d} {r['mode']:7s} {r['final']:7.4f} {twin} {gap} {within:3s} "
            f"{clean} {r['seconds']:4.0f}  {_actions_text(r)}"
        )
    print()
    for kind, k in s["per_kind"].items():
        print(
            f"{kind:9s} within 2% of the twin: with policies {k['act_within']}/{k['runs']}, "
            f"without {k['off_within']}/{k['runs']}"
        )
    share = s["act_within"] / s["act_runs"] if s["act_runs"] else 0.0
    print(
        f"goal: with policies >= 80% of FP8-caused fault runs within 2% of the twin: {s['act_within']}/"
        f"{s['act_runs']} = {share:.0%} ({'met' if share >= GOAL_WITHIN else 'NOT met'}); without policies "
        f"{s['off_within']}/{s['off_runs']}"
    )
    floor = [f"seed {r['seed']} {r['gap']:+.2%}" for r in rows if r["mode"] == "healthy" and "gap" in r]
    if floor:
        print(f"floor: healthy FP8 runs against their float32 twin: {', '.join(floor)}")
    if s["healthy_runs"]:
        print(
            f"goal: 0 actions on healthy runs: {s['healthy_actions']} on {s['healthy_runs']} runs "
            f"({'met' if s['healthy_actions'] == 0 else 'NOT met'})"
        )
    print(
        f"goal: every action audited and rolled back when it does not help: audited {s['audited']}/"
        f"{s['actions']}, rolled back exactly when worse {s['consistent']}/{s['actions']} "
        f"(states {s['states']})"
    )


def main() -> None:
    p = seeded_parser(__doc__, "remediation.json", ("--smoke", "one seed, lowprec (act and twin)"), CASES)
    p.add_argument(
        "--steps", type=int, default=None, help=f"steps per run (default {STEPS}; --smoke {SMOKE_STEPS})"
    )
    args, seeds, kinds = seeded_args(p, CASES)
    steps = args.steps or (SMOKE_STEPS if args.small else STEPS)
    work = Path(tempfile.mkdtemp(prefix="fp8scope-bench-remediation-"))
    corpus = counting_corpus(work / "count.txt")
    modes = ("act", "twin") if args.small else ("act", "off", "twin")
    plan = [(k, seed, mode) for seed in seeds for k in kinds for mode in modes]
    plan += [] if args.small else [("healthy", seed, "healthy") for seed in seeds]
    started = time.monotonic()
    server = ServerProcess(f"sqlite:///{work / 'remediation.db'}", log_path=work / "server.log").start()
    rows = []
    try:
        for kind, seed, mode in plan:
            rows.append(run_row(kind, seed, mode, steps, server.url, corpus, work))
            r = rows[-1]
            print(
                f"[{len(rows)}/{len(plan)}] {kind} seed {seed} {mode}: final {r['final']:.4f}, "
                f"{_actions_text(r)}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        server.stop()
    judge(rows)
    s = summarise(rows)
    print_table(rows, s)
    share = s["act_within"] / s["act_runs"] if s["act_runs"] else 0.0
    goals = {"within_twin": {"value": share, "target": GOAL_WITHIN, "met": share >= GOAL_WITHIN}}
    seconds = time.monotonic() - started
    meta = {"smoke": args.small, "seeds": len(seeds), "kinds": kinds, "step": STEP, "steps": steps}
    out = {
        "meta": {**meta, "last": LAST, "seconds": seconds},
        "rows": rows,
        **s,
        "goals": goals,
        "summary": f"remediation: {s['act_within']}/{s['act_runs']} fault runs within 2% of the twin with "
        f"policies, {s['off_within']}/{s['off_runs']} without; {s['healthy_actions']} actions on "
        f"{s['healthy_runs']} healthy runs; {s['audited']}/{s['actions']} actions audited",
    }
    write_json(args.out, out)
    print(f"wrote {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
