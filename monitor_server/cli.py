"""The `fp8-monitor` command line: `serve` runs the monitor service, `upload` replays a client's spool.

    fp8-monitor serve [--db URL] [--host 127.0.0.1] [--port 8000] [--tokens-file PATH]
    fp8-monitor upload SPOOL [--url http://127.0.0.1:8000] [--token SECRET]
    fp8-monitor replay-worker [--url http://127.0.0.1:8000] [--once] [--poll-seconds 2]

Flags override ``FP8SCOPE_*`` environment variables. Without tokens the server only listens on loopback.

`upload` and `replay-worker` belong to the client install (``pip install fp8scope``, what a training node
has): they need httpx and the torch-free protocol only, and find the service as the job does (``--url``, else
``FP8SCOPE_URL``; ``--token``, else ``FP8SCOPE_TOKEN`` / ``FP8SCOPE_TOKEN_FILE``). The service stack is
imported by `serve` alone, which without the ``server`` extra says which extra to install.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # the service stack: imported by `serve` only (module docstring)
    from monitor_server.core.config import Settings

#: how a client install gets the service
SERVER_EXTRA = "pip install 'fp8scope[server]'"


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the monitor service (HTTP API, dashboard data, SSE)")
    p.add_argument(
        "--db",
        dest="db_url",
        help="SQLAlchemy URL (default: sqlite:///fp8scope.db in the working directory); a password in it "
        "shows in the process list: prefer $FP8SCOPE_DB_URL or --db-file",
    )
    p.add_argument(
        "--db-file",
        dest="db_url_file",
        metavar="PATH",
        help="private file (chmod 600) whose first line is the SQLAlchemy URL (FP8SCOPE_DB_URL_FILE)",
    )
    p.add_argument("--host", help="listen address (default 127.0.0.1; others need --token)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument(
        "--token",
        dest="tokens",
        action="append",
        metavar="NAME:SCOPES:SECRET",
        help="bearer token, scopes '+'-joined from ingest, read, control; repeatable (the secret shows in "
        "the process list: prefer --tokens-file)",
    )
    p.add_argument(
        "--tokens-file",
        metavar="PATH",
        help="file of NAME:SCOPES:SECRET tokens, one a line, '#' comments (FP8SCOPE_TOKENS_FILE)",
    )
    p.add_argument(
        "--webhook-url",
        help="Slack-compatible webhook that receives one message per incident (a secret: it shows in the "
        "process list; prefer $FP8SCOPE_WEBHOOK_URL or --webhook-url-file)",
    )
    p.add_argument(
        "--webhook-url-file",
        metavar="PATH",
        help="private file (chmod 600) whose first line is the webhook URL (FP8SCOPE_WEBHOOK_URL_FILE)",
    )
    p.add_argument(
        "--public-url",
        help="the dashboard's address as people reach it; webhook messages link to runs under it",
    )
    p.add_argument(
        "--max-body-bytes", type=int, help="largest telemetry body, before and after gzip (default 64 MiB)"
    )
    p.add_argument("--stall-seconds", type=float, help="no telemetry for this long -> 'stalled' alert")
    p.add_argument(
        "--detectors",
        metavar="JSON",
        help="detector thresholds as a JSON object, e.g. '{\"loss_z_threshold\": 5}' (FP8SCOPE_DETECTORS); "
        "an unknown key or a bad value stops the start",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _upload_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "upload",
        help="send a training job's spool file (telemetry it could not deliver) to the service",
        description="Replay a spool written by fp8_trainer.Monitor while the service was unreachable. "
        "Safe to repeat: nothing is stored twice.",
    )
    p.add_argument("spool", help="the spool file (.jsonl) the job named")
    p.add_argument(
        "--url", help="service root (default: $FP8SCOPE_URL, as the training job, else http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--token",
        help="bearer token with the ingest scope (default: $FP8SCOPE_TOKEN, else the first line of the file "
        "$FP8SCOPE_TOKEN_FILE names, as the training job)",
    )


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay-worker",
        help="replay the incidents people ask for on the incident page",
        description="Poll the service for replay requests, run fp8-train replay for each (on a machine that "
        "sees the bundles), and store the report on its incident. Token: $FP8SCOPE_TOKEN or "
        "$FP8SCOPE_TOKEN_FILE, with the control scope.",
    )
    p.add_argument("--url", help="service root (default: $FP8SCOPE_URL, else http://127.0.0.1:8000)")
    p.add_argument("--poll-seconds", type=float, default=2.0, help="wait between polls when idle (default 2)")
    p.add_argument("--timeout-seconds", type=float, default=3600.0, help="longest replay (default 3600)")
    p.add_argument("--once", action="store_true", help="run what is pending now, then exit")


def replay_worker(args: argparse.Namespace) -> int:
    """Run the replay worker; exit code 2 when the service cannot be reached with --once."""
    import os

    import httpx

    from fp8_protocol.env import env_token, service_url
    from monitor_server.infra.replay_worker import ReplayWorker

    try:
        url = service_url(args.url if args.url or os.environ.get("FP8SCOPE_URL") else DEFAULT_URL)
        token = env_token()
    except (OSError, ValueError) as exc:
        print(f"fp8-monitor replay-worker: {printable(str(exc))}", file=sys.stderr)
        return 2
    worker = ReplayWorker(url, token, timeout_s=args.timeout_seconds)
    try:
        ran = worker.serve(args.poll_seconds, args.once)
    except httpx.HTTPError as exc:
        print(f"fp8-monitor replay-worker: {printable(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        worker.close()
    print(f"fp8-monitor replay-worker: {ran} replay request(s) run")
    return 0


def printable(text: str) -> str:
    """`text` with every character a terminal could act on (escape sequences, other control and format
    characters such as bidirectional overrides) written as a Python escape: what `upload` prints comes
    from the spool file and the service, and must not move the cursor, retitle the window or hide text."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def upload(args: argparse.Namespace) -> int:
    """Replay a spool; prints what was stored; exit code 1 if anything was refused, 2 on errors."""
    import os

    import httpx

    from fp8_protocol.env import env_token, service_url
    from fp8_protocol.spool import upload_spool

    try:
        url = service_url(args.url if args.url or os.environ.get("FP8SCOPE_URL") else DEFAULT_URL)
        token = args.token or env_token()
        result = upload_spool(args.spool, url, token)
    except (OSError, ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"fp8-monitor upload: {printable(str(exc))}", file=sys.stderr)
        return 2
    print(
        f"run {result.run_id} ({'created' if result.created else 'existing'}): {result.batches} batches, "
        f"{result.stored_steps} new steps stored, {result.duplicate_batches} already delivered"
        + (f", status {printable(result.status)}" if result.status else "")
    )
    for line in result.rejected:
        print(f"refused: {printable(line)}", file=sys.stderr)
    return 1 if result.rejected else 0


