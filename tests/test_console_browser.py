"""The console in a real browser: headless Chromium driven by Playwright, against real processes.

A real `commitgate serve` process (stdio, a real MCP client) records an `UNKNOWN` outcome when the
demo sandbox loses an email's acknowledgement (the email is sent; the answer is lost); a real
`commitgate console` process serves the page over the same ledger file. Effects are counted in
the sandbox. Also: a script in an argument stays inert, every page passes axe-core without
serious or critical violations, and page load times with 10,000 operations in the ledger.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from support.browser import (
    axe_source,
    chromium,
    console_process,
    load_time_ms,
    require_browser,
    serious_violations,
)
from support.console import seed
from support.e2e import Deployment, Server, error, error_code, operation, serve

pytestmark = [pytest.mark.browser, pytest.mark.anyio]

EMAIL = {"to": "ann@example.com", "subject": "Your receipt", "body": "Thanks"}
LOAD_BUDGET_MS = 3000.0  # far above what a healthy page takes here (see the README's figures)


@pytest.fixture(autouse=True)
def _browser() -> None:
    require_browser()


async def lost_email(server: Server, key: str, session: str = "s1", **changes: str) -> str:
    """Send an email whose acknowledgement the sandbox loses: UNKNOWN; its operation id."""
    result = await server.call("send_email", {**EMAIL, **changes, "idempotency_key": key}, session=session)
    assert error_code(result) == "operation_outcome_unknown", result.content
    return str(error(result)["operation"]["operation_id"])


async def test_a_reviewer_resolves_an_unknown_outcome_and_the_retry_replays_it(tmp_path: Path) -> None:
    deployment = Deployment.create(tmp_path)
    async with serve(deployment, faults="send_email.lose_ack=2x") as server:
        first = await lost_email(server, "receipt-1")
        assert deployment.count("emails", idempotency_key="receipt-1") == 1
        with console_process(deployment.ledger) as link:
            async with chromium() as browser:
                page = await browser.new_page()
                dialogs: list[str] = []
                page.on("dialog", lambda dialog: dialogs.append(dialog.message))
                await page.goto(link)
                assert page.url.endswith("/unknown") and "token=" not in page.url
                assert await page.locator(f"[id='op-{first}']").is_visible()

                # A new entry shows without a reload (the page polls its list).
                await page.evaluate("() => { window.stayedOnPage = true; }")
                later = await lost_email(server, "receipt-2", subject="Your second receipt")
                await page.locator(f"[id='op-{later}']").wait_for(timeout=15_000)
                assert await page.evaluate("() => window.stayedOnPage") is True
                assert "2 operations to decide." in await page.locator(".count").inner_text()

                # The reviewer: open the entry (click 1), say what was found, record it (click 2).
                clicks = 0
                await page.locator(f"[id='op-{first}'] h2 a").click()
                clicks += 1
                await page.fill("#r-reason", "the message is in the outbox")
                await page.fill("#r-result", json.dumps({"message_id": "msg_from_outbox"}))
                await page.locator("button[value='succeeded']").click()
                clicks += 1
                await page.wait_for_url(f"**/unknown?resolved={first}")
                assert "is now SUCCEEDED" in await page.locator(".notice").inner_text()
                assert await page.locator(f"[id='op-{first}']").count() == 0
                assert dialogs == []
                print(f"\nclicks to resolve an unknown outcome from the list: {clicks}")

        retry = await server.call("send_email", {**EMAIL, "idempotency_key": "receipt-1"}, session="s1")
        assert not retry.is_error, retry.content
        assert retry.structured_content == {"message_id": "msg_from_outbox"}
        assert operation(retry)["replayed"] is True and operation(retry)["state"] == "SUCCEEDED"
    assert deployment.count("emails", idempotency_key="receipt-1") == 1  # exactly one email, ever


async def test_a_script_in_an_argument_stays_inert_and_shows_as_text(tmp_path: Path) -> None:
    deployment = Deployment.create(tmp_path)
    session = "<script>alert('session')</script>"
    body = "<img src=x onerror=\"alert('body')\"><script>alert('body')</script>"
    async with serve(deployment, faults="send_email.lose_ack=1x") as server:
        op_id = await lost_email(server, "hostile-1", session=session, body=body)
    with console_process(deployment.ledger) as link:
        async with chromium() as browser:
            page = await browser.new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: dialogs.append(dialog.message))
            await page.goto(link)
            card = await page.locator(f"[id='op-{op_id}']").inner_text()
            assert session in card and "<img src=x" in card  # shown as the text it is
            await page.locator(f"[id='op-{op_id}'] h2 a").click()
            assert body.replace('"', '\\"') in await page.locator("pre.json").first.inner_text()
            await page.goto(link.split("/?")[0] + "/operations")
            await page.fill("#f-session", session)
            await page.locator("form.search button[type='submit']").click()
            await page.wait_for_load_state("load")
            assert await page.locator("table.ops tbody tr").count() == 1
            assert await page.input_value("#f-session") == session
            await page.wait_for_timeout(500)  # time for anything that would fire
            assert dialogs == []
            assert await page.locator("img[src='x']").count() == 0


async def pages_of(link: str, op_unknown: str, op_done: str) -> list[tuple[str, str]]:
    base = link.split("/?")[0]
    return [
        ("unknown outcomes", f"{base}/unknown"),
        ("operations", f"{base}/operations"),
        ("operations, searched", f"{base}/operations?state=UNKNOWN&tool=send_email"),
        ("an unknown operation with its form", f"{base}/operations/{op_unknown}"),
        ("a resolved operation", f"{base}/operations/{op_done}"),
        ("a refusal", f"{base}/operations/op_nope"),
    ]


async def test_every_page_passes_axe_without_serious_or_critical_violations(tmp_path: Path) -> None:
    deployment = Deployment.create(tmp_path)
    async with serve(deployment, faults="send_email.lose_ack=1x") as server:
        unknown = await lost_email(server, "a11y-1")
        done = await server.call("send_email", {**EMAIL, "subject": "ok", "idempotency_key": "a11y-2"})
        assert not done.is_error
    source = axe_source()
    found: dict[str, Any] = {}
    with console_process(deployment.ledger) as link:
        async with chromium() as browser:
            for width, height in ((1280, 900), (390, 844)):  # a desktop and a phone
                page = await browser.new_page(viewport={"width": width, "height": height})
                await page.goto(link)
                for name, url in await pages_of(link, unknown, operation(done)["operation_id"]):
                    await page.goto(url)
                    violations = await serious_violations(page, source)
                    if violations:
                        found[f"{name} at {width}px"] = violations
                await page.close()
            signed_out = await browser.new_page()
            await signed_out.goto(link.split("/?")[0] + "/unknown")  # the sign-in refusal
            if violations := await serious_violations(signed_out, source):
                found["signed out"] = violations
    assert found == {}


async def test_page_load_times_with_ten_thousand_operations(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.db"
    await seed(ledger, 10_000, unknown_every=5)  # 2,000 of them UNKNOWN
    figures: dict[str, float] = {}
    with console_process(ledger) as link:
        base = link.split("/?")[0]
        async with chromium() as browser:
            page = await browser.new_page()
            await page.goto(link)
            for name, path in (("operations", "/operations"), ("unknown outcomes", "/unknown")):
                times = [await load_time_ms(page, base + path) for _ in range(5)]
                figures[name] = statistics.median(times)
    print("\npage load, navigation start to load event, median of 5, 10,000 operations in the ledger:")
    for name, ms in figures.items():
        print(f"  {name}: {ms:.0f} ms")
    assert all(ms < LOAD_BUDGET_MS for ms in figures.values()), figures
