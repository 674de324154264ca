"""The monitor's background thread: batching, encoding, compression, retries, spooling, commands in.

The training thread only puts host data on a queue (``StepRecord``, events, acks). This thread turns them
into telemetry bodies (packed base64 columns, gzip), posts them in order with the same idempotency key on
every retry, and never lets a slow or dead service reach the training loop:

* a batch that still fails after the retries (connection error, timeout, 5xx) goes to the spool, and so
  does every later batch while the service is away; the service is probed every ``probe_interval`` s and,
  once back, the spooled batches are sent first (in order), then live sending resumes;
* steps waiting to be sent are capped (``max_buffered_steps``): beyond the cap the oldest batches go to
  the spool and are sent from there once the backlog is gone (steps arriving while one post is in flight
  wait in the queue; ``http_timeout`` bounds that wait);
* a batch refused for its token (401, 403) is spooled too and logged once, for a later upload with the
  right token; 408 and 429 are retried like a 5xx;
* a batch the service rejects as malformed (any other 4xx: 400, 413, 415, 422, ...) would be rejected
  again however often it is sent: it is dropped with the service's reason in the log, and the batches
  after it are sent as usual;
* a batch the service keeps failing on (a 5xx answer in ``max_server_errors`` sends, while the service
  answers) is set aside in the spool for a later upload, so one poisoned batch never holds up the rest.

No torch import here: the data arrives as numpy arrays and floats.
"""

from __future__ import annotations

import gzip
import logging
import math
import queue
import shlex
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from fp8_protocol.api import API_PREFIX
from fp8_protocol.codec import encode_float, pack_column
from fp8_protocol.stats import BLOCK_COLUMNS, STAT_COLUMNS

from .spool import SpoolWriter, dumps

log = logging.getLogger("fp8scope.monitor")


@dataclass
class StepRecord:
    """One optimizer step: ``stats`` (T, 10) float64 in ``STAT_COLUMNS`` order (or (T, 6), the base columns
    alone, from a source without quality statistics), or None for a step in which no FP8 layer ran (it is
    sent with its scalars only); scalars as floats. ``block`` (T, 5) in ``BLOCK_COLUMNS`` order and
    ``block_hist`` (T, 256), the block scale exponent histograms, where the run has block-scaled layers
    (zeros for per-tensor-scaled tensors), else None."""

    step: int
    stats: np.ndarray | None
    scalars: dict[str, float]
    block: np.ndarray | None = None
    block_hist: np.ndarray | None = None


@dataclass
class Outgoing:
    """A telemetry body ready to post (kept as a dict until sent or spooled)."""

    body: dict[str, Any]
    n_steps: int
    urgent: bool = False


@dataclass
class SenderConfig:
    flush_interval: float = 1.0  # seconds; each batch has a fixed cost on the service (one transaction)
    max_batch_steps: int = 64
    max_buffered_steps: int = 4096
    retry_delays: tuple[float, ...] = (0.2, 0.5, 1.0)
    probe_interval: float = 1.0
    http_timeout: float = 5.0
    alerts_refresh: float = 3.0
    gzip: bool = True
    close_timeout: float = 15.0
    max_server_errors: int = 3  # sends of one batch answered with a 5xx before it is set aside
    extra_headers: dict[str, str] = field(default_factory=dict)


def step_body(rec: StepRecord, with_block: bool = False) -> dict[str, Any]:
    """One step of a telemetry batch. ``with_block``: the run has had a block-scaled tensor, so the step's
    statistics carry the six ``BLOCK_COLUMNS`` (zeros where ``rec`` has none: per-tensor scaled), and
    ``"block_hist"`` lists ``[tensor index, lo, counts]`` for the tensors with blocks in this step, the
    non-zero span of each histogram only (``fp8_protocol.stats.BLOCK_HIST_BINS``)."""
    scalars = {k: encode_float(float(v)) for k, v in rec.scalars.items()}
    body: dict[str, Any] = {"step": rec.step, "scalars": scalars}
    if rec.stats is not None:
        # the base columns, and the quality columns where the block has them (a source without them,
        # e.g. a caller's own 6-column block, leaves them out of the step: never NaN placeholders)
        cols = STAT_COLUMNS[: rec.stats.shape[1]]
        body["stats"] = {name: pack_column(rec.stats[:, j]) for j, name in enumerate(cols)}
        if with_block or rec.block is not None:
            block = rec.block if rec.block is not None else np.zeros((rec.stats.shape[0], len(BLOCK_COLUMNS)))
            body["stats"].update({name: pack_column(block[:, j]) for j, name in enumerate(BLOCK_COLUMNS)})
            hist = block_hist_entries(rec.block_hist)
            if hist:
                body["block_hist"] = hist
    return body


