"""Server settings (pydantic-settings): flags and ``FP8SCOPE_*`` environment variables.

Tokens are given as ``name:scope1+scope2:secret`` entries, comma-separated in ``FP8SCOPE_TOKENS`` or one per
``--token`` flag; scopes are ``ingest`` (training jobs), ``read`` (dashboard) and ``control`` (recipe pushes).
"""

from __future__ import annotations

import difflib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from monitor_server.core.detector_config import DetectorConfig

SCOPES: tuple[str, ...] = ("ingest", "read", "control")
DEFAULT_SQLITE_FILE = "fp8scope.db"


@dataclass(frozen=True)
class Token:
    """One bearer token: who it is (`name`), what it may do (`scopes`) and the secret itself."""

    name: str
    scopes: frozenset[str]
    secret: str


def parse_token(spec: str, where: str = "token") -> Token:
    """Parse ``name:scope1+scope2:secret`` (the secret may itself contain ':').

    An error never repeats the secret, nor the text of an entry it cannot split (which may be one): it
    names the entry by `where` and, when there is one, its name.
    """
    parts = spec.strip().split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[2]:
        named = f"{where} {parts[0]!r}" if len(parts) > 1 and parts[0] else where
        raise ValueError(f"{named}: expected 'name:scope1+scope2:secret' (the entry is not repeated here)")
    name, scopes_text, secret = parts
    scopes = frozenset(s.strip() for s in scopes_text.split("+") if s.strip())
    unknown = scopes - set(SCOPES)
    if not scopes or unknown:
        # the text is not repeated: with the fields swapped (name:secret:scopes) it is the secret
        raise ValueError(
            f"{where} {name!r}: scopes must be a '+'-joined subset of {'+'.join(SCOPES)} "
            "(the given scopes are not repeated here: in the middle field of name:scopes:secret)"
        )
    if len(secret) < 8:
        raise ValueError(f"token {name!r}: secret must be at least 8 characters")
    return Token(name=name, scopes=scopes, secret=secret)


