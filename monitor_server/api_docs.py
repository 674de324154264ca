"""The interactive API docs (`/docs`, `/redoc`) with the dashboard's security headers, or none at all.

FastAPI's pages load Swagger UI and ReDoc from a CDN; no copy of them ships with the service. So the pages
are served with a Content-Security-Policy that admits scripts only from that CDN plus the pages' own inline
script (pinned by its hash), connects only to this server, and forbids framing; `FP8SCOPE_API_DOCS=false`
turns both pages off for a deployment that loads nothing from a third party (`/openapi.json` stays, for
tools that read the schema).
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

CDN = "https://cdn.jsdelivr.net"
_INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.S)


def _csp(html: bytes) -> str:
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body).digest()).decode()}'"
        for body in _INLINE_SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src {CDN} {hashes}; style-src {CDN} 'unsafe-inline'; "
        f"img-src 'self' data: {CDN}; font-src {CDN}; worker-src blob:; connect-src 'self'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
    )


def _page(html: HTMLResponse) -> HTMLResponse:
    body = bytes(html.body)
    headers = {
        "Content-Security-Policy": _csp(body),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return HTMLResponse(body, headers=headers)


def mount_api_docs(app: FastAPI, enabled: bool) -> None:
    """Serve `/docs` and `/redoc` (built once) when `enabled`."""
    if not enabled:
        return
    title = f"{app.title} - API"
    # no favicon from a third party, no web fonts: the pages fall back to the browser's
    swagger = _page(get_swagger_ui_html(openapi_url=app.openapi_url, title=title, swagger_favicon_url=""))
    redoc = _page(
        get_redoc_html(
            openapi_url=app.openapi_url, title=title, redoc_favicon_url="", with_google_fonts=False
        )
    )

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return swagger

    @app.get("/redoc", include_in_schema=False)
    def redoc_page() -> HTMLResponse:
        return redoc
