"""WebhookNotifier against a real local HTTP server (the `hook` fixture): retries, dead URLs, a full queue."""

from __future__ import annotations

import json
import re
import time

import pytest

from monitor_server.infra.webhook import WebhookNotifier, slack_payload
from tests.support.polling import wait_until
from tests.support.server import free_port

ALERT = {
    "kind": "nonfinite",
    "run_name": "gpt-small-fp8",
    "tensor_name": "blocks.2.fc.grad_output",
    "step": 1200,
    "severity": "critical",
    "message": "tensor blocks.2.fc.grad_output is non-finite at step 1200",
}


@pytest.mark.parametrize("hook", [[500, 500]], indirect=True)
def test_retries_server_errors_then_delivers_once(hook):
    notifier = WebhookNotifier(hook.url, max_retries=5, backoff_s=0.01, timeout_s=2.0)
    notifier.submit(ALERT)
    notifier.close(timeout=5)
    assert notifier.stats == {"sent": 1, "failed": 0, "dropped": 0, "queued": 0, "merged": 0}
    assert hook.requests == 3 and len(hook.accepted) == 1
    body = hook.accepted[0]
    assert set(body) == {"text", "blocks"}
    for value in ("nonfinite", "gpt-small-fp8", "blocks.2.fc.grad_output", "1200", "critical"):
        assert value in body["text"].lower()
        assert value in json.dumps(body["blocks"])
    assert ALERT["message"] in body["text"]
    assert body["blocks"][0]["type"] == "header" and len(body["blocks"][0]["text"]["text"]) <= 150


@pytest.mark.parametrize("hook", [[429, 503]], indirect=True)
def test_rate_limit_is_retried(hook):
    notifier = WebhookNotifier(hook.url, max_retries=3, backoff_s=0.01)
    notifier.submit(ALERT)
    notifier.close(timeout=5)
    assert notifier.stats["sent"] == 1 and hook.requests == 3


@pytest.mark.parametrize("hook", [[400]], indirect=True)
def test_client_errors_are_not_retried(hook):
    notifier = WebhookNotifier(hook.url, max_retries=5, backoff_s=0.01)
    notifier.submit(ALERT)
    notifier.close(timeout=5)
    assert notifier.stats["failed"] == 1 and hook.requests == 1 and hook.accepted == []


@pytest.mark.parametrize("hook", [[500] * 10], indirect=True)
def test_gives_up_after_max_retries(hook, caplog):
    notifier = WebhookNotifier(hook.url, max_retries=2, backoff_s=0.01)
    notifier.submit(ALERT)
    notifier.close(timeout=5)
    assert notifier.stats["failed"] == 1 and hook.requests == 3
    assert sum("gave up" in r.getMessage() for r in caplog.records) == 1


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there any more


def test_dead_url_never_blocks_submit_and_ends_failed():
    notifier = WebhookNotifier(dead_url(), max_retries=3, backoff_s=0.01, timeout_s=1.0)
    started = time.perf_counter()
    for i in range(3):
        notifier.submit({**ALERT, "step": i})
    assert time.perf_counter() - started < 0.05
    assert wait_until(lambda: notifier.stats["failed"] == 3, timeout=5.0)
    notifier.close(timeout=2)
    assert notifier.stats == {"sent": 0, "failed": 3, "dropped": 0, "queued": 0, "merged": 0}


def test_full_queue_drops_the_oldest(hook, caplog):
    hook.release.clear()  # the webhook hangs on the first alert
    notifier = WebhookNotifier(hook.url, max_retries=0, backoff_s=0.01, queue_size=2)
    notifier.submit({**ALERT, "step": 1})
    assert hook.first_arrived.wait(5)  # step 1 is in flight; the queue is empty
    started = time.perf_counter()
    for step in (2, 3, 4, 5):
        notifier.submit({**ALERT, "step": step})
    assert time.perf_counter() - started < 1.0  # a submit waiting on the hanging webhook would never end
    assert notifier.stats["dropped"] == 2 and notifier.stats["queued"] == 2
    assert sum("dropping the oldest" in r.getMessage() for r in caplog.records) == 2
    hook.release.set()
    notifier.close(timeout=5)
    steps = [re.search(r", step (\d+):", body["text"]).group(1) for body in hook.accepted]
    assert steps == ["1", "4", "5"]
    assert notifier.stats == {"sent": 3, "failed": 0, "dropped": 2, "queued": 0, "merged": 0}


def test_close_gives_up_on_a_hanging_webhook_and_counts_the_rest(hook):
    hook.release.clear()
    notifier = WebhookNotifier(hook.url, max_retries=0, timeout_s=1.0)
    for step in range(3):
        notifier.submit({**ALERT, "step": step})
    assert hook.first_arrived.wait(5)
    started = time.perf_counter()
    notifier.close(timeout=0.2)
    assert time.perf_counter() - started < 3.0
    stats = notifier.stats
    assert stats["dropped"] == 2 and stats["queued"] == 0
    notifier.submit(ALERT)  # after close: dropped, not queued
    assert notifier.stats["dropped"] == 3


