"""Automatic replay: with ``--remediation propose|act`` a job replays its own incident bundles as it trains.

Each bundle the job writes (``fp8_trainer.app.incident_capture``) is replayed in a child process,
``python -m fp8_trainer.app.auto_replay BUNDLE --monitor-url URL --run-id ID``, at a lower priority
(``os.nice(NICE)``), so the training loop never waits on it: the loop only checks, once per step, whether
the child has ended (``Popen.poll``, one system call). The child finds the incident that lists the bundle
(the service pairs a bundle with an incident by step, from the job's ``incident_bundle`` event), runs
``fp8_trainer.app.replay.replay`` and stores the report on that incident; the service's remediation policy
(``monitor_server/services/policies.py``) then acts on a report that says *fp8-caused*, and its command
reaches the job in a telemetry answer like any other.

At most one replay runs per job; later bundles wait in a queue of at most ``QUEUE_MAX`` (the capture
writes at most 4 per run; one beyond is dropped with a line). A child that fails (its exit code, the last
line of its log ``<bundle>.replay.log``) is reported with a line and an ``auto_replay_failed`` event;
training goes on. When the job ends, a replay still running is stopped (SIGTERM, then SIGKILL after
``STOP_GRACE_S``) and the queued ones are dropped; each is named with the command that replays it by hand.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["AutoReplay", "QUEUE_MAX", "find_incident", "main"]

#: bundles waiting for the running replay, at most (the capture writes at most 4 per run)
QUEUE_MAX = 4
#: the child's niceness increment: the replay yields the CPU to the training loop
NICE = 10
#: seconds a stopped child gets after SIGTERM before SIGKILL
STOP_GRACE_S = 5.0
#: seconds the child waits for the service to list the bundle on an incident (telemetry may lag)
INCIDENT_WAIT_S = 120.0
#: exit code of a child whose bundle no incident lists
NO_INCIDENT = 3
#: seconds a job that waits for a replay (``run_now``: ``--remediation act``) gives it before stopping it
FOREGROUND_WAIT_S = 900.0


@dataclass
class _Pending:
    bundle: str  # the path as the job reported it (and the service lists it)
    step: int
    proc: subprocess.Popen | None = None
    log: Path = field(default_factory=Path)


class AutoReplay:
    """The job's side: a queue of bundles and at most one replay child (module docstring).

    ``after_step(step, bundle, monitor)`` once per optimizer step (``bundle``: the one written this step, or
    None); ``close(monitor, step)`` when the job ends.
    """

    def __init__(self, monitor_url: str, device: str, say, *, token_env: dict[str, str] | None = None):
        self.url, self.device, self.say = monitor_url, device, say
        self.token_env = token_env or {}  # FP8SCOPE_TOKEN(_FILE) for the child, from the job's flags
        self.queue: deque[_Pending] = deque()
        self.running: _Pending | None = None
        self.finished: list[tuple[str, int]] = []  # (bundle, exit code) of each child that ended

    @classmethod
    def for_job(cls, a, capture, say) -> AutoReplay | None:
        """For ``fp8-train``'s flags ``a``: with ``--remediation propose|act``, a monitor and a capture."""
        if a.remediation not in ("propose", "act") or not a.monitor_url or capture is None:
            return None
        token_env = {"FP8SCOPE_TOKEN": a.token} if a.token else {}
        if a.token_file:
            token_env = {"FP8SCOPE_TOKEN_FILE": os.path.abspath(a.token_file)}
        device = "cuda" if str(a.device).startswith("cuda") else "cpu"
        say(f"fp8-train: each incident bundle is replayed in a child process (--remediation {a.remediation})")
        return cls(a.monitor_url, device, say, token_env=token_env)

    def after_step(self, step: int, bundle: str | Path | None, monitor) -> None:
        if bundle is not None:
            if len(self.queue) >= QUEUE_MAX:
                self.say(f"fp8-train: auto replay: queue full ({QUEUE_MAX}); {bundle} is not replayed")
            else:
                self.queue.append(_Pending(str(bundle), step))
        if self.running is not None and self.running.proc is not None:
            code = self.running.proc.poll()
            if code is None:
                return
            self._ended(self.running, code, step, monitor)
            self.running = None
        if self.queue and monitor.run_id is not None:  # the run is registered: the child can name it
            self._start(self.queue.popleft(), int(monitor.run_id))

    def run_now(self, step: int, bundle: str | Path, monitor, timeout: float = FOREGROUND_WAIT_S) -> int:
        """Replay ``bundle`` (written at ``step``) in a child and wait for it, at most ``timeout`` seconds
        (then it is stopped); its exit code (``-1``: not started or stopped). For a job that pauses at its
        incident (``fp8_trainer.app.retry``); the run must be registered (``monitor.run_id``)."""
        job, beside = _Pending(str(bundle), step), self.running
        self._start(job, int(monitor.run_id))
        self.running = beside  # this one is waited for here, not polled after each step
        if job.proc is None:
            return -1
        try:
            code = job.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._stop(job)
            self.say(f"fp8-train: auto replay of {job.bundle} stopped after {timeout:.0f} s (log {job.log})")
            self.finished.append((job.bundle, -1))
            return -1
        self._ended(job, code, step, monitor)
        return code

    def _start(self, job: _Pending, run_id: int) -> None:
        job.log = Path(job.bundle + ".replay.log")
        cmd = [sys.executable, "-m", "fp8_trainer.app.auto_replay", job.bundle, "--monitor-url", self.url]
        cmd += ["--run-id", str(run_id), "--step", str(job.step), "--device", self.device]
        env = {**os.environ, **self.token_env}  # not on the command line (visible in the process list)
        try:
            with open(job.log, "w", encoding="utf-8") as log:
                job.proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # a Ctrl-C at the terminal reaches the job, which stops it
                )
        except OSError as e:  # no log file, no process: said, and training goes on
            self.finished.append((job.bundle, -1))
            self.say(f"fp8-train: auto replay of {job.bundle} not started: {e}")
            return
        self.running = job
        self.say(f"fp8-train: auto replay of {job.bundle} started (pid {job.proc.pid}, log {job.log})")

    def _ended(self, job: _Pending, code: int, step: int, monitor) -> None:
        self.finished.append((job.bundle, code))
        last = _last_line(job.log)
        if code == 0:
            self.say(f"fp8-train: auto replay of {job.bundle}: {last}")
            return
        self.say(f"fp8-train: auto replay of {job.bundle} failed (exit {code}): {last} (log {job.log})")
        monitor.event("auto_replay_failed", step, bundle=job.bundle, exit_code=code, reason=last[:500])

    def close(self, monitor, step: int) -> None:
        """The job ends: a running replay is stopped, the queued ones dropped (each named, with a command)."""
        job = self.running
        if job is not None and job.proc is not None:
            code = job.proc.poll()
            if code is not None:
                self._ended(job, code, step, monitor)
            else:
                self._stop(job)
                self.say(f"fp8-train: auto replay of {job.bundle} stopped: the job ended first")
                self.queue.appendleft(job)
        self.running = None
        run = monitor.run_id if monitor.run_id is not None else "RUN"
        for left in self.queue:
            self.say(
                f"fp8-train: not replayed: {left.bundle} (by hand: fp8-train replay {left.bundle} "
                f"--monitor-url {self.url} --run-id {run} --incident ID, the incident that lists "
                "it)"
            )
        self.queue.clear()

    @staticmethod
    def _stop(job: _Pending) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S``."""
        job.proc.terminate()
        try:
            job.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1].strip() if lines else "(empty log)"


def find_incident(incidents: list[dict[str, Any]], listed: str, step: int) -> dict[str, Any] | None:
    """Of the run's incidents, the one the bundle ``listed`` (written at ``step``) belongs to: among those
    that list it, the one whose steps hold ``step``, else the one whose first step is nearest."""
    mine = [i for i in incidents if listed in (i.get("bundles") or [])]
    if not mine:
        return None
    holding = [i for i in mine if i["first_step"] <= step <= i["last_step"]]
    return min(holding or mine, key=lambda i: (abs(i["first_step"] - step), i["id"]))


def _wait_incident(url: str, run_id: int, listed: str, step: int, timeout: float) -> dict[str, Any] | None:
    import httpx

    from fp8_protocol.api import API_PREFIX
    from fp8_protocol.env import env_token

    token = env_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url.rstrip("/") + API_PREFIX, headers=headers, timeout=30) as client:
        while True:
            r = client.get(f"/runs/{run_id}/incidents", params={"limit": 1000})
            r.raise_for_status()
            found = find_incident(r.json(), listed, step)
            if found is not None or time.monotonic() > deadline:
                return found
            time.sleep(0.5)  # the service pairs the bundle once the incident's telemetry is stored


def main(argv: list[str] | None = None) -> int:
    """The child: find the bundle's incident, replay the bundle, store the report there."""
    p = argparse.ArgumentParser(
        prog="python -m fp8_trainer.app.auto_replay", description=__doc__.splitlines()[0]
    )
    p.add_argument("bundle", help="the bundle, as the job reported it")
    p.add_argument("--monitor-url", required=True)
    p.add_argument("--run-id", type=int, required=True)
    p.add_argument("--step", type=int, required=True, help="the step the bundle was written at")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--wait", type=float, default=INCIDENT_WAIT_S, help="seconds to wait for the incident")
    a = p.parse_args(argv)
    os.nice(NICE)
    if not Path(a.bundle).is_file():
        print(f"{a.bundle}: no such file", flush=True)
        return 2
    from .replay import post_report, replay

    step = a.step
    print(f"bundle {a.bundle}: step {step}; waiting for its incident on run {a.run_id}", flush=True)
    incident = _wait_incident(a.monitor_url, a.run_id, a.bundle, step, a.wait)
    if incident is None:
        print(f"no incident of run {a.run_id} lists {a.bundle} after {a.wait:.0f} s", flush=True)
        return NO_INCIDENT
    print(f"incident {incident['id']} (steps {incident['first_step']}-{incident['last_step']})", flush=True)
    report = replay(a.bundle, device=a.device)
    post_report(report, a.monitor_url, a.run_id, incident["id"])
    culprit = report["culprits"][0] if report["culprits"] else "-"
    print(f"{report['verdict']} (first culprit {culprit}), stored on incident {incident['id']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