class Settings(BaseSettings):
    """Everything the monitor service is configured with.

    Attributes:
        db_url: SQLAlchemy URL; ``sqlite:///path`` (default: ``fp8scope.db`` in the working directory)
            or ``postgresql+psycopg://user@host/db``.
        host, port: where `fp8-monitor serve` listens. Without tokens only loopback is allowed.
        tokens: ``name:scopes:secret`` entries; empty = no authentication.
        tokens_file: a file of such entries, one a line (``#`` comments): the way to give secrets, which
            on a command line would show in the process list. Two tokens may not share a secret. The file
            must not be readable by other users, nor writable by its group (start refused otherwise).
        db_url_file, webhook_url_file: a private file whose first line is the ``db_url`` (with its
            password) or the ``webhook_url`` (a secret itself): on a command line they would show in the
            process list.
        max_body_bytes: the telemetry body limit (``POST /runs/{id}/telemetry``), before and after
            gzip inflation; larger bodies get 413.
        max_registration_bytes: the body limit of ``POST /runs`` (a run and its tensors: ~130 bytes per
            tensor, so 1 MiB holds `max_tensors` with room to spare).
        max_control_bytes: the body limit of every other request (commands, status changes, acks):
            kilobytes are enough.
        max_replay_bytes: the body limit of ``PUT /runs/{id}/incidents/{iid}/replay`` (a replay report:
            about 1 kB per configuration replayed on a small model).
        max_tensors: the most quantized tensors a run may register (each heatmap column holds one value
            per tensor).
        max_config_bytes: the largest run ``config`` (as JSON) a registration may carry (422 above it).
        max_heatmap_cells: the most tensors x columns one heatmap answer may hold (422 above it).
        max_json_elements: the telemetry parse budget: the most JSON values (objects, arrays and
            comma-separated items, counted before parsing) one batch may hold. Packed columns count as one
            value each, so real batches stay far below it.
        max_json_depth: the deepest JSON nesting accepted in free-form objects (run config and recipe,
            event details).
        max_event_detail_bytes: the largest event ``details`` object, as JSON bytes (a flight recorder
            of 64 steps is about 4 KB per tensor).
        decode_concurrency: telemetry bodies inflated and parsed at the same time; others wait their turn.
        max_scalar_names_per_batch: the most distinct scalar names (``loss``, ``lr``, ...) one telemetry
            batch may carry; more get 422.
        max_scalar_names_per_run: the most distinct scalar names a run may have over its life; a batch
            that would take it past them gets 422 (nothing of it stored).
        max_scalar_name_chars: the longest scalar name accepted (422 above it).
        run_lock_wait_seconds: the longest a request waits for a run's lock (another batch of the same
            run being stored, on this instance or, on PostgreSQL, another); then 503 with Retry-After.
        run_batches_in_flight: telemetry requests of one run this instance holds at once (one storing,
            the others reading, parsing or waiting for their turn); one more gets 429 with Retry-After at
            once, before its body is read. A training job sends one batch at a time (a retry or a spool
            upload beside it makes two or three), so only a flood meets it, and the flood then costs the
            other runs and ``/healthz`` next to nothing.
        run_lock_lease_seconds: on PostgreSQL, a run's lock held by an instance that stopped (frozen, not
            gone) is released after this long; storing a batch and running its detectors must take less.
        max_header_bytes: request line plus headers; larger heads get 431 before they are parsed.
        header_timeout_seconds, body_timeout_seconds: a client that takes longer to send its request
            head (or to deliver the next piece of its body) gets 408 and is disconnected.
        body_min_bytes_per_second, body_rate_grace_seconds: a body must arrive at this rate on average,
            counted from the end of the grace period (a body of N bytes may keep the server waiting for
            it grace + N / rate seconds in all; time the server spends before it reads does not count); a
            slower one gets 408 and its connection is closed, however regularly its pieces come. The
            defaults, 1 KiB/s after 2 s: a trickle of 1,000 bytes every 5 s is refused about 3 s in,
            while a real client on a slow link is far above them (a 64 MiB batch at 1 Mbit/s arrives at
            128 KiB/s, and even a 2 s pause at the start for a connection's first round trips is covered).
        allowed_hosts: without tokens, the Host names (and Origin hosts) accepted besides the address
            the server listens on and the loopback names; with tokens, Host is not checked.
        webhook_url: Slack-compatible webhook that receives one message per incident (empty = off).
        webhook_min_interval_seconds: per run, the least time between two webhook messages; incidents
            opened meanwhile share the next message.
        webhook_settle_seconds: how long an incident's message waits before it is sent, so that it names the
            root cause and the tensors the detectors add to the incident in the batches right after.
        webhook_min_severity: incidents below this severity (by default: of info alerts only) send nothing.
        public_url: the dashboard's address as people reach it (e.g. ``https://fp8scope.example.com``);
            webhook messages link to the run's page under it (empty = no link).
        stall_seconds: a running run with no telemetry for this long raises a ``stalled`` alert.
        stall_check_seconds: how often the stall check (and the runs' maintenance below) runs.
        close_after_seconds: a running run with no telemetry for this long is closed as ``crashed``: its
            client is gone (killed without closing its Monitor); telemetry arriving later reopens it.
            None (the default): the stall period, ``stall_seconds``; 0 = never.
        retention_days: runs that ended and were last updated more than this many days ago are deleted
            with their telemetry. 0 = keep every run.
        raw_steps_kept: per run, the statistics of (at least) the last this many steps are kept per step;
            older steps only in the rollups (the heatmap reads them at 8-step resolution and coarser), by
            the periodic maintenance. 0 = keep every step (see ``monitor_server/storage/retention.py``).
        detectors: passed through to the detector engine's ``DetectorConfig`` (thresholds); checked when the
            settings are built, so an unknown key or a bad value stops the service at start-up.
        sse_keepalive_seconds: interval of keep-alive comments on ``/stream``.
        cache_runs: runs whose metadata and detector engine stay in memory (the most recently used; a
            finished run leaves at once); others are reloaded from the database when used.
        api_docs: serve the interactive API docs at ``/docs`` and ``/redoc`` (their scripts come from a CDN:
            pinned files checked by Subresource Integrity, admitted by a strict Content-Security-Policy);
            false turns them off.
        export_concurrency: exports (``GET /runs/{id}/export``) this instance streams at the same time;
            more get 429 with Retry-After (each holds a chunk of the table in memory while it streams).
        sse_queue_bytes: events held for one stream client that does not read; beyond, it is dropped with
            a final ``dropped`` event (as it is when it falls 1000 events behind).
        sse_total_bytes: events held for all stream clients together (each counting what it holds; an
            event's bytes are shared); beyond, a client that holds some is dropped the same way.
        sse_streams_per_token: the most event streams one token (without tokens: everyone) holds open;
            more get 429.
    """

    model_config = SettingsConfigDict(env_prefix="FP8SCOPE_", extra="ignore")

    db_url: str = f"sqlite:///{DEFAULT_SQLITE_FILE}"
    host: str = "127.0.0.1"
    port: int = 8000
    tokens: Annotated[list[str], NoDecode] = []
    tokens_file: str = ""
    db_url_file: str = ""
    webhook_url_file: str = ""
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    max_registration_bytes: int = Field(1024 * 1024, ge=1024)
    max_control_bytes: int = Field(64 * 1024, ge=1024)
    max_replay_bytes: int = Field(1024 * 1024, ge=1024)
    max_tensors: int = Field(4096, ge=1)
    max_config_bytes: int = Field(64 * 1024, ge=1024)
    max_heatmap_cells: int = Field(4096 * 1024, ge=1024)
    max_json_elements: int = Field(1_000_000, ge=1000)
    max_json_depth: int = Field(32, ge=2, le=200)
    max_event_detail_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    decode_concurrency: int = Field(2, ge=1)
    max_scalar_names_per_batch: int = Field(1024, ge=1)
    max_scalar_names_per_run: int = Field(4096, ge=1)
    max_scalar_name_chars: int = Field(200, ge=1)
    run_lock_wait_seconds: float = Field(5.0, gt=0)
    run_batches_in_flight: int = Field(4, ge=1)
    run_lock_lease_seconds: float = Field(30.0, gt=0)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    header_timeout_seconds: float = Field(10.0, gt=0)
    body_timeout_seconds: float = Field(30.0, gt=0)
    body_min_bytes_per_second: float = Field(1024.0, gt=0)
    body_rate_grace_seconds: float = Field(2.0, gt=0)
    allowed_hosts: Annotated[list[str], NoDecode] = []
    webhook_url: str = ""
    webhook_min_interval_seconds: float = Field(60.0, ge=0)
    webhook_settle_seconds: float = Field(2.0, ge=0)
    webhook_min_severity: Literal["info", "warning", "critical"] = "warning"
    public_url: str = ""
    stall_seconds: float = 300.0
    stall_check_seconds: float = 15.0
    close_after_seconds: float | None = Field(None, ge=0)
    retention_days: float = Field(0.0, ge=0)
    raw_steps_kept: int = Field(0, ge=0)
    detectors: dict[str, Any] = {}
    sse_keepalive_seconds: float = 15.0
    sse_queue_bytes: int = Field(8 * 1024 * 1024, ge=4096)
    sse_total_bytes: int = Field(256 * 1024 * 1024, ge=4096)
    sse_streams_per_token: int = Field(100, ge=1)
    cache_runs: int = Field(256, ge=1)
    export_concurrency: int = Field(2, ge=1)
    api_docs: bool = True

    @field_validator("tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [t for t in value.split(",") if t.strip()]
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [h.strip().lower() for h in value.split(",") if h.strip()]
        return value

    @model_validator(mode="after")
    def _read_secret_files(self) -> Settings:
        # URLs with passwords from private files, so they never show in the process list
        if self.db_url_file:
            self.db_url = read_secret_file(self.db_url_file, "db_url_file")
            self.db_url_file = ""
        if self.webhook_url_file:
            self.webhook_url = read_secret_file(self.webhook_url_file, "webhook_url_file")
            self.webhook_url_file = ""
        return self

    @model_validator(mode="after")
    def _check_tokens(self) -> Settings:
        specs = [(t, f"token #{i + 1}") for i, t in enumerate(self.tokens)]
        if self.tokens_file:
            specs += read_tokens_file(self.tokens_file)
        tokens = [parse_token(spec, where) for spec, where in specs]
        names = [t.name for t in tokens]
        if len(set(names)) != len(names):
            raise ValueError("token names must be unique")
        seen: dict[str, str] = {}
        for t in tokens:
            if t.secret in seen:  # one secret, two names: the server could not tell who is calling
                pair = f"tokens {seen[t.secret]!r} and {t.name!r}"
                raise ValueError(f"{pair} share one secret; give each its own")
            seen[t.secret] = t.name
        self.tokens = [spec for spec, _ in specs]
        self.tokens_file = ""  # read once: its entries are in `tokens` now
        return self

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value:
            url = urlparse(value)
            if url.scheme not in ("http", "https") or not url.netloc or url.query or url.fragment:
                raise ValueError(f"expected http(s)://host[:port][/path], got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_detectors(self) -> Settings:
        detector_config(self.detectors, self.stall_seconds)  # raises ValueError naming the key
        return self

    @property
    def detector_config(self) -> DetectorConfig:
        """The detector engine's thresholds: `detectors` over the `stall_seconds` setting."""
        return detector_config(self.detectors, self.stall_seconds)

    @property
    def parsed_tokens(self) -> list[Token]:
        """The configured tokens, parsed."""
        return [parse_token(t) for t in self.tokens]

    @property
    def auth_enabled(self) -> bool:
        """True when at least one token is configured."""
        return bool(self.tokens)


def check_private(path: str, setting: str) -> None:
    """ValueError when a file of secrets can be read or written by every user of the machine, or written
    by its group (as PostgreSQL refuses such a key file): ``chmod 600`` (or 640 for a service group)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if os.name == "posix" and mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise ValueError(
            f"{setting}: {path} holds secrets but has mode {stat.S_IMODE(mode):04o} (other users may read or "
            f"change it); run chmod 600 {path} (or 640 to share it with a group)"
        )


def read_secret_file(path: str, setting: str) -> str:
    """The first line of a private file holding one secret (a URL with a password, a webhook URL)."""
    check_private(path, setting)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    first = text.splitlines()[0].strip() if text.strip() else ""
    if not first:
        raise ValueError(f"{setting}: {path} is empty")
    return first


def read_tokens_file(path: str) -> list[tuple[str, str]]:
    """The entries of a tokens file: one ``name:scopes:secret`` per line, blank lines and ``#`` comments
    skipped; each with where it came from (``FILE line N``) for error messages. The file must be private
    (`check_private`)."""
    check_private(path, "tokens_file")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"tokens_file: cannot read {path}: {exc.strerror}") from None
    return [
        (line.strip(), f"{path} line {i}")
        for i, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]


def detector_config(detectors: dict[str, Any], stall_seconds: float) -> DetectorConfig:
    """`DetectorConfig` from the ``detectors`` setting; ValueError with one line per problem, each naming
    its key (``detectors.<key>: ...``), for unknown keys (with the nearest known one) and bad values."""
    try:
        return DetectorConfig(**{"stall_seconds": stall_seconds, **detectors})
    except ValidationError as exc:
        known = sorted(DetectorConfig.model_fields)
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            if err["type"] == "extra_forbidden":
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"known keys: {', '.join(known)}"
                problems.append(f"detectors.{key}: unknown detector setting; {hint}")
            elif key:
                problems.append(f"detectors.{key}: {err['msg']} (got {err.get('input')!r})")
            else:  # a rule between several keys; its message names them
                problems.append(f"detectors: {err['msg'].removeprefix('Value error, ')}")
        raise ValueError("; ".join(problems)) from None


def describe_error(exc: Exception) -> str:
    """One line for a configuration error (a pydantic ValidationError lists every field it refused)."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(part) for part in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(msg if msg.startswith(loc) or not loc else f"{loc}: {msg}")
        return "; ".join(parts)
    return " ".join(str(exc).split())


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (the only kind allowed without tokens)."""
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
