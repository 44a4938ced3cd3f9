"""Browser fixtures: Debian's chromium driven by Playwright, a page that leaves a screenshot.

The browser is the one Debian packages at /usr/bin/chromium (``make browser`` installs
it); Playwright never downloads one. Each test's page is saved as a PNG under
``test-artifacts/web/`` when the test ends, passed or failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

CHROMIUM = Path(os.environ.get("TANDEM_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO_ROOT / "test-artifacts" / "web"
DIST = REPO_ROOT / "services" / "agent" / "web" / "dist"

# Never let Playwright fetch a browser of its own.
os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.skip(f"Debian chromium is not installed at {CHROMIUM} (run `make browser`)")
    if not (DIST / "index.html").exists():
        pytest.skip(f"the web build is missing: {DIST}/index.html (run `make web`)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _artifact_name(request: pytest.FixtureRequest) -> str:
    name = request.node.name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:120]


def _csp_safe_wait(pg: Any) -> Any:
    """``page.wait_for_function`` that works under the front end's CSP (no 'unsafe-eval').

    Playwright's own polls by compiling the predicate inside the page, which the policy refuses
    (EvalError); this one checks it from here with ``page.evaluate`` (a DevTools call the CSP does
    not govern), every 50 ms up to the timeout: a bounded poll, not a sleep racing the page."""

    def wait_for_function(
        expression: str, arg: Any = None, *, timeout: float | None = None, **_: Any
    ) -> None:
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        deadline = time.monotonic() + (20_000 if timeout is None else timeout) / 1000
        while True:
            if pg.evaluate(expression, arg):
                return
            if time.monotonic() > deadline:
                raise PlaywrightTimeout(f"wait_for_function: {expression!r} still false after {timeout} ms")
            pg.wait_for_timeout(50)

    return wait_for_function


@pytest.fixture()
def page(browser, request: pytest.FixtureRequest) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """A fresh browser context and page; its screenshot goes to test-artifacts/web/<test>.png."""
    viewport = getattr(request, "param", None) or {"width": 1280, "height": 800}
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(20_000)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.page_errors = errors  # read by tests that assert a clean console
    pg.wait_for_function = _csp_safe_wait(pg)
    try:
        yield pg
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            pg.evaluate("window.scrollTo(0, 0)")  # a sticky header otherwise lands mid-picture
            pg.screenshot(path=str(ARTIFACTS / f"{_artifact_name(request)}.png"), full_page=True)
        except Exception as exc:  # a crashed page still lets the test report its own failure
            print(f"screenshot failed: {exc}")
        context.close()
