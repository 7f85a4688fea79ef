"""The console in a real browser: headless Chromium driven by Playwright, against real processes.

A real `commitgate serve` process (stdio, a real MCP client) records an `UNKNOWN` outcome when the
demo sandbox loses an email's acknowledgement (the email is sent; the answer is lost); a real
`commitgate console` process serves the page over the same ledger file. Effects are counted in
the sandbox. Calls to a tool whose approval `when` holds wait for a reviewer, who approves or
denies them on the console while the agent's server runs. Also: a script in an argument stays
inert, every page passes axe-core without serious or critical violations, and page load times
with 10,000 operations in the ledger.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import AsyncIterator
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
from support.console import BUDGETS, seed, seed_budgets, spend_in_every_budget, write_policy
from support.e2e import Deployment, Server, error, error_code, operation, policy_toml, serve

from commitgate.server.console.pages import approvals, unknown
from commitgate.server.serve.gateway import local_principal

pytestmark = [pytest.mark.browser, pytest.mark.anyio]

EMAIL = {"to": "ann@example.com", "subject": "Your receipt", "body": "Thanks"}
OUTSIDE = {"to": "bob@elsewhere.org", "subject": "Quarterly numbers", "body": "attached"}
# Mail to an outside address waits for a person: the client below cannot be asked, so an operator is.
APPROVAL_TOML = """
[tools.mail_out]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
timeout = "10s"
duplicates = false
approval = { when = "!arguments.to.endsWith('@example.com')", prompt = "Send '{arguments.subject}' to {arguments.to}?" }
"""
# Each call is answered with its own outcome, however long a loaded machine takes to record it
# (past respond_within or in_progress_wait the answer would be operation_in_progress instead).
WAIT = "20s"
LOAD_BUDGET_MS = 3000.0  # far above what a healthy page takes here (see docs/results.md)
# Words of table headers and state badges that the layout broke across lines ("Princi pal").
BROKEN_WORDS = """() => {
  const broken = [];
  for (const element of document.querySelectorAll('th, .state')) {
    const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const word of node.data.matchAll(/\\S+/g)) {
        const range = document.createRange();
        range.setStart(node, word.index);
        range.setEnd(node, word.index + word[0].length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) broken.push(word[0]);
      }
    }
  }
  return broken;
}"""
BIDI = "\u202etxt.exe\u202c"  # reads "exe.txt" when shown raw


@pytest.fixture(scope="module")
async def launched(anyio_backend: str) -> AsyncIterator[Any]:
    """One Chromium for the module: launching it costs seconds, a context costs milliseconds."""
    require_browser()
    async with chromium() as browser:
        yield browser


@pytest.fixture
async def browser(launched: Any) -> AsyncIterator[Any]:
    """The module's Chromium. Each `new_page()` opens in a context of its own (no cookies, no storage
    from another page or test); the test's contexts are closed when it ends."""
    yield launched
    for context in launched.contexts:
        await context.close()


async def lost_email(server: Server, key: str, session: str = "s1", **changes: str) -> str:
    """Send an email whose acknowledgement the sandbox loses: UNKNOWN; its operation id."""
    result = await server.call("send_email", {**EMAIL, **changes, "idempotency_key": key}, session=session)
    assert error_code(result) == "operation_outcome_unknown", result.content
    return str(error(result)["operation"]["operation_id"])


def with_approvals(root: Path) -> Deployment:
    deployment = Deployment.create(root, respond_within=WAIT, in_progress_wait=WAIT)
    deployment.policy.write_text(
        policy_toml(respond_within=WAIT, in_progress_wait=WAIT) + APPROVAL_TOML, encoding="utf-8"
    )
    return deployment


async def waiting_mail(server: Server, key: str, **changes: str) -> str:
    """Mail to an outside address: AWAITING_APPROVAL, nothing sent; its operation id."""
    result = await server.call("mail_out", {**OUTSIDE, **changes, "idempotency_key": key})
    assert error_code(result) == "approval_pending", result.content
    return str(error(result)["operation"]["operation_id"])