def test_slack_payload_for_a_run_level_alert():
    alert = {"kind": "stalled", "run": 7, "last_step": 99, "severity": "warning",
             "message": "no telemetry for 300 s", "url": "http://localhost:8000/runs/7"}  # fmt: skip
    body = slack_payload(alert)
    assert "tensor (run-level)" in body["text"] and "step 99" in body["text"]
    assert body["blocks"][-1]["type"] == "context" and "runs/7" in json.dumps(body["blocks"][-1])
    json.dumps(body, allow_nan=False)


INCIDENT = {**ALERT, "incident_id": 7, "url": "https://fp8.example/#/runs/3?incident=7",
            "affected": [f"blocks.{k}.fc.input" for k in range(12)]}  # fmt: skip


def test_incident_message_names_the_root_the_affected_tensors_and_the_link():
    body = slack_payload(INCIDENT)
    assert "incident #7" in body["text"] and "(12 tensors affected)" in body["text"]
    assert INCIDENT["url"] in body["text"]
    blocks = json.dumps(body["blocks"])
    assert "blocks.0.fc.input, blocks.1.fc.input" in blocks and "(12 in all)" in blocks
    assert "Open run" in blocks and "runs/3?incident=7" in blocks


def test_messages_of_one_key_are_rate_limited_into_one_post(hook):
    notifier = WebhookNotifier(hook.url, max_retries=0, min_interval_s=600.0)
    notifier.submit({**ALERT, "step": 1}, key=1)
    assert wait_until(lambda: len(hook.accepted) == 1, timeout=5.0)
    notifier.submit({**ALERT, "step": 2}, key=1)  # within the interval: held
    notifier.submit({**ALERT, "step": 3}, key=1)  # joins the held one
    notifier.submit({**ALERT, "step": 4, "run_name": "other"}, key=2)  # another run: not held
    assert wait_until(lambda: len(hook.accepted) == 2, timeout=5.0)
    assert "step 4" in hook.accepted[1]["text"]
    assert notifier.stats["queued"] == 2 and notifier.stats["merged"] == 1
    notifier.close(timeout=5)  # closing delivers the held message at once
    assert len(hook.accepted) == 3
    last = hook.accepted[2]["text"]
    assert last.startswith("2 incidents in run gpt-small-fp8") and "step 2" in last and "step 3" in last
    assert notifier.stats == {"sent": 3, "failed": 0, "dropped": 0, "queued": 0, "merged": 1}


def test_a_message_is_built_when_it_is_sent(hook):
    notifier = WebhookNotifier(hook.url, max_retries=0, settle_s=600.0)
    incident = dict(INCIDENT)
    notifier.submit(lambda: dict(incident), key=3)
    incident["tensor_name"] = "blocks.0.fc.input"  # the root cause moved while the message settled
    notifier.submit(lambda: None, key=4)  # nothing to say after all: no POST
    assert notifier.stats["queued"] == 2 and hook.requests == 0
    notifier.close(timeout=5)
    assert len(hook.accepted) == 1 and "tensor blocks.0.fc.input" in hook.accepted[0]["text"]


def test_a_message_that_fails_to_build_is_skipped(hook, caplog):
    notifier = WebhookNotifier(hook.url, max_retries=0)

    def broken() -> dict:
        raise RuntimeError("database gone")

    notifier.submit(broken, key=1)
    notifier.submit(ALERT, key=2)
    notifier.close(timeout=5)
    assert len(hook.accepted) == 1 and any("could not build" in r.getMessage() for r in caplog.records)


def test_slack_control_sequences_are_escaped():
    """A run named `<!channel>` and a message with a disguised link: shown as text, no mention, no link;
    only the dashboard link the server builds stays a link."""
    alert = {
        "kind": "loss_spike",
        "severity": "critical",
        "run_name": "<!channel> & co",
        "tensor_name": "blocks.0.<b>",
        "message": "see <https://evil.example|the dashboard>",
        "affected": ["<!here>", "blocks.1.fc.input"],
        "step": 5,
        "url": "https://fp8scope.example.com/#/runs/3",
    }
    body = slack_payload(alert)
    rendered = body["text"] + " ".join(
        str(b.get("text", {}).get("text", "")) + " ".join(f["text"] for f in b.get("fields", []))
        for b in body["blocks"]
        if b["type"] != "header"
    )
    assert "<!channel>" not in rendered and "<!here>" not in rendered and "<https://evil" not in rendered
    assert "&lt;!channel&gt; &amp; co" in body["text"]
    assert "&lt;https://evil.example|the dashboard&gt;" in body["text"]
    assert body["blocks"][-1]["elements"][0]["text"] == "<https://fp8scope.example.com/#/runs/3|Open run>"
    assert body["blocks"][0]["text"]["text"].endswith("in run <!channel> & co")  # plain_text: shown as is
