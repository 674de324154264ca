"""Fixtures of the browser tests: Debian's Chromium driven by Playwright (sync API) against a real
`fp8-monitor serve` subprocess on SQLite; runs are created through the HTTP API.

No /usr/bin/chromium: the tests skip with a reason, unless FP8SCOPE_REQUIRE_BROWSER=1 (CI), which makes
them fail. Each test leaves a screenshot in tests/web/artifacts/<test name>.png.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerProcess
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT

REQUIRE_BROWSER = os.environ.get("FP8SCOPE_REQUIRE_BROWSER") == "1"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session."""
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing (apt-get install chromium)"
        if REQUIRE_BROWSER:
            pytest.fail(message + " and FP8SCOPE_REQUIRE_BROWSER=1")
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A monitor service without tokens (the loopback default), shared by the tests of the session."""
    tmp = tmp_path_factory.mktemp("web-server")
    srv = ServerProcess(f"sqlite:///{tmp / 'web.db'}", log_path=tmp / "server.log").start()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_text(), srv.log_text()


class PageProbe:
    """What a page did that a test must see: dialogs opened, console errors, page errors."""

    def __init__(self) -> None:
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        #: what the next dialogs answer, in order ("" accepts a confirm); none left: dismissed
        self.answers: list[str] = []


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh browser context and page; dialogs are recorded and dismissed (or answered from
    `page.probe.answers`); a screenshot is saved after
    the test. `page.probe` holds the dialogs and errors seen."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    probe = PageProbe()

    def on_dialog(dialog: Any) -> None:
        probe.dialogs.append(dialog.message)
        if probe.answers:
            dialog.accept(probe.answers.pop(0))
        else:
            dialog.dismiss()

    page.on("dialog", on_dialog)
    page.on("pageerror", lambda exc: probe.errors.append(f"pageerror: {exc}"))
    page.on(
        "console", lambda msg: probe.errors.append(f"console: {msg.text}") if msg.type == "error" else None
    )
    page.probe = probe
    yield page
    ARTIFACTS.mkdir(exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    try:
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    finally:
        context.close()