async def test_a_reviewer_resolves_an_unknown_outcome_and_the_retry_replays_it(
    tmp_path: Path, browser: Any
) -> None:
    """Also what the reviewer reads on the way: invisible and bidirectional characters escaped, UTC
    dates, people and principals as who acted, buttons that say what a retry does, what an empty
    result replays (and the retry gets exactly that), and headers and badges never broken inside a
    word; screenshots at 1280 and 390 px go to the test's folder."""
    deployment = with_approvals(tmp_path)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    body = f"attached: {BIDI}\u200b"
    async with serve(deployment, faults="send_email.lose_ack=2x") as server:
        first = await lost_email(server, "receipt-1")
        await waiting_mail(server, "waits-1")  # an AWAITING_APPROVAL badge in the list
        assert deployment.count("emails", idempotency_key="receipt-1") == 1
        with console_process(deployment.ledger) as link:
            base = link.split("/?")[0]
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: dialogs.append(dialog.message))
            await page.clock.install()  # the page's own timers, moved on below instead of waited for
            await page.goto(link)
            assert page.url.endswith("/approvals") and "token=" not in page.url  # the first page
            await page.locator("nav a[href='/unknown']").click()
            assert await page.locator(f"[id='op-{first}']").is_visible()

            # A new entry shows without a reload (the page polls its list).
            await page.evaluate("() => { window.stayedOnPage = true; }")
            later = await lost_email(server, "receipt-2", subject="Your second receipt", body=body)
            await page.clock.run_for(unknown.POLL_SECONDS * 1000)  # one poll interval
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

            # The second, resolved with no result: the page says what a retry receives then.
            await page.goto(f"{base}/operations/{later}")
            main = await page.locator("main").inner_text()
            assert "\u202e" not in main and "\u200b" not in main
            assert "attached: \\u202etxt.exe\\u202c\\u200b" in main  # as `ops show` prints it
            buttons = [text.strip() for text in await page.locator(".choices button").all_inner_texts()]
            assert buttons == [
                "It took effect: a retry gets this result",
                "It did not take effect: a retry is refused, nothing runs",
                "It did not happen: a retry runs it again",
            ]
            promised = json.loads(await page.locator("#result-empty code").inner_text())
            await page.screenshot(path=str(shots / "unknown-1280.png"), full_page=True)
            await page.fill("#r-reason", "it is in the outbox too")
            await page.locator("button[value='succeeded']").click()
            await page.wait_for_url(f"**/unknown?resolved={later}")

            await page.goto(f"{base}/operations/{later}")
            note = await page.locator("h2:text-is('Reconciliation') + pre").inner_text()
            assert re.search(r'"at": "\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"', note), note
            by = set(await page.locator("td[data-label='By']").all_inner_texts())
            # people and principals only, each said as what they are
            assert by == {f"{local_principal()} (principal)", "reviewer (operator)"}, by
            for path in ("/operations", f"/operations/{later}", "/approvals"):
                await page.goto(base + path)
                assert await page.evaluate(BROKEN_WORDS) == [], path
                name = path.strip("/").replace("/", "-")
                await page.screenshot(path=str(shots / f"{name}-1280.png"), full_page=True)
                await page.set_viewport_size({"width": 390, "height": 844})
                await page.screenshot(path=str(shots / f"{name}-390.png"), full_page=True)
                await page.set_viewport_size({"width": 1280, "height": 900})

        retry = await server.call("send_email", {**EMAIL, "idempotency_key": "receipt-1"}, session="s1")
        assert not retry.is_error, retry.content
        assert retry.structured_content == {"message_id": "msg_from_outbox"}
        assert operation(retry)["replayed"] is True and operation(retry)["state"] == "SUCCEEDED"
        again = await server.call(
            "send_email",
            {**EMAIL, "subject": "Your second receipt", "body": body, "idempotency_key": "receipt-2"},
            session="s1",
        )
        assert again.structured_content == {**promised, "reason": "it is in the outbox too"}  # as said
    assert deployment.count("emails", idempotency_key="receipt-1") == 1  # exactly one email, ever
    assert deployment.count("emails", idempotency_key="receipt-2") == 1


async def test_a_script_in_an_argument_stays_inert_and_shows_as_text(tmp_path: Path, browser: Any) -> None:
    deployment = Deployment.create(tmp_path, respond_within=WAIT, in_progress_wait=WAIT)
    session = "<script>alert('session')</script>"
    body = "<img src=x onerror=\"alert('body')\"><script>alert('body')</script>"
    async with serve(deployment, faults="send_email.lose_ack=1x") as server:
        op_id = await lost_email(server, "hostile-1", session=session, body=body)
    with console_process(deployment.ledger) as link:
        page = await browser.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda dialog: dialogs.append(dialog.message))
        await page.goto(link)  # signs in
        await page.goto(link.split("/?")[0] + "/unknown")
        card = await page.locator(f"[id='op-{op_id}']").inner_text()
        assert session in card and "<img src=x" in card  # shown as the text it is
        await page.locator(f"[id='op-{op_id}'] h2 a").click()
        assert body.replace('"', '\\"') in await page.locator("pre.json").first.inner_text()
        await page.goto(link.split("/?")[0] + "/operations")
        await page.fill("#f-session", session)
        await page.locator("form.search button[type='submit']").click()
        # The results page, loaded: its inline scripts ran and its images failed by now. A dialog
        # would also hold the page (the listener leaves it open), so the load would never come.
        await page.wait_for_url(re.compile(r"/operations\?.*session="))
        assert await page.locator("table.ops tbody tr").count() == 1
        assert await page.input_value("#f-session") == session
        assert dialogs == []
        assert await page.locator("img[src='x']").count() == 0