def block_hist_entries(hist: np.ndarray | None) -> list[list]:
    """``[[tensor index, lo, counts], ...]`` for the rows of a (T, 256) histogram that have any block: the
    span from the first to the last non-zero bin."""
    out: list[list] = []
    if hist is None:
        return out
    for i in np.flatnonzero(hist.any(axis=1)):
        nz = np.flatnonzero(hist[i])
        lo, hi = int(nz[0]), int(nz[-1])
        out.append([int(i), lo, [int(c) for c in hist[i, lo : hi + 1]]])
    return out


def refusal(status: int, text: str, root: str) -> str:
    """What a 4xx answer to the run registration means, in words."""
    detail = text[:300]
    if status == 401:
        return (
            f"token rejected (HTTP 401: {detail}); pass token=, or set FP8SCOPE_TOKEN or FP8SCOPE_TOKEN_FILE "
            "(fp8-train: --token-file)"
        )
    if status == 403:
        return f"the token lacks the 'ingest' scope (HTTP 403: {detail})"
    if status in (404, 405):
        return (
            f"no fp8scope API at {root} (HTTP {status}); the URL must be the service root, "
            "e.g. http://127.0.0.1:8000, not a page or an /api path"
        )
    return f"the service refused the run (HTTP {status}: {detail})"