SERVE_FLAGS = (
    "db_url",
    "host",
    "port",
    "tokens",
    "tokens_file",
    "db_url_file",
    "webhook_url",
    "webhook_url_file",
    "public_url",
    "max_body_bytes",
    "stall_seconds",
)


DEFAULT_URL = "http://127.0.0.1:8000"


def build_settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the flags that were given.

    Raises:
        ValueError: a flag or environment variable that does not parse or validate (pydantic's
            ValidationError is a ValueError); `describe_error` makes it one line.
    """
    from monitor_server.core.config import Settings

    overrides = {key: getattr(args, key) for key in SERVE_FLAGS if getattr(args, key, None) is not None}
    if getattr(args, "detectors", None) is not None:
        try:
            overrides["detectors"] = json.loads(args.detectors)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--detectors: not JSON ({exc.msg} at character {exc.pos})") from None
    return Settings(**overrides)


def secrets_on_command_line(args: argparse.Namespace) -> list[str]:
    """Warnings for secrets given as flags, which every user of the machine sees in the process list (the
    secrets themselves are not repeated)."""
    out = []
    if getattr(args, "db_url", None) and urlsplit(args.db_url).password:
        out.append("--db carries a password, visible in the process list: use FP8SCOPE_DB_URL or --db-file")
    if getattr(args, "webhook_url", None):
        out.append(
            "--webhook-url is visible in the process list: use FP8SCOPE_WEBHOOK_URL or --webhook-url-file"
        )
    if getattr(args, "tokens", None):
        out.append("--token secrets are visible in the process list: use --tokens-file or FP8SCOPE_TOKENS")
    return out


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn with the app; returns the exit code."""
    try:
        import uvicorn

        from monitor_server.app import create_app
        from monitor_server.core.config import describe_error, is_loopback
        from monitor_server.infra.http_protocol import bounded_protocol
    except ModuleNotFoundError as exc:  # a client install: the service is the server extra
        print(
            f"fp8-monitor serve: the monitor service needs the server extra ({exc.name} is not installed): "
            f"{SERVER_EXTRA}",
            file=sys.stderr,
        )
        return 2

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = build_settings(args)
    except ValueError as exc:  # ValidationError, or SettingsError (an FP8SCOPE_* JSON that does not parse)
        print(f"fp8-monitor: invalid configuration: {describe_error(exc)}", file=sys.stderr)
        return 2
    for problem in secrets_on_command_line(args):
        logging.getLogger("fp8scope.monitor").warning("%s", problem)
    if not settings.auth_enabled and not is_loopback(settings.host):
        print(
            f"fp8-monitor: refusing to listen on {settings.host} without tokens; "
            "add --tokens-file PATH (or FP8SCOPE_TOKENS_FILE, FP8SCOPE_TOKENS) or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    if not settings.auth_enabled:
        logging.getLogger("fp8scope.monitor").warning(
            "listening on loopback %s only (no tokens)", settings.host
        )
    # worker threads parse and store bodies while the event loop answers everyone else; a shorter GIL
    # switch interval (default 5 ms) lets the loop in sooner, so a big body does not delay a small request
    # by many switch intervals
    sys.setswitchinterval(0.0005)
    app = create_app(settings)
    broker = app.state.ctx.broker

    class Server(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            # Everything alive now (modules, the app, the engine, caches) lives as long as the process:
            # freeze it out of the cyclic garbage collector. Otherwise a burst of new objects (a thousand
            # connections at once) sets off a full collection that walks all of it, on the event loop: a
            # pause of ~100 ms for every request in flight.
            gc.collect()
            gc.freeze()

        def handle_exit(self, sig: int, frame: object) -> None:
            # end SSE streams first: uvicorn waits for open connections before the lifespan shutdown
            broker.close_threadsafe()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        proxy_headers=False,
        # request heads bounded in size and time before they are parsed (see
        # monitor_server.infra.http_protocol)
        http=bounded_protocol(settings.max_header_bytes, settings.header_timeout_seconds),
    )
    Server(config).run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `fp8-monitor` (subcommands: serve, upload, replay-worker)."""
    parser = argparse.ArgumentParser(prog="fp8-monitor", description="fp8scope monitor service")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _upload_parser(sub)
    _worker_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `fp8-monitor`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "upload":
        return upload(args)
    if args.command == "replay-worker":
        return replay_worker(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
