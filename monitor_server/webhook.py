"""Alert delivery to a webhook (Slack-compatible JSON), off the ingest path.

`WebhookNotifier.submit` only appends to a bounded in-memory queue; one daemon thread POSTs each alert with
httpx, retrying connection errors, timeouts, 5xx and 429 with exponential backoff. A slow or dead webhook
therefore never slows ingest; when the queue is full the oldest alert is dropped (and counted).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any

import httpx

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
SEVERITY_EMOJI = {
    "critical": ":red_circle:",
    "warning": ":large_orange_circle:",
    "info": ":large_blue_circle:",
}


def _field(alert: dict[str, Any], *names: str, default: str = "-") -> str:
    for name in names:
        value = alert.get(name)
        if value is not None and value != "":
            return str(value)
    return default


def slack_payload(alert: dict[str, Any]) -> dict[str, Any]:
    """A Slack-compatible message (``text`` fallback + Block Kit ``blocks``) for one alert dict.

    Reads ``kind``, ``severity``, ``message``, the run (``run_name`` / ``run`` / ``run_id``), the tensor
    (``tensor_name`` / ``tensor`` / ``tensor_index``), the step (``step`` / ``last_step`` / ``first_step``)
    and an optional dashboard ``url``.
    """
    kind = _field(alert, "kind", default="alert")
    severity = _field(alert, "severity", default="warning")
    run = _field(alert, "run_name", "run", "run_id")
    tensor = _field(alert, "tensor_name", "tensor", "tensor_index", default="(run-level)")
    step = _field(alert, "step", "last_step", "first_step")
    message = _field(alert, "message", default="")
    text = f"[{severity.upper()}] {kind} in run {run}, tensor {tensor}, step {step}: {message}"
    header = f"fp8scope {severity}: {kind} in run {run}"
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
    if alert.get("url"):
        blocks.append(
            {"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{alert['url']}|Open run>"}]}
        )
    return {"text": text, "blocks": blocks}


class WebhookNotifier:
    """Posts alerts to `url` from a daemon thread.

    Args:
        url: the webhook (e.g. a Slack incoming-webhook URL).
        max_retries: retries after the first attempt before an alert counts as failed (logged once).
        backoff_s: delay before retry k is ``backoff_s * 2**k`` (capped at 30 s; a 429's Retry-After is
            honoured up to the same cap).
        timeout_s: per-request timeout.
        queue_size: alerts held while the webhook is slow; beyond it the oldest is dropped.

    `stats` counts ``sent``, ``failed`` (gave up), ``dropped`` (queue full, or still queued at close) and
    ``queued``.
    """

    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        queue_size: int = 1000,
    ) -> None:
        if max_retries < 0 or backoff_s < 0 or timeout_s <= 0 or queue_size < 1:
            raise ValueError("max_retries and backoff_s must be >= 0, timeout_s > 0 and queue_size >= 1")
        self.url = url
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.queue_size = queue_size
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._abort = threading.Event()  # set when close() times out: stop retrying, stop sleeping
        self._counts = {"sent": 0, "failed": 0, "dropped": 0}
        self._thread = threading.Thread(target=self._worker, name="fp8scope-webhook", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._counts, "queued": len(self._queue)}

    def submit(self, alert: dict[str, Any]) -> None:
        """Queue an alert for delivery; never blocks. After close() the alert is dropped."""
        with self._cond:
            if self._closing:
                self._counts["dropped"] += 1
                log.warning("webhook notifier is closed; dropping %s alert", alert.get("kind"))
                return
            if len(self._queue) >= self.queue_size:
                old = self._queue.popleft()
                self._counts["dropped"] += 1
                log.warning(
                    "webhook queue full (%d); dropping the oldest alert (%s)",
                    self.queue_size,
                    old.get("kind"),
                )
            self._queue.append(alert)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (for up to `timeout` seconds), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(max(1.0, self.timeout_s))
        with self._cond:
            if self._queue:
                log.warning("webhook notifier closed with %d alerts undelivered", len(self._queue))
                self._counts["dropped"] += len(self._queue)
                self._queue.clear()

    # ---- worker thread ------------------------------------------------------------------------------------
    def _worker(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if not self._queue or self._abort.is_set():
                        return
                    alert = self._queue.popleft()
                ok = self._deliver(client, alert)
                with self._cond:
                    self._counts["sent" if ok else "failed"] += 1

    def _deliver(self, client: httpx.Client, alert: dict[str, Any]) -> bool:
        payload = slack_payload(alert)
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
            "webhook gave up on %s alert after %d attempt(s): %s", alert.get("kind"), attempt + 1, reason
        )
        return False

    def _delay(self, retry: int, reason: str) -> float:
        delay = self.backoff_s * 2.0**retry
        if "retry-after=" in reason:
            with contextlib.suppress(ValueError):
                delay = max(delay, float(reason.rsplit("=", 1)[1]))
        return min(delay, MAX_BACKOFF_S)