async def pages_of(link: str, op_unknown: str, op_done: str, op_waiting: str) -> list[tuple[str, str]]:
    base = link.split("/?")[0]
    return [
        ("waiting for approval", f"{base}/approvals"),
        ("a waiting operation with its form", f"{base}/operations/{op_waiting}"),
        ("unknown outcomes", f"{base}/unknown"),
        ("operations", f"{base}/operations"),
        ("operations, searched", f"{base}/operations?state=UNKNOWN&tool=send_email"),
        ("an unknown operation with its form", f"{base}/operations/{op_unknown}"),
        ("a resolved operation", f"{base}/operations/{op_done}"),
        ("a refusal", f"{base}/operations/op_nope"),
    ]


async def test_every_page_passes_axe_without_serious_or_critical_violations(
    tmp_path: Path, browser: Any
) -> None:
    deployment = with_approvals(tmp_path)
    async with serve(deployment, faults="send_email.lose_ack=1x") as server:
        unknown = await lost_email(server, "a11y-1")
        done = await server.call("send_email", {**EMAIL, "subject": "ok", "idempotency_key": "a11y-2"})
        assert not done.is_error
        waiting = await waiting_mail(server, "a11y-3")
    source = axe_source()
    found: dict[str, Any] = {}
    with console_process(deployment.ledger, deployment.policy) as link:
        for width, height in ((1280, 900), (390, 844)):  # a desktop and a phone
            page = await browser.new_page(viewport={"width": width, "height": height})
            await page.goto(link)
            for name, url in await pages_of(link, unknown, operation(done)["operation_id"], waiting):
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


async def test_page_load_times_with_ten_thousand_operations(tmp_path: Path, browser: Any) -> None:
    ledger = tmp_path / "ledger.db"
    await seed(ledger, 10_000, unknown_every=5, awaiting_every=25)  # 2,000 UNKNOWN, 400 waiting for approval
    figures: dict[str, float] = {}
    with console_process(ledger) as link:
        base = link.split("/?")[0]
        page = await browser.new_page()
        await page.goto(link)
        pages = (
            ("operations", "/operations"),
            ("unknown outcomes", "/unknown"),
            ("waiting for approval", "/approvals"),
        )
        for name, path in pages:
            times = [await load_time_ms(page, base + path) for _ in range(5)]
            figures[name] = statistics.median(times)
    print("\npage load, navigation start to load event, median of 5, 10,000 operations in the ledger:")
    for name, ms in figures.items():
        print(f"  {name}: {ms:.0f} ms")
    assert all(ms < LOAD_BUDGET_MS for ms in figures.values()), figures


async def test_the_budgets_page_draws_its_charts_and_passes_axe_on_a_desktop_and_a_phone(
    tmp_path: Path, browser: Any
) -> None:
    import time

    policy = write_policy(tmp_path, BUDGETS)
    await spend_in_every_budget(tmp_path / "ledger.db", time.time())
    source = axe_source()
    found: dict[str, Any] = {}
    with console_process(tmp_path / "ledger.db", policy) as link:
        for width, height in ((1280, 900), (390, 844)):  # a desktop and a phone
            page = await browser.new_page(viewport={"width": width, "height": height})
            await page.goto(link)
            await page.locator("nav a[href='/budgets']").click()
            await page.wait_for_url("**/budgets")
            charts = page.locator("svg.chart")
            assert await charts.count() == 6  # 2 + 3 + 1 scopes, one chart each
            box = await charts.first.bounding_box()
            assert box is not None and 0 < box["width"] <= width and box["height"] > 20
            bar = await page.locator("svg.chart rect.bar").first.bounding_box()
            assert bar is not None and bar["height"] > 0  # drawn, though styled only from the stylesheet
            if violations := await serious_violations(page, source):
                found[f"budgets at {width}px"] = violations
            await page.close()
    assert found == {}


