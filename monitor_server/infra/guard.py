"""The request guard: what a request must pass before any route reads its body (pure ASGI).

FastAPI reads and parses a request body before it runs a route's dependencies, so a token checked in a
dependency is checked only after the server has held and parsed whatever the caller sent. This layer runs
first and, in order:

0. refuses a URL holding a NUL character (422): no stored text holds one, and PostgreSQL would refuse it
   as a query parameter with an error, not an answer;
1. without tokens (the open, loopback-only server): refuses a ``Host`` that is not a name of this server
   (DNS rebinding) and an ``Origin`` of another site (cross-site requests), since a browser on the same
   machine can reach the open server;
2. answers 401/403 from the ``Authorization`` header alone, using the scopes the route's own dependency
   declares (``require_scope(...).required_scopes``), for every method: before a body is read, and before
   a route looks up the run it names (so a caller without the scope cannot tell which runs exist);
3. without tokens, requires ``Content-Type: application/json`` on a non-empty body (415): a cross-site form
   or ``text/plain`` post cannot set it without a CORS preflight, which this server never grants;
4. refuses a body over the route's limit (413), by ``Content-Length`` up front or while it streams in, a
   client that stalls between two pieces of its body (408), and one that sends its body slower than
   ``body_min_bytes_per_second`` once ``body_rate_grace_seconds`` have passed (408): each piece in time
   is not enough, so a trickle cannot hold a connection for ever. The rate's clock runs only while the
   route waits for the client's bytes: time the server itself spends before reading (a busy thread pool,
   a batch of the same run being stored) never counts against a client whose body is already there. A
   request refused while its body streams in is answered with ``Connection: close``: the rest of the
   body is never read, and the connection is freed at once instead of waiting for bytes nobody wants.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from fastapi import HTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from monitor_server.core.config import Settings
from monitor_server.core.security import check_scope, principal_for

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
#: route name -> the setting that holds its body limit; every other route gets `max_control_bytes`
BODY_LIMIT_SETTING = {
    "post_telemetry": "max_body_bytes",
    "create_run": "max_registration_bytes",
    "put_incident_replay": "max_replay_bytes",
}


@dataclass(frozen=True)
class RoutePolicy:
    """What a route asks of a request before its body is read."""

    scopes: tuple[str, ...] | None  # None: the route checks no token
    max_body: int
    limit_name: str


def route_scopes(route: Any) -> tuple[str, ...] | None:
    """The scopes a route's dependencies require (the first `require_scope` found), or None."""
    stack = [getattr(route, "dependant", None)]
    while stack:
        dependant = stack.pop()
        if dependant is None:
            continue
        scopes = getattr(dependant.call, "required_scopes", None)
        if scopes is not None:
            return tuple(scopes)
        stack.extend(dependant.dependencies)
    return None


