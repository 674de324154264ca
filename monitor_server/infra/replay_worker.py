"""`fp8-monitor replay-worker`: replays the incidents people ask for from the incident page.

A bundle lies where the job trained; the worker runs on a machine that sees the bundles' paths (the
training node, or one sharing its file system) with the runtime installed (``fp8-train``). It polls the
service for pending replay requests (``GET /replay-requests?state=pending``), claims the oldest (another
worker that claimed it first wins: 409, the next is tried), runs ``fp8-train replay BUNDLE --monitor-url
URL --run-id ... --incident ...`` in a child process, which stores the report on the incident (and lets the
run's remediation policy act on it), and says how it ended: ``done``, or ``failed`` with the child's last
line (a bundle this machine does not have fails at once, saying so). One replay at a time; a replay runs
for at most ``--timeout-seconds``.

Needs only httpx and the protocol package, as ``fp8-monitor upload``; the token (``$FP8SCOPE_TOKEN``, or the
file ``$FP8SCOPE_TOKEN_FILE`` names) needs the ``control`` scope, and is handed to the replay.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from fp8_protocol.api import API_PREFIX

#: the longest detail a failed request gets (the end of the child's output)
DETAIL_CHARS = 2000


class ReplayWorker:
    """The worker's loop over one service (module docstring)."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout_s: float = 3600.0,
        python: str = sys.executable,
        say: Callable[[str], None] = print,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.python = python
        self.say = say
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url + API_PREFIX, headers=headers, timeout=30)

    def close(self) -> None:
        self.client.close()

    def run_once(self) -> dict[str, Any] | None:
        """Claim and run the oldest pending request; returns it as finished (None: nothing was pending)."""
        pending = self.client.get("/replay-requests", params={"state": "pending"})
        pending.raise_for_status()
        for request in pending.json():
            claimed = self.client.post(f"/replay-requests/{request['id']}/claim")
            if claimed.status_code == 409:  # another worker took it
                continue
            claimed.raise_for_status()
            state, detail = self._replay(claimed.json())
            body = {"state": state, "detail": detail}
            finished = self.client.post(f"/replay-requests/{request['id']}/finish", json=body)
            finished.raise_for_status()
            return dict(finished.json())
        return None

    def _replay(self, request: dict[str, Any]) -> tuple[str, str | None]:
        """("done", None) when `fp8-train replay` stored its report, else ("failed", why)."""
        bundle, where = request["bundle"], f"incident {request['incident_id']} of run {request['run_id']}"
        if not Path(bundle).is_file():
            self.say(f"fp8-monitor replay-worker: {bundle}: not on this machine ({where})")
            return "failed", f"bundle not found on the replay worker's machine: {bundle}"
        argv = [self.python, "-m", "fp8_trainer.app.cli", "replay", bundle, "--monitor-url", self.url]
        argv += ["--run-id", str(request["run_id"]), "--incident", str(request["incident_id"])]
        env = {**os.environ, **({"FP8SCOPE_TOKEN": self.token} if self.token else {})}
        self.say(f"fp8-monitor replay-worker: replaying {bundle} onto {where}")
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return "failed", f"the replay ran past {self.timeout_s:g} s (--timeout-seconds)"
        if done.returncode == 0:
            self.say(f"fp8-monitor replay-worker: {where}: report stored")
            return "done", None
        lines = (done.stderr or done.stdout or "").strip().splitlines()
        why = f"fp8-train replay exited with {done.returncode}" + (f": {lines[-1]}" if lines else "")
        self.say(f"fp8-monitor replay-worker: {where}: {why}")
        return "failed", why[-DETAIL_CHARS:]

    def serve(self, poll_s: float, once: bool) -> int:
        """Run requests until interrupted (`once`: until none is pending). Returns how many ran."""
        ran = 0
        while True:
            try:
                finished = self.run_once()
            except httpx.HTTPError as exc:  # the service is away: try again later
                self.say(f"fp8-monitor replay-worker: {exc}")
                finished = None
                if once:
                    raise
            if finished is not None:
                ran += 1
                continue
            if once:
                return ran
            time.sleep(poll_s)  # nothing pending: poll again
