"""Who is calling and what they may do: the principal a bearer token names, its scopes, and a run's owner.

Pure functions of the settings and the request's ``Authorization`` header: the request guard calls them
before a body is read, the routes' dependencies (`monitor_server/api/deps.py`) after. With no tokens
configured every caller is "anonymous" with every scope. Secrets are compared with `hmac.compare_digest`
against every configured token.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import HTTPException, status

from monitor_server.core.config import Settings


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name (or "anonymous" when auth is off) and its scopes."""

    name: str
    scopes: frozenset[str]


ANONYMOUS = Principal("anonymous", frozenset({"ingest", "read", "control"}))


def principal_for(settings: Settings, scheme: str | None, secret: str | None) -> Principal:
    """The caller for an ``Authorization: <scheme> <secret>`` header (401 when required and missing or
    unknown). Pure: the request guard calls it before a body is read, the routes' dependencies after."""
    if not settings.auth_enabled:
        return ANONYMOUS
    if scheme is None or scheme.lower() != "bearer" or not secret:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    given = secret.encode()
    match = None
    for token in settings.parsed_tokens:
        # compare against every token so the time taken does not reveal which one matched
        if hmac.compare_digest(given, token.secret.encode()):
            match = token
    if match is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "unknown token", headers={"WWW-Authenticate": "Bearer"}
        )
    return Principal(match.name, match.scopes)


def check_scope(principal: Principal, scopes: tuple[str, ...]) -> Principal:
    """`principal` when it holds any of `scopes`, else 403 naming them."""
    if not principal.scopes.intersection(scopes):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"token {principal.name!r} lacks the scope {' or '.join(scopes)!r}"
        )
    return principal


def check_owner(principal: Principal, owner: str | None, run_id: int) -> None:
    """403 when an `ingest`-only token writes to a run another token registered. `control` acts on any run;
    a run without an owner (registered without tokens, or before owners were kept) takes any writer."""
    if owner is None or "control" in principal.scopes or principal.name == owner:
        return
    detail = (
        f"run {run_id} was registered by another token; {principal.name!r} may write only to its own runs"
    )
    raise HTTPException(status.HTTP_403_FORBIDDEN, detail)
