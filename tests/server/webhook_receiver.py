"""A real local HTTP server standing in for a chat webhook (Slack and the like), for the webhook and incident
tests: it answers each POST with a chosen status and records what it accepted."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Hook(ThreadingHTTPServer):
    """Answers each POST with the next status of `statuses` (then 200), records the bodies it accepted."""

    daemon_threads = True

    def __init__(self, statuses: list[int]) -> None:
        super().__init__(("127.0.0.1", 0), HookHandler)
        self.statuses = list(statuses)
        self.requests = 0
        self.accepted: list[dict] = []
        self.release = threading.Event()  # cleared: hold every request until set
        self.release.set()
        self.first_arrived = threading.Event()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class HookHandler(BaseHTTPRequestHandler):
    server: Hook

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.first_arrived.set()
        self.server.release.wait(10)
        with self.server.lock:
            self.server.requests += 1
            status = self.server.statuses.pop(0) if self.server.statuses else 200
            if status == 200:
                self.server.accepted.append(json.loads(body))
        self.send_response(status)
        if status == 429:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass
