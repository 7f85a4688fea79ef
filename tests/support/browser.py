"""Headless Chromium for the console's browser tests: the system's browser, driven by Playwright.

The browser is Debian's `chromium` at /usr/bin/chromium (or $COMMITGATE_CHROMIUM); Playwright's own
browser downloads are never used. Without it the tests skip with the reason, except under CI
(`CI=true`), where they fail: CI must run them (`.ci/run` installs the package).
axe-core comes from the `axe-playwright-python` package, which ships its `axe.min.js`.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest


def chromium_path() -> Path:
    return Path(os.environ.get("COMMITGATE_CHROMIUM", "/usr/bin/chromium"))


# As root, without a display, and without the background traffic a closed network refuses.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CONSOLE_SCRIPT = Path(sys.executable).parent / "commitgate"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_browser() -> None:
    """Skip (fail under CI) when Chromium or Playwright is missing, saying which and how to get it."""
    problem = None
    if not chromium_path().is_file():
        problem = f"no Chromium at {chromium_path()}: apt-get install chromium (or set COMMITGATE_CHROMIUM)"
    else:
        try:
            import playwright.async_api  # noqa: F401
        except ImportError:
            problem = "Playwright is not installed: pip install -e '.[test]'"
    if problem is None:
        return
    if in_ci():
        pytest.fail(f"browser tests must run under CI: {problem}")
    pytest.skip(problem)


def axe_source() -> str:
    import axe_playwright_python

    return (Path(axe_playwright_python.__file__).parent / "axe.min.js").read_text(encoding="utf-8")


@asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    """A headless Chromium (Playwright's async Browser)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=str(chromium_path()), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def serious_violations(page: Any, source: str) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is now. The script is evaluated
    through the driver (not a <script> tag), so the page's CSP stays as strict as in use."""
    await page.evaluate(source)
    results = await page.evaluate("() => axe.run(document, { resultTypes: ['violations'] })")
    assert results["passes"], "axe-core checked nothing on the page"
    return [
        {
            "id": v["id"],
            "impact": v["impact"],
            "help": v["help"],
            "nodes": [n["target"] for n in v["nodes"]][:5],
        }
        for v in results["violations"]
        if v["impact"] in ("serious", "critical")
    ]


async def load_time_ms(page: Any, url: str) -> float:
    """Navigation start to the load event, as the browser measured it."""
    await page.goto(url, wait_until="load")
    return float(
        await page.evaluate(
            "() => { const n = performance.getEntriesByType('navigation')[0]; return n.loadEventEnd - n.startTime; }"
        )
    )


@contextmanager
def console_process(
    ledger: Path, policy: Path | None = None, *, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`commitgate console` on a free loopback port; yields the sign-in link it printed. Its decisions
    are recorded as the reviewer's: on stdio the agent's principal is the OS user, who may not decide."""
    args = [
        str(CONSOLE_SCRIPT),
        "console",
        "--ledger",
        f"sqlite:///{ledger}",
        "--port",
        "0",
        "--as",
        "reviewer",
    ]
    if policy is not None:
        args += ["--policy", str(policy)]
    process = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        yield _printed_link(process)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _printed_link(process: subprocess.Popen[str], within: float = 20.0) -> str:
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not selector.select(timeout=0.2):
            if process.poll() is not None:
                break
            continue
        line = process.stdout.readline()
        found = re.search(r"console at (http://\S+)", line)
        if found:
            return found.group(1)
        if not line and process.poll() is not None:
            break
    err = process.stderr.read() if process.stderr is not None and process.poll() is not None else ""
    raise AssertionError(f"the console did not print its link within {within}s; stderr: {err}")