async def test_budgets_page_load_time_with_ten_thousand_budgeted_operations(
    tmp_path: Path, browser: Any
) -> None:
    policy = write_policy(tmp_path, BUDGETS)
    await seed_budgets(tmp_path / "ledger.db", 10_000)
    with console_process(tmp_path / "ledger.db", policy) as link:
        page = await browser.new_page()
        await page.goto(link)
        times = [await load_time_ms(page, link.split("/?")[0] + "/budgets") for _ in range(5)]
        assert await page.locator("svg.chart").count() == 20 + 8 + 1  # sessions bounded; principals; all
    ms = statistics.median(times)
    print(f"\nbudgets page load, median of 5, 10,000 budgeted operations in 3 budgets: {ms:.0f} ms")
    assert ms < LOAD_BUDGET_MS, times


async def test_a_reviewer_approves_from_the_list_and_the_waiting_agents_retry_runs_once(
    tmp_path: Path, browser: Any
) -> None:
    deployment = with_approvals(tmp_path)
    async with serve(deployment) as server:
        first = await waiting_mail(server, "big-1")
        with console_process(deployment.ledger, deployment.policy) as link:
            page = await browser.new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: dialogs.append(dialog.message))
            await page.clock.install()  # the page's own timers, moved on below instead of waited for
            await page.goto(link)
            assert page.url.endswith("/approvals")  # the console opens on this page
            card = page.locator(f"[id='op-{first}']")
            assert (
                "Send 'Quarterly numbers' to bob@elsewhere.org?" in await card.locator(".prompt").inner_text()
            )

            # A new request shows without a reload (the page polls its list).
            await page.evaluate("() => { window.stayedOnPage = true; }")
            later = await waiting_mail(server, "big-2", subject="Annual numbers")
            await page.clock.run_for(approvals.POLL_SECONDS * 1000)  # one poll interval
            await page.locator(f"[id='op-{later}']").wait_for(timeout=15_000)
            assert await page.evaluate("() => window.stayedOnPage") is True
            assert "2 calls waiting for approval." in await page.locator(".count").inner_text()

            # The reviewer approves right on the row: one click, no reason needed.
            clicks = 0
            await card.locator("button[value='approve']").click()
            clicks += 1
            await page.wait_for_url(f"**/approvals?decided={first}")
            assert "is now PENDING: approved by" in await page.locator(".notice").inner_text()
            assert await page.locator(f"[id='op-{first}']").count() == 0
            assert dialogs == []
            print(f"\nclicks to approve a waiting call from the list: {clicks}")
        assert deployment.count("emails") == 0  # approving runs nothing by itself

        retry = await server.call("mail_out", {**OUTSIDE, "idempotency_key": "big-1"})
        assert not retry.is_error, retry.content
        assert operation(retry)["replayed"] is False and operation(retry)["state"] == "SUCCEEDED"
        again = await server.call("mail_out", {**OUTSIDE, "idempotency_key": "big-1"})
        assert operation(again)["replayed"] is True
        status = (await server.status(None, idempotency_key="big-1"))["operation"]
        assert status["approval"]["state"] == "approved" and status["approval"]["via"] == "operator"
    assert deployment.count("emails", idempotency_key="big-1") == 1  # exactly one email
    assert deployment.count("emails") == 1  # and none for the one still waiting


async def test_a_reviewer_denies_with_a_reason_and_the_retry_is_told_no_effect(
    tmp_path: Path, browser: Any
) -> None:
    deployment = with_approvals(tmp_path)
    async with serve(deployment) as server:
        op_id = await waiting_mail(server, "big-d")
        with console_process(deployment.ledger, deployment.policy) as link:
            page = await browser.new_page()
            await page.goto(link)
            # The reviewer opens the form from the row (click 1), says why, denies (click 2).
            clicks = 0
            await page.locator(f"[id='op-{op_id}'] a.deny").click()
            clicks += 1
            await page.locator("#decide button[value='deny']").click()  # no reason: refused
            await page.wait_for_load_state("load")
            assert "A denial needs a reason" in await page.locator("#decide-problem").inner_text()
            await page.fill("#a-reason", "not to outside addresses")
            await page.locator("#decide button[value='deny']").click()
            clicks += 1
            await page.wait_for_url(f"**/approvals?decided={op_id}")
            assert "is now FAILED_FINAL: denied by" in await page.locator(".notice").inner_text()
            print(f"\nclicks to deny a waiting call with a reason (from the list): {clicks}")

        answer = await server.call("mail_out", {**OUTSIDE, "idempotency_key": "big-d"})
        assert error_code(answer) == "approval_denied"
        assert "not to outside addresses" in error(answer)["message"]
        assert operation(answer)["state"] == "FAILED_FINAL"
    assert deployment.count("emails") == 0  # nothing sent
