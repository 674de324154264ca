"""The interactive API docs (`/docs`, `/redoc`) with the dashboard's security headers, or none at all.

FastAPI's pages load Swagger UI and ReDoc from a CDN; no copy of them ships with the service. So the pages
load pinned versions of exactly three files, each with Subresource Integrity (the browser refuses a file
whose SHA-384 differs from the one written here, whatever the CDN serves), and are served with a
Content-Security-Policy that admits scripts only from those file URLs plus the pages' own inline script
(pinned by its hash), connects only to this server, and forbids framing; `FP8SCOPE_API_DOCS=false` turns
both pages off for a deployment that loads nothing from a third party (`/openapi.json` stays, for tools
that read the schema).

The hashes are those of the files in the npm packages of the same versions (`npm pack swagger-ui-dist@5.35.0
redoc@2.5.4`, then ``openssl dgst -sha384 -binary FILE | base64``); the CDN serves npm files unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

CDN = "https://cdn.jsdelivr.net"
SWAGGER = f"{CDN}/npm/swagger-ui-dist@5.35.0"
REDOC = f"{CDN}/npm/redoc@2.5.4"
#: file URL -> its Subresource Integrity value
PINNED = {
    f"{SWAGGER}/swagger-ui-bundle.js": "sha384-"
    "gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9",
    f"{SWAGGER}/swagger-ui.css": "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I",
    f"{REDOC}/bundles/redoc.standalone.js": "sha384-"
    "w447zOpYfw/1Tv/5AK9NfHTlQIqE3RVR6KY62jCyy9zNDgO64cMwGGP1Fj0zJVf5",
}
_INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.S)


def _with_integrity(html: bytes) -> bytes:
    """`html` with ``integrity`` and ``crossorigin`` on the tag of each pinned file it loads."""
    for url, digest in PINNED.items():
        for attr in ("src", "href"):
            tag = f'{attr}="{url}"'.encode()
            html = html.replace(tag, tag + f' integrity="{digest}" crossorigin="anonymous"'.encode())
    return html


def _csp(html: bytes) -> str:
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body).digest()).decode()}'"
        for body in _INLINE_SCRIPT.findall(html)
    )
    loaded = [url for url in PINNED if url.encode() in html]  # each page admits only its own files
    scripts = " ".join(url for url in loaded if url.endswith(".js"))
    styles = "".join(f"{url} " for url in loaded if url.endswith(".css"))
    return (
        f"default-src 'none'; script-src {scripts} {hashes}; style-src {styles}'unsafe-inline'; "
        f"img-src 'self' data:; font-src data:; worker-src blob:; connect-src 'self'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
    )


def _page(html: HTMLResponse) -> HTMLResponse:
    body = _with_integrity(bytes(html.body))
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
    swagger = _page(
        get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=title,
            swagger_js_url=f"{SWAGGER}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER}/swagger-ui.css",
            swagger_favicon_url="",
        )
    )
    redoc = _page(
        get_redoc_html(
            openapi_url=app.openapi_url,
            title=title,
            redoc_js_url=f"{REDOC}/bundles/redoc.standalone.js",
            redoc_favicon_url="",
            with_google_fonts=False,
        )
    )

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return swagger

    @app.get("/redoc", include_in_schema=False)
    def redoc_page() -> HTMLResponse:
        return redoc