class Sender(threading.Thread):
    """Posts telemetry for one run; see the module docstring."""

    def __init__(
        self,
        url: str,
        token: str | None,
        run_body: dict[str, Any],
        client_key: str,
        spool: SpoolWriter,
        config: SenderConfig,
        on_commands,
    ):
        super().__init__(name="fp8scope-monitor", daemon=True)
        self.root = url.rstrip("/")
        self.base = self.root + API_PREFIX
        self.run_body = {**run_body, "client_key": client_key}
        self.client_key = client_key
        self.spool = spool
        self.cfg = config
        self.on_commands = on_commands
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        headers = {"Content-Type": "application/json", **config.extra_headers}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.http = httpx.Client(headers=headers, timeout=config.http_timeout)
        self.run_id: int | None = None
        self.refused: str | None = None  # why the service refused the run, in words
        self.open_alerts = 0
        self.open_incidents = 0
        self.spooling = False
        self.spooled: deque[int] = deque()  # offsets of spooled batches not yet delivered
        self.spool_must_stay = False  # a refused batch or the status lives only in the spool
        self.final_status: str | None = None
        self._steps: list[StepRecord] = []
        self._events: list[dict[str, Any]] = []
        self._acks: list[dict[str, Any]] = []
        self._first_at = 0.0
        self._send_now = False  # put_flush: what is queued goes out at once, not after flush_interval
        self._flushed: list[threading.Event] = []  # put_flush's, set once what came before it went out
        self._outbox: deque[Outgoing] = deque()
        self._seq = 0
        self._next_probe = 0.0
        self._next_alerts = 0.0
        self._stop_at: float | None = None
        self._logged: set[str] = set()
        self._refused = False  # the service refused the registration: no point in probing again
        self.failed = False
        self.stats = {"posted": 0, "spooled": 0, "drained": 0, "failed_posts": 0, "dropped": 0}
        self._server_errors: dict[str, int] = {}  # idempotency key -> sends answered with a 5xx
        self.sampler: Any = None  # a system.SystemSampler, sampled on this thread once per batch
        self._block_seen = False  # a step of the run had block columns: all later steps carry them

    # ----- called from the training thread -----
    def put_step(self, rec: StepRecord) -> None:
        if not self.failed:  # a dead thread would let the queue grow without bound
            self.inbox.put(("step", rec))

    def put_event(self, event: dict[str, Any]) -> None:
        if not self.failed:
            self.inbox.put(("event", event))

    def put_ack(self, ack: dict[str, Any]) -> None:
        if not self.failed:
            self.inbox.put(("ack", ack))

    def put_flush(self, done: threading.Event) -> None:
        """Send what is queued so far at once, not after ``flush_interval`` (a batch, if only an empty one,
        whose answer brings the waiting commands), and set ``done`` once it has gone out (answered, the
        commands of the answer handed on, or spooled)."""
        if not self.failed:
            self.inbox.put(("flush", done))

    def finish(self, status: str) -> None:
        self.inbox.put(("finish", status))

    # ----- helpers -----
    def upload_command(self) -> str:
        """The command that sends this run's spool later (with the service root, which ``fp8-monitor upload``
        would otherwise take from ``FP8SCOPE_URL``; a token is never printed: it reads the environment)."""
        return f"fp8-monitor upload {shlex.quote(str(self.spool.path))} --url {shlex.quote(self.root)}"

    def log_once(self, kind: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.log(level, msg, *args)

    def _post(self, path: str, body: dict[str, Any], compress: bool = False) -> httpx.Response:
        content = dumps(body)  # an unexpected object in a body becomes text instead of killing this thread
        headers = {}
        if compress and self.cfg.gzip and len(content) > 1024:  # the service gunzips telemetry only
            content = gzip.compress(content, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        return self.http.post(self.base + path, content=content, headers=headers)

    def _register(self) -> bool:
        try:
            r = self._post("/runs", self.run_body)
        except httpx.HTTPError as exc:
            self._note_failure(f"registering the run: {exc!r}")
            return False
        if r.status_code in (200, 201):
            self.run_id = r.json()["id"]
            log.info("fp8scope monitor: run %s registered at %s", self.run_id, self.base)
            return True
        if r.status_code >= 500:
            self._note_failure(f"registering the run: HTTP {r.status_code}")
            return False
        # a 4xx will not get better by retrying: keep everything in the spool for a later upload
        self.refused = refusal(r.status_code, r.text, self.base[: -len(API_PREFIX)])
        self.log_once("register-4xx", "fp8scope monitor: %s", self.refused)
        self.spool_must_stay = True
        self._refused = True
        self._start_spooling()
        return False

    def register_now(self) -> bool:
        """Register the run on the calling thread (before ``start``); False if refused or unreachable."""
        return self._register()

    def _note_failure(self, what: str) -> None:
        self.stats["failed_posts"] += 1
        self.log_once("unreachable-" + what.split(":")[0], "fp8scope monitor: %s", what, level=logging.INFO)

    def _start_spooling(self) -> None:
        if not self.spooling:
            self.spooling = True
            if self._refused:
                log.warning(
                    "fp8scope monitor: spooling telemetry to %s (the service at %s refused the run); once "
                    "that is fixed: %s",
                    self.spool.path,
                    self.root,
                    self.upload_command(),
                )
            else:
                log.warning(
                    "fp8scope monitor: service at %s unreachable; spooling telemetry to %s "
                    "(sent when the service is back, or later with: %s)",
                    self.root,
                    self.spool.path,
                    self.upload_command(),
                )
        self._next_probe = math.inf if self._refused else time.monotonic() + self.cfg.probe_interval

    def _spool(self, out: Outgoing) -> None:
        self.spooled.append(self.spool.write_batch(out.body))
        self.stats["spooled"] += 1

    def _send(self, body: dict[str, Any], retries: bool) -> str:
        """Post one batch: 'ok', 'down' (connection / 5xx / 408 / 429 after retries), 'refused' (401 or
        403: the token), 'malformed' (another 4xx: never accepted, however often sent) or 'failing' (the
        service answered this batch with a 5xx in `max_server_errors` sends)."""
        delays = (*self.cfg.retry_delays, None) if retries else (None,)
        server_error = False
        for delay in delays:
            if self._stop_at is not None and time.monotonic() > self._stop_at:
                return "down"
            try:
                r = self._post(f"/runs/{self.run_id}/telemetry", body, compress=True)
                if r.status_code == 200:
                    self.stats["posted"] += 1
                    commands = r.json().get("commands") or []
                    if commands:
                        self.on_commands(commands)
                    return "ok"
                if r.status_code in (401, 403):
                    self.log_once(
                        f"refused-{r.status_code}",
                        "fp8scope monitor: the service refused a batch (HTTP %s: %s); it stays in spool %s",
                        r.status_code,
                        r.text[:300],
                        self.spool.path,
                    )
                    return "refused"
                if r.status_code < 500 and r.status_code not in (408, 429):
                    self.stats["dropped"] += 1
                    self.log_once(
                        f"malformed-{r.status_code}",
                        "fp8scope monitor: the service rejected batch %s as malformed (HTTP %s: %s); "
                        "dropped, later batches are sent as usual",
                        body.get("idempotency_key"),
                        r.status_code,
                        r.text[:300],
                    )
                    return "malformed"
                server_error = r.status_code >= 500
                self._note_failure(f"telemetry: HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                self._note_failure(f"telemetry: {exc!r}")
            if delay is not None:
                time.sleep(delay)
        if server_error:
            key = str(body.get("idempotency_key"))
            self._server_errors[key] = self._server_errors.get(key, 0) + 1
            if self._server_errors[key] >= self.cfg.max_server_errors:
                del self._server_errors[key]
                self.log_once(
                    "failing",
                    "fp8scope monitor: the service failed on batch %s %s times (HTTP 5xx); it is set aside "
                    "in spool %s and later batches are sent",
                    key,
                    self.cfg.max_server_errors,
                    self.spool.path,
                )
                return "failing"
        return "down"

    def _drain_spool(self) -> bool:
        """Send the spooled batches in order; False when the service went away again."""
        while self.spooled:
            body = self.spool.read_batch(self.spooled[0])
            result = self._send(body, retries=False)
            if result == "down":
                return False
            if result in ("refused", "failing"):
                self.spool_must_stay = True  # still in the file, for a later upload
            elif result == "ok":
                self.stats["drained"] += 1
            self.spooled.popleft()
        return True

    def _make_batch(self, urgent: bool) -> None:
        steps, self._steps = self._steps, []
        body: dict[str, Any] = {"idempotency_key": f"{self.client_key}-{self._seq:07d}"}
        self._seq += 1
        if steps:
            if self.sampler is not None:  # system metrics ride with the newest step (about once a second)
                for name, value in self.sampler.sample().items():
                    steps[-1].scalars.setdefault(name, value)
            # once the run has had a block-scaled tensor, every step with statistics carries the block columns
            self._block_seen = self._block_seen or any(rec.block is not None for rec in steps)
            body["steps"] = [step_body(rec, self._block_seen) for rec in steps]
        if self._events:
            body["events"], self._events = self._events, []
        if self._acks:
            body["acks"], self._acks = self._acks, []
        self._outbox.append(Outgoing(body, len(steps), urgent))

    def _take(self, timeout: float) -> bool:
        """Move queued items into the pending lists; True when an event or ack asks for an early batch."""
        urgent = False
        deadline = time.monotonic() + timeout
        while True:
            try:
                wait = max(0.0, deadline - time.monotonic())
                kind, item = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
            except queue.Empty:
                return urgent
            if kind == "step":
                if not self._steps:
                    self._first_at = time.monotonic()
                self._steps.append(item)
                if len(self._steps) >= self.cfg.max_batch_steps:
                    self._make_batch(False)
            elif kind == "event":
                self._events.append(item)
                urgent = True
            elif kind == "ack":
                self._acks.append(item)
                urgent = True
            elif kind == "flush":
                self._send_now = urgent = True
                self._flushed.append(item)
            elif kind == "finish":
                self.final_status = item
                self._stop_at = time.monotonic() + self.cfg.close_timeout
                return True
            deadline = min(deadline, time.monotonic())  # got something: drain the rest without waiting

    # ----- the loop -----
    def run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must not take the training job down; say so once, keep what it held
            self.failed = True
            kept = self._salvage()
            log.exception("fp8scope monitor: sender thread failed; telemetry stops here; %s", kept)
        finally:
            self.http.close()

    def _salvage(self) -> str:
        """After a failure on this thread: what it still held (queued steps, events, batches not sent)
        written to the spool, for ``fp8-monitor upload``; says where, or why it could not."""
        try:
            self._take(0.0)  # what the training thread queued so far
            if self._steps or self._events or self._acks:
                self._make_batch(False)
            while self._outbox:
                self._spool(self._outbox.popleft())
            if not self.spool.created:
                return "it held nothing unsent"
            if self.final_status is not None:
                self.spool.write_status(self.final_status)
            self.spool.close()
            return f"what it held is in {self.spool.path}; send it with: {self.upload_command()}"
        except Exception as exc:
            return f"what it held could not be spooled ({exc!r})"

    def _loop(self) -> None:
        while True:
            busy = self._steps or self.spooling or self._outbox
            # idle (e.g. during an evaluation): wake rarely; a queued item wakes the thread at once anyway
            urgent = self._take(self.cfg.flush_interval / 2 if busy else min(1.0, self.cfg.alerts_refresh))
            finishing = self.final_status is not None
            age = time.monotonic() - self._first_at
            due = finishing or self._send_now or age >= self.cfg.flush_interval
            asked = self._flushed and not self.spooling  # a flush with nothing queued: the answer's commands
            if self._events or self._acks or (self._steps and due) or asked:
                self._send_now = False
                self._make_batch(urgent)
            self._deliver()
            for done in self._flushed:  # the outbox is empty: what came before each flush went out
                done.set()
            self._flushed.clear()
            if finishing:
                self._finish()
                return
            self._refresh_alerts()

    def _deliver(self) -> None:
        now = time.monotonic()
        if self.spooling and now >= self._next_probe:
            if self.run_id is not None or self._register():
                if self._drain_spool():
                    self.spooling = False
                    log.warning("fp8scope monitor: service back at %s; spooled telemetry sent", self.base)
                else:
                    self._start_spooling()
            else:
                self._start_spooling()
        elif self.run_id is None and not self.spooling and not self._register():
            self._start_spooling()
        # the memory cap: batches that piled up (a slow service) beyond it wait in the spool instead
        waiting = sum(out.n_steps for out in self._outbox)
        while len(self._outbox) > 1 and waiting > self.cfg.max_buffered_steps:
            out = self._outbox.popleft()
            waiting -= out.n_steps
            self._spool(out)
            self.log_once(
                "cap",
                "fp8scope monitor: more than %s steps waiting; the oldest go to the spool %s",
                self.cfg.max_buffered_steps,
                self.spool.path,
            )
        if not self.spooling and self.spooled and not self._drain_spool():
            self._start_spooling()
        while self._outbox:
            if self.spooling:
                self._spool(self._outbox.popleft())
                continue
            out = self._outbox[0]
            result = self._send(out.body, retries=True)
            if result == "down":
                self._start_spooling()
                continue
            if result in ("refused", "failing"):
                self.spool_must_stay = True
                self._spool(out)
            self._outbox.popleft()  # sent, set aside, or dropped as malformed: never resent

    def _refresh_alerts(self) -> None:
        now = time.monotonic()
        if self.run_id is None or self.spooling or now < self._next_alerts:
            return
        self._next_alerts = now + self.cfg.alerts_refresh
        try:
            r = self.http.get(f"{self.base}/runs/{self.run_id}", timeout=min(self.cfg.http_timeout, 2.0))
            if r.status_code == 200:
                body = r.json()
                self.open_alerts = int(body.get("open_alerts") or 0)
                self.open_incidents = int(body.get("open_incidents") or 0)
        except httpx.HTTPError:
            pass  # the next telemetry post notices an outage

    def _finish(self) -> None:
        """Final status: PATCH it, or keep it in the spool; close or delete the spool."""
        status = self.final_status
        if self.spooling and self.run_id is not None:
            # the service answered earlier in this run and is away now (a restart, say): keep trying to
            # deliver what was spooled, and the status, until close_timeout, instead of one last try
            while time.monotonic() < self._stop_at:
                if self._drain_spool():
                    self.spooling = False
                    break
                time.sleep(min(0.25, max(0.0, self._stop_at - time.monotonic())))
        elif (
            self.spooling
            and time.monotonic() < self._stop_at
            and self._register()
            and self._drain_spool()  # never reached during the run: one last try
        ):
            self.spooling = False
        patched = False
        if not self.spooling and self.run_id is not None:
            try:
                r = self.http.patch(f"{self.base}/runs/{self.run_id}", json={"status": status})
                patched = r.status_code == 200
            except httpx.HTTPError:
                pass
        if not patched:
            self.spool.write_status(status)
        keep = bool(self.spooled) or self.spool_must_stay or not patched
        if self.spool.created:
            self.spool.close(delete=not keep)
            if keep:
                log.warning(
                    "fp8scope monitor: telemetry left in %s; send it with: %s",
                    self.spool.path,
                    self.upload_command(),
                )
