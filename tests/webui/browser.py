"""A real headless Chromium for the web UI's tests: Debian's `chromium`, driven by Playwright.

Playwright's own browser download is never used: the browser is the system one (found on PATH, or
$TOKENFORGE_TEST_CHROMIUM), handed to Playwright as its executable. Without Playwright or a
Chromium the browser tests skip with the command that installs them (CI has both:
the `test` extra and .ci/services.sh). Every page records its console errors and uncaught
exceptions, so a test can assert that there were none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT_ENV = "TOKENFORGE_UI_SCREENSHOTS"     # set: screenshots go to docs/images/ (committed)
INSTALL = "pip install -e '.[test]' and apt-get install -y chromium"


def run_async(coro, timeout: float = 600):
    """asyncio.run in a thread of its own: while a browser is open, Playwright's sync API keeps an
    event loop running in the test's thread, where asyncio.run refuses to start."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(asyncio.run, coro).result(timeout=timeout)
    finally:
        pool.shutdown(wait=False)           # past the timeout the test fails; it does not wait on


def chromium_path() -> str | None:
    return os.environ.get("TOKENFORGE_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def chromium():
    """A launched headless browser (skips the test when Playwright or Chromium is missing)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"playwright is not installed ({INSTALL})")
    path = chromium_path()
    if path is None:
        pytest.skip(f"no chromium on PATH ({INSTALL})")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, timeout=120_000,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


WAIT_MS = 120_000        # each wait of a page: generous (a loaded 2-core machine decodes slowly), never endless


def open_page(browser, url: str, **context_options):
    """A fresh context and page at `url`, with `page.problems`: console errors and page errors.
    Close it with close_page (the `pages` fixtures do so in a finally block)."""
    context = browser.new_context(**{"viewport": {"width": 1280, "height": 900}, **context_options})
    page = context.new_page()
    page.problems = []
    page.on("console", lambda m: page.problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda err: page.problems.append(f"pageerror: {err}"))
    page.set_default_timeout(WAIT_MS)
    page.set_default_navigation_timeout(WAIT_MS)
    if url:
        page.goto(url)
    return page


def close_page(page) -> None:
    with contextlib.suppress(Exception):        # a crashed page's context may already be gone
        page.context.close()


@contextlib.contextmanager
def pages(browser):
    """open(url, **context) -> a page; every page opened is closed on the way out, failing or not."""
    opened = []

    def open_(url: str, **context_options):
        page = open_page(browser, url, **context_options)
        opened.append(page)
        return page
    try:
        yield open_
    finally:
        for page in opened:
            close_page(page)


def wait_ready(page) -> float:
    """Wait until the page's script has built its view; ms from navigation to that moment."""
    page.wait_for_selector("body[data-ready]", state="attached")
    assert page.get_attribute("body", "data-ready") == "1", page.inner_text("body")
    return float(page.get_attribute("body", "data-ready-ms"))


def screenshot(page, name: str, tmp_path: Path) -> Path:
    """A full-page PNG: into docs/images/ when $TOKENFORGE_UI_SCREENSHOTS is set, else tmp_path."""
    folder = REPO / "docs" / "images" if os.environ.get(SCREENSHOT_ENV) else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    page.screenshot(path=str(path), full_page=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path
