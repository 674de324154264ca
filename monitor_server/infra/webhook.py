"""Incident delivery to a webhook (Slack-compatible JSON), off the ingest path.

`WebhookNotifier.submit` only appends to a bounded in-memory queue; one daemon thread POSTs each message with
httpx, retrying connection errors, timeouts, 5xx and 429 with exponential backoff. A slow or dead webhook
therefore never slows ingest; when the queue is full the oldest message is dropped (and counted).

Messages submitted with a `key` (the service uses the run id) are rate-limited per key: at most one POST per
`min_interval_s`; what is submitted for a key while its next POST waits joins that POST (one message listing
them). `settle_s` holds every message that long before its first attempt, and a message may be a callable
that builds the dict when it is sent: an incident is then described with what the detectors added to it in
the seconds after it opened (its root cause can still move to an earlier tensor).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
SEVERITY_EMOJI = {
    "critical": ":red_circle:",
    "warning": ":large_orange_circle:",
    "info": ":large_blue_circle:",
}


def slack_escape(text: str) -> str:
    """Text as Slack shows it literally in ``mrkdwn`` and in a message's ``text``: its three control
    characters escaped, so a run name or message of ``<!channel>`` or ``<https://x|label>`` is not a mention
    or a link (Slack's "escaping text" rules; nothing else needs escaping)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _field(alert: dict[str, Any], *names: str, default: str = "-") -> str:
    for name in names:
        value = alert.get(name)
        if value is not None and value != "":
            return str(value)
    return default


def slack_payload(alert: dict[str, Any]) -> dict[str, Any]:
    """A Slack-compatible message (``text`` fallback + Block Kit ``blocks``) for one alert or incident dict.

    Reads ``kind``, ``severity``, ``message``, the run (``run_name`` / ``run`` / ``run_id``), the tensor
    (``tensor_name`` / ``tensor`` / ``tensor_index``), the step (``step`` / ``last_step`` / ``first_step``),
    an optional dashboard ``url``, and for an incident ``incident_id`` and ``affected`` (tensor names, root
    cause first).
    """
    # every value may come from a training job (run and tensor names, messages that quote them): escaped
    # for the mrkdwn and text fields; the header is plain_text, shown as is
    raw_kind = _field(alert, "kind", default="alert")
    raw_run = _field(alert, "run_name", "run", "run_id")
    kind, run = slack_escape(raw_kind), slack_escape(raw_run)
    severity = slack_escape(_field(alert, "severity", default="warning"))
    tensor = slack_escape(_field(alert, "tensor_name", "tensor", "tensor_index", default="(run-level)"))
    step = slack_escape(_field(alert, "step", "last_step", "first_step"))
    message = slack_escape(_field(alert, "message", default=""))
    incident = alert.get("incident_id")
    what = f"incident #{incident}: {kind}" if incident is not None else kind
    text = f"[{severity.upper()}] {what} in run {run}, tensor {tensor}, step {step}: {message}"
    affected = [slack_escape(str(a)) for a in alert.get("affected") or []]
    if len(affected) > 1:
        text += f" ({len(affected)} tensors affected)"
    if alert.get("url"):
        text += f" {alert['url']}"
    raw_what = f"incident #{incident}: {raw_kind}" if incident is not None else raw_kind
    header = f"fp8scope {_field(alert, 'severity', default='warning')}: {raw_what} in run {raw_run}"
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": header[:150]}},
        {
            "type": "section",
            "text": {"type": "mrkdwn", "text": f"{SEVERITY_EMOJI.get(severity, '')} {message}"[:3000]},
        },
        {
            "type": "section",
            "fields": [
                {"type": "mrkdwn", "text": f"*Kind*\n{kind}"},
                {"type": "mrkdwn", "text": f"*Severity*\n{severity}"},
                {"type": "mrkdwn", "text": f"*Run*\n{run}"},
                {"type": "mrkdwn", "text": f"*Tensor*\n{tensor}"},
                {"type": "mrkdwn", "text": f"*Step*\n{step}"},
            ],
        },
    ]
    if len(affected) > 1:
        listed = ", ".join(affected[:8]) + (f", ... ({len(affected)} in all)" if len(affected) > 8 else "")
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"*Affected*\n{listed}"[:3000]}})
    if alert.get("url"):
        blocks.append(
            {"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{alert['url']}|Open run>"}]}
        )
    return {"text": text, "blocks": blocks}