def host_name(value: str) -> str:
    """The host part of a ``Host`` header value (``[::1]:8000`` -> ``::1``), lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


async def send_json(send: Send, status_code: int, detail: str, headers: dict[str, str] | None = None) -> None:
    """A complete `{"detail": ...}` JSON response (the connection closes: its body was never read)."""
    body = orjson.dumps({"detail": detail})
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status_code, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Pure-ASGI middleware applying the checks above.

    Args:
        routes: (full path, route) of every API route that may take a body: a path template such as
            ``/api/v1/runs/{run_id}`` and the FastAPI route, whose name picks the body limit and whose
            dependencies name the scopes.
    """

    def __init__(self, app: ASGIApp, settings: Settings, routes: list[tuple[str, Any]]):
        self.app = app
        self.settings = settings
        self._table = []
        for path, route in routes:
            setting = BODY_LIMIT_SETTING.get(route.name, "max_control_bytes")
            policy = RoutePolicy(route_scopes(route), getattr(settings, setting), setting)
            self._table.append((compile_path(path)[0], frozenset(route.methods or ()), policy))
        names = set(settings.allowed_hosts) | {settings.host.lower()}
        self.allowed_hosts = frozenset(names | LOOPBACK_NAMES)

    def policy(self, scope: Scope) -> RoutePolicy:
        """The policy of the route `scope` would reach (no scopes, the control limit when none matches)."""
        path, method = scope["path"], scope["method"]
        for regex, methods, policy in self._table:
            if method in methods and regex.match(path):
                return policy
        return RoutePolicy(None, self.settings.max_control_bytes, "max_control_bytes")

    def origin_problem(self, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        """Without tokens: (status, reason) for a foreign Host or Origin, else None."""
        host = headers.get(b"host", b"").decode("latin-1")
        if host_name(host) not in self.allowed_hosts:
            return 400, (
                f"Host {host[:100]!r} is not a name of this server; without tokens it answers only to "
                f"{', '.join(sorted(self.allowed_hosts))} (add names with FP8SCOPE_ALLOWED_HOSTS)"
            )
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            name = (urlsplit(text).hostname or "") if text != "null" else ""
            if name not in self.allowed_hosts:
                return 403, f"cross-origin request from {text[:100]!r} refused (no tokens configured)"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        settings = self.settings
        if b"%00" in scope.get("query_string", b"") or "\x00" in scope["path"]:
            # no text column anywhere holds NUL, and PostgreSQL refuses it as a query parameter
            await send_json(send, 422, "the URL must not contain NUL characters (%00)")
            return
        if not settings.auth_enabled:
            problem = self.origin_problem(headers)
            if problem is not None:
                await send_json(send, *problem)
                return
        policy = self.policy(scope)
        if policy.scopes is not None:  # every method: a run is looked up only for a caller who may see it
            scheme, _, secret = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            try:
                check_scope(principal_for(settings, scheme or None, secret.strip() or None), policy.scopes)
            except HTTPException as exc:
                await send_json(send, exc.status_code, str(exc.detail), exc.headers)
                return
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length")
        declared = None
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await send_json(send, 400, "invalid Content-Length header")
                return
        if declared is not None and declared > policy.max_body:
            await send_json(send, 413, self._too_large(policy, declared))
            return
        may_have_body = declared != 0 and (declared is not None or b"transfer-encoding" in headers)
        if may_have_body and not settings.auth_enabled:
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                await send_json(
                    send,
                    415,
                    f"Content-Type {media.decode('latin-1')[:100]!r}: expected application/json "
                    "(required without tokens, so that another site's page cannot post here)",
                )
                return
        refused: list[bool] = []
        timed = self._timed(receive, policy, self._too_large(policy, None), refused)
        await self.app(scope, timed, closing_after_refusal(send, refused))

    @staticmethod
    def _too_large(policy: RoutePolicy, declared: int | None) -> str:
        size = f"request body of {declared} bytes" if declared is not None else "request body"
        return f"{size} exceeds the limit of {policy.max_body} bytes ({policy.limit_name})"

    def _timed(self, receive: Receive, policy: RoutePolicy, too_large: str, refused: list[bool]) -> Receive:
        """`receive` that counts body bytes against the route's limit and times out a stalled or trickling
        body (noting a refusal in `refused`); once the body is complete it passes through untouched (a
        streaming response waits on it for the client's disconnect).

        The minimum rate is judged on the time spent waiting here, for the client: a body of N bytes may
        keep the route waiting grace + N / rate seconds in all. Counted from the request's arrival instead,
        a server busy elsewhere before it reads (every worker thread taken, the run's previous batch being
        stored) would refuse a fast client whose whole body sat in its buffers."""
        timeout = self.settings.body_timeout_seconds
        rate, grace = self.settings.body_min_bytes_per_second, self.settings.body_rate_grace_seconds
        loop = asyncio.get_running_loop()
        received = 0
        waited = 0.0  # seconds spent waiting for the client's bytes
        done = False

        async def guarded() -> Message:
            nonlocal received, waited, done
            if done:
                return await receive()
            # the body is due at the minimum rate: what came so far buys time beyond the grace period
            due = grace + received / rate - waited
            started = loop.time()
            try:
                message = await asyncio.wait_for(receive(), min(timeout, due))
            except TimeoutError:
                refused.append(True)
                if due < timeout:
                    raise HTTPException(
                        408,
                        f"request body slower than {rate:g} bytes/s after {grace:g} s"
                        " (body_min_bytes_per_second)",
                    ) from None
                raise HTTPException(
                    408, f"no request body data for {timeout:g} s (body_timeout_seconds)"
                ) from None
            waited += loop.time() - started
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > policy.max_body:
                    refused.append(True)
                    raise HTTPException(413, too_large)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return guarded


def closing_after_refusal(send: Send, refused: list[bool]) -> Send:
    """`send` that adds ``Connection: close`` to the answer of a request whose body was refused midway
    (408, 413): the rest of its body is never read, so the connection would otherwise stay open, taking
    whatever the client still sends, until the client gives up."""

    async def sending(message: Message) -> None:
        if refused and message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return sending
