"""Serving the dashboard: the files of `web/` at `/` and `/static/`, plotly.js from the `plotly` package.

The dashboard is plain HTML, CSS and ES modules (no build step). In a source checkout the files live in the
top-level `web/` folder; an installed distribution ships them as `monitor_server/web_assets/` (package data,
see `pyproject.toml`). plotly.js is the copy the installed `plotly` Python package carries
(`plotly/package_data/plotly.min.js`), so the dashboard never needs a CDN.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

#: the page may load scripts, styles, fonts and data only from this server; plotly draws heatmaps as
#: data: images and sets inline styles, hence those two allowances
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def web_root() -> Path:
    """The folder holding `index.html`: the installed package data, else the source tree's `web/`."""
    package = Path(__file__).resolve().parents[1]  # monitor_server
    installed = package / "web_assets"
    source = package.parent / "web"
    for candidate in (installed, source):
        if (candidate / "index.html").is_file():
            return candidate
    raise FileNotFoundError(f"dashboard files not found (looked in {installed} and {source})")


def plotly_js() -> Path:
    """plotly.min.js as shipped inside the installed `plotly` package."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'plotly' is not installed; the dashboard serves its plotly.min.js")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed 'plotly' package")
    return path


@functools.lru_cache(maxsize=2)
def _gzipped(path: str, mtime_ns: int) -> bytes:
    """The gzip encoding of a file (cached per path and modification time)."""
    return gzip.compress(Path(path).read_bytes(), compresslevel=6, mtime=0)


class _StaticFiles(StaticFiles):
    """Static files that are revalidated on every load (ETag), so an upgraded server never serves stale JS."""

    async def get_response(self, path, scope):  # type: ignore[no-untyped-def]
        response = await super().get_response(path, scope)
        if response.media_type == "text/html" or path.endswith(".html"):
            for key, value in PAGE_HEADERS.items():  # the page under /static/ too: the same policy as `/`
                response.headers[key] = value
        response.headers.setdefault("Cache-Control", "no-cache")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard at `/` (the page), `/static/...` (its files) and `/static/vendor/plotly.min.js`."""
    root = web_root()
    plotly_path = plotly_js()
    index = root / "index.html"

    @app.get("/", include_in_schema=False)
    def dashboard_page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_file(request: Request) -> Response:
        # the file only changes with the plotly package: browsers may keep it for a day, then revalidate
        stat = plotly_path.stat()
        etag = f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"'
        headers = {
            "Cache-Control": "public, max-age=86400",
            "ETag": etag,
            "Vary": "Accept-Encoding",
            "X-Content-Type-Options": "nosniff",
        }
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        if "gzip" in request.headers.get("accept-encoding", ""):
            # 4.8 MB of JavaScript is 1.4 MB gzipped; compressed once, then sent from memory
            body = _gzipped(str(plotly_path), stat.st_mtime_ns)
            return Response(
                body, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"}
            )
        return FileResponse(plotly_path, media_type="text/javascript", headers=headers)

    app.mount("/static", _StaticFiles(directory=root), name="static")