def slack_payload_many(items: list[dict[str, Any]]) -> dict[str, Any]:
    """One message for several alerts or incidents of one key (a rate-limited run): the first in full,
    the others as one line each."""
    if len(items) == 1:
        return slack_payload(items[0])
    first = slack_payload(items[0])
    lines = [slack_payload(item)["text"] for item in items]
    raw_run = _field(items[0], "run_name", "run", "run_id")
    text = f"{len(items)} incidents in run {slack_escape(raw_run)}:\n" + "\n".join(
        f"- {line}" for line in lines
    )
    blocks = [
        {
            "type": "header",
            "text": {
                "type": "plain_text",
                "text": f"fp8scope: {len(items)} incidents in run {raw_run}"[:150],
            },
        },
        *first["blocks"][1:],
        {
            "type": "section",
            "text": {"type": "mrkdwn", "text": "\n".join(f"- {line}" for line in lines[1:])[:3000]},
        },
    ]
    return {"text": text, "blocks": blocks}


Message = dict[str, Any] | Callable[[], dict[str, Any] | None]


@dataclass
class _Pending:
    """One POST to be made: its messages (several when a rate-limited key gathered them) and when."""

    due: float
    seq: int
    key: Hashable | None
    items: list[Message] = field(default_factory=list)


class WebhookNotifier:
    """Posts messages to `url` from a daemon thread.

    Args:
        url: the webhook (e.g. a Slack incoming-webhook URL).
        max_retries: retries after the first attempt before a message counts as failed (logged once).
        backoff_s: delay before retry k is ``backoff_s * 2**k`` (capped at 30 s; a 429's Retry-After is
            honoured up to the same cap).
        timeout_s: per-request timeout.
        queue_size: messages held while the webhook is slow; beyond it the oldest is dropped.
        min_interval_s: per key, the least time between two POSTs (messages gathered meanwhile go in one).
        settle_s: how long a message waits before its first attempt.

    `stats` counts ``sent`` / ``failed`` (POSTs delivered / given up), ``dropped`` (messages: queue full, or
    still queued at close), ``queued`` (messages waiting) and ``merged`` (messages that shared a POST).
    """

    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        queue_size: int = 1000,
        min_interval_s: float = 0.0,
        settle_s: float = 0.0,
    ) -> None:
        if max_retries < 0 or backoff_s < 0 or timeout_s <= 0 or queue_size < 1:
            raise ValueError("max_retries and backoff_s must be >= 0, timeout_s > 0 and queue_size >= 1")
        if min_interval_s < 0 or settle_s < 0:
            raise ValueError("min_interval_s and settle_s must be >= 0")
        self.url = url
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.queue_size = queue_size
        self.min_interval_s = min_interval_s
        self.settle_s = settle_s
        self._pending: list[_Pending] = []  # in submission order
        self._open: dict[Hashable, _Pending] = {}  # per key, the POST still gathering messages
        self._next_allowed: dict[Hashable, float] = {}  # per key, the earliest time of its next POST
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._abort = threading.Event()  # set when close() times out: stop retrying, stop sleeping
        self._counts = {"sent": 0, "failed": 0, "dropped": 0, "merged": 0}
        self._thread = threading.Thread(target=self._worker, name="fp8scope-webhook", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._counts, "queued": self._queued()}

    def _queued(self) -> int:
        return sum(len(p.items) for p in self._pending)

    def submit(self, message: Message, key: Hashable | None = None) -> None:
        """Queue a message (a dict, or a callable returning one, or None to send nothing); never blocks.
        After close() the message is dropped."""
        with self._cond:
            if self._closing:
                self._counts["dropped"] += 1
                log.warning("webhook notifier is closed; dropping a message")
                return
            if self._queued() >= self.queue_size:
                self._drop_oldest()
            now = time.monotonic()
            gathering = self._open.get(key) if key is not None else None
            if gathering is not None:
                gathering.items.append(message)
                self._counts["merged"] += 1
            else:
                due = max(now + self.settle_s, self._next_allowed.get(key, 0.0) if key is not None else 0.0)
                entry = _Pending(due, next(self._seq), key, [message])
                self._pending.append(entry)
                if key is not None:
                    self._open[key] = entry
                    self._next_allowed[key] = due + self.min_interval_s
            self._cond.notify()

    def _drop_oldest(self) -> None:
        entry = self._pending[0]
        entry.items.pop(0)
        if not entry.items:
            self._pending.pop(0)
            if entry.key is not None and self._open.get(entry.key) is entry:
                del self._open[entry.key]
        self._counts["dropped"] += 1
        log.warning("webhook queue full (%d); dropping the oldest message", self.queue_size)

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued, at once (for up to `timeout` seconds), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(max(1.0, self.timeout_s))
        with self._cond:
            left = self._queued()
            if left:
                log.warning("webhook notifier closed with %d messages undelivered", left)
                self._counts["dropped"] += left
                self._pending.clear()
                self._open.clear()

    # ---- worker thread ------------------------------------------------------------------------------------
    def _take(self) -> _Pending | None:
        """The next POST once it is due (at once when closing); None when closed and empty."""
        with self._cond:
            while True:
                if self._abort.is_set() or (self._closing and not self._pending):
                    return None
                if self._pending:
                    entry = min(self._pending, key=lambda p: (p.due, p.seq))
                    wait = 0.0 if self._closing else entry.due - time.monotonic()
                    if wait <= 0:
                        self._pending.remove(entry)
                        if entry.key is not None and self._open.get(entry.key) is entry:
                            del self._open[entry.key]
                        return entry
                    self._cond.wait(wait)
                else:
                    self._cond.wait()

    def _worker(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while True:
                entry = self._take()
                if entry is None:
                    return
                items = []
                for item in entry.items:
                    try:
                        built = item() if callable(item) else item
                    except Exception:  # a message that cannot be built must not stop the others
                        log.exception("webhook: could not build a message; skipping it")
                        continue
                    if built is not None:
                        items.append(built)
                if not items:
                    continue
                ok = self._deliver(client, items)
                with self._cond:
                    self._counts["sent" if ok else "failed"] += 1

    def _deliver(self, client: httpx.Client, items: list[dict[str, Any]]) -> bool:
        payload = slack_payload_many(items)
        reason = ""
        for attempt in range(self.max_retries + 1):
            if attempt and self._abort.wait(self._delay(attempt - 1, reason)):
                break
            try:
                response = client.post(self.url, json=payload)
            except httpx.HTTPError as exc:  # connection refused, timeouts, protocol errors
                reason = f"{type(exc).__name__}: {exc}"
                continue
            if response.is_success:
                return True
            reason = f"HTTP {response.status_code}"
            if response.status_code == 429:
                reason += f" retry-after={response.headers.get('retry-after', '')}"
            elif response.status_code < 500:
                break  # 4xx other than 429: retrying will not help
        log.warning(
            "webhook gave up on a %s message after %d attempt(s): %s",
            items[0].get("kind"),
            attempt + 1,
            reason,
        )
        return False

    def _delay(self, retry: int, reason: str) -> float:
        delay = self.backoff_s * 2.0**retry
        if "retry-after=" in reason:
            with contextlib.suppress(ValueError):
                delay = max(delay, float(reason.rsplit("=", 1)[1]))
        return min(delay, MAX_BACKOFF_S)
