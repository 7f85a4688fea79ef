"""The console over HTTP: every page, sign-in and its refusals, CSRF, escaping, masking, resolving,
deciding approvals.

The app runs in-process (Starlette's TestClient) over a real SQLite ledger file; operations come
from real calls through a gateway, and effects are counted in the demo sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import html
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient
from support.browser import require_browser
from support.console import (
    BASE_URL,
    BUDGETS,
    EMAIL,
    MARKUP_SESSION,
    call,
    claim,
    console_client,
    csrf_of,
    error_code,
    loopback_access,
    spend,
    spend_in_every_budget,
    write_policy,
)

from commitgate.server.cli.main import main
from commitgate.server.console.app import create_app, ledger_opener
from commitgate.server.console.command import prompt_policy
from commitgate.server.console.pages.questions import duration
from commitgate.server.console.security import CONTENT_SECURITY_POLICY, Access, ConsoleRefused
from commitgate.server.demo import tools as demo
from commitgate.server.ledger import open_ledger
from commitgate.server.model.facts import State
from commitgate.server.model.notes import ApprovalRecord
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.masking import mask_values
from commitgate.server.policy.models import AuthPolicy, AuthToken
from commitgate.server.policy.tokens import load_tokens

SCRIPT = "<script>alert('xss')</script>"
IMG = '"><img src=x onerror=alert(1)>'
CARD = "4242424242424242"


@pytest.fixture
def policy(tmp_path: Path, sandbox: Path) -> Path:
    return write_policy(tmp_path)


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


def unknown_email(policy: Path, monkeypatch: pytest.MonkeyPatch, key: str = "receipt-1") -> str:
    """An email sent whose acknowledgement was lost: applied once, recorded UNKNOWN. Its operation id."""
    monkeypatch.setenv(demo.ENV_FAULTS, "send_email.lose_ack=100%")
    result = asyncio.run(call(policy, "send_email", key, **EMAIL))
    monkeypatch.delenv(demo.ENV_FAULTS)
    assert error_code(result) == "operation_outcome_unknown"
    return str(result.structured_content["error"]["operation"]["operation_id"])


def state_of(ledger_url: str, operation_id: str) -> State:
    async def read() -> State:
        ledger = await open_ledger(ledger_url, read_only=True)
        try:
            op = await ledger.get_by_id(None, operation_id)
            assert op is not None
            return op.state
        finally:
            await ledger.close()

    return asyncio.run(read())


# --- sign-in ------------------------------------------------------------------------------------


PAGES = [
    "/approvals",
    "/approvals/rows",
    "/unknown",
    "/unknown/rows",
    "/operations",
    "/operations/op_x",
    "/budgets",
]


def test_without_the_token_every_page_refuses_and_says_how_to_sign_in(policy: Path, ledger_url: str) -> None:
    access = loopback_access()
    with console_client(ledger_url, access, sign_in=False) as client:
        for path in [*PAGES, "/"]:
            answer = client.get(path)
            assert answer.status_code == 401, path
            assert "Sign in with the link the console printed" in answer.text
        assert client.post("/operations/op_x/resolve", data={"finding": "failed"}).status_code == 401
        assert client.get("/?token=not-the-token").status_code == 401
        assert client.get("/unknown", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/static/console.css").status_code == 200  # public, nothing secret


def test_the_url_token_sets_a_strict_cookie_and_leaves_the_address(policy: Path, ledger_url: str) -> None:
    access = loopback_access()
    with console_client(ledger_url, access, sign_in=False) as client:
        answer = client.get(f"/operations?state=UNKNOWN&token={access.console_token}")
        assert answer.status_code == 303
        assert answer.headers["location"] == "/operations?state=UNKNOWN"  # the token leaves the URL
        cookie = answer.headers["set-cookie"]
        assert access.console_token is not None
        assert cookie.startswith(f"{access.cookie}=") and access.console_token not in cookie
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert client.get("/operations").status_code == 200
    bearer = {"Authorization": f"Bearer {access.console_token}"}
    with console_client(ledger_url, access, sign_in=False) as client:
        assert client.get("/operations", headers=bearer).status_code == 200


@pytest.mark.parametrize("path", ["//evil.example/x", "/\\evil.example/x", "/%2F%2Fevil.example/x"])
def test_signing_in_redirects_only_to_a_path_of_the_console(policy: Path, ledger_url: str, path: str) -> None:
    access = loopback_access()
    with console_client(ledger_url, access, sign_in=False) as client:
        answer = client.get(f"{BASE_URL}{path}?a=1&token={access.console_token}")
        assert answer.status_code == 303
        location = answer.headers["location"]
        assert location[0] == "/" and location[1] not in "/\\", location  # a path here, not another host
        assert location.endswith("evil.example/x?a=1")


def test_a_forged_or_foreign_cookie_is_refused(policy: Path, ledger_url: str) -> None:
    other = loopback_access()
    with console_client(ledger_url, other) as client:
        stolen = client.cookies[other.cookie]
    access = Access("alice", console_token=other.console_token, cookie=other.cookie)  # another secret
    with console_client(ledger_url, access, sign_in=False) as client:
        client.cookies.set(access.cookie, stolen)
        assert client.get("/unknown").status_code == 401
        payload, session, _ = stolen.split(".")
        client.cookies.set(access.cookie, f"{payload}.{session}.{'0' * 64}")
        assert client.get("/unknown").status_code == 401


def test_on_loopback_only_loopback_host_names_are_answered(policy: Path, ledger_url: str) -> None:
    with console_client(ledger_url, loopback_access()) as client:
        for host in ("localhost:8766", "127.0.0.2:8766", "[::1]:8766", "127.0.0.1"):
            assert client.get("/unknown", headers={"Host": host}).status_code == 200, host
        assert client.get("/unknown", headers={"Host": "[bad"}).status_code == 400
        rebound = client.get("/unknown", headers={"Host": "attacker.example:8766"})
        assert rebound.status_code == 400 and "loopback" in rebound.text


def test_every_answer_carries_a_strict_content_security_policy(policy: Path, ledger_url: str) -> None:
    with console_client(ledger_url, loopback_access()) as client:
        for path in [*PAGES, "/operations/op_missing", "/nowhere"]:
            answer = client.get(path)
            assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
            assert answer.headers["x-frame-options"] == "DENY"
            assert answer.headers["referrer-policy"] == "same-origin"
    assert (
        "'unsafe-inline'" not in CONTENT_SECURITY_POLICY and "default-src 'none'" in CONTENT_SECURITY_POLICY
    )
    assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY


# --- pages --------------------------------------------------------------------------------------


def test_the_unknown_list_shows_each_operation_and_what_the_status_check_said(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    with console_client(ledger_url, loopback_access()) as client:
        page = client.get("/unknown")
        assert page.status_code == 200
        assert op_id in page.text and "1 operation to decide." in page.text
        assert "no status check: a key-required tool cannot be asked" in page.text
        assert 'data-poll="/unknown/rows"' in page.text  # live updates
        rows = client.get("/unknown/rows")
        assert op_id in rows.text and "<html" not in rows.text  # a fragment, not a page

        later = unknown_email(policy, monkeypatch, "receipt-2")  # a new entry shows in the fragment
        rows = client.get("/unknown/rows")
        assert later in rows.text and "2 operations to decide." in rows.text


def test_an_unknown_charge_shows_that_its_status_check_could_not_tell(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(demo.ENV_FAULTS, "charge_card.lose_ack=100%,find_charge.fail_before=100%")
    result = asyncio.run(call(policy, "charge_card", "order-7", card="4242", amount_cents=1299))
    monkeypatch.delenv(demo.ENV_FAULTS)
    assert error_code(result) == "operation_outcome_unknown"
    op_id = result.structured_content["error"]["operation"]["operation_id"]
    with console_client(ledger_url, loopback_access()) as client:
        listed = client.get("/unknown").text
        assert op_id in listed and "the status check could not tell" in listed
        page = client.get(f"/operations/{op_id}").text
        assert "the status check could not tell" in page and "cannot_tell" in page  # and its full note


def test_check_again_asks_the_status_check_and_offers_the_result_it_found(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(demo.ENV_FAULTS, "charge_card.lose_ack=100%,find_charge.fail_before=100%")
    result = asyncio.run(call(policy, "charge_card", "order-8", card="4242", amount_cents=1299))
    op_id = result.structured_content["error"]["operation"]["operation_id"]
    with console_client(ledger_url, loopback_access(), policy=policy) as client:
        page = client.get(f"/operations/{op_id}").text
        assert f'action="/operations/{op_id}/check"' in page and "Check again</button>" in page
        form = {"csrf_token": csrf_of(page)}
        still = client.post(f"/operations/{op_id}/check", data=form)  # the check still fails
        assert still.status_code == 200 and "The status check could not tell" in still.text
        monkeypatch.delenv(demo.ENV_FAULTS)
        found = client.post(f"/operations/{op_id}/check", data=form)
        assert found.status_code == 200 and "The status check found it" in found.text
        prefilled = re.search(r'<textarea id="r-result"[^>]*>([^<]*)</textarea>', found.text)
        assert prefilled is not None
        offered = json.loads(html.unescape(prefilled.group(1)))
        assert offered["status"] == "succeeded" and offered["amount_cents"] == 1299
        assert state_of(ledger_url, op_id) is State.UNKNOWN  # a person decides, with the result offered
        history = client.get(f"/operations/{op_id}").text
        assert history.count("reconcile_undecided") == 2 and "the status check found it" in history
        resolved = client.post(
            f"/operations/{op_id}/resolve",
            data={**form, "finding": "succeeded", "reason": "", "result": json.dumps(offered)},
        )
        assert resolved.status_code == 303
    retry = asyncio.run(call(policy, "charge_card", "order-8", card="4242", amount_cents=1299))
    assert retry.structured_content == offered and demo.count("charges") == 1


def test_a_running_operation_whose_owner_died_is_listed_as_unknown(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    orphan = asyncio.run(
        claim(tmp_path / "ledger.db", step="orphan", state=State.RUNNING, owner=dead_owner())
    )
    with console_client(ledger_url, loopback_access()) as client:
        assert orphan in client.get("/unknown").text
    assert state_of(ledger_url, orphan) is State.UNKNOWN


async def write_policy_ledger(policy: Path) -> None:
    result = await call(policy, "send_email", "warm-up", **EMAIL)  # creates the ledger as a server would
    assert not result.is_error


def dead_owner() -> str:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return f"{socket.gethostname()}:{child.pid}:deadbeef"


def test_an_operation_page_has_its_facts_and_full_audit_history(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    with console_client(ledger_url, loopback_access()) as client:
        page = client.get(f"/operations/{op_id}")
        assert page.status_code == 200
        for fact in ("send_email", "key-required", "agent", "receipt-1", "ann@example.com", "UNKNOWN"):
            assert fact in page.text
        history = page.text.split("Audit history", 1)[1]
        assert history.index("claimed") < history.index("ambiguous")
        assert 'id="resolve"' in page.text and csrf_of(page.text)
        missing = client.get("/operations/op_nope")
        assert missing.status_code == 404 and "no operation op_nope" in missing.text


def test_search_by_tool_state_session_key_and_principal(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.db"
    asyncio.run(write_policy_ledger(policy))
    ids = {
        name: asyncio.run(claim(path, **fields))  # type: ignore[arg-type]
        for name, fields in {
            "a": {"tool": "refund", "session": "night-run", "step": "r-1"},
            "b": {"tool": "charge_card", "session": "night-run", "step": "c-1", "state": State.SUCCEEDED},
            "c": {"tool": "charge_card", "session": "day-run", "step": "c-2", "principal": "bob"},
        }.items()
    }

    def listed(query: str) -> set[str]:
        page = client.get(f"/operations?{query}")
        assert page.status_code == 200, page.text
        return {name for name, op_id in ids.items() if op_id in page.text}

    with console_client(ledger_url, loopback_access()) as client:
        assert listed("") == {"a", "b", "c"}
        assert listed("tool=charge_card") == {"b", "c"}
        assert listed("state=unknown") == {"a", "c"}
        assert listed("session=night-run") == {"a", "b"}
        assert listed("key=c-2") == {"c"}
        assert listed("principal=bob") == {"c"}
        assert listed("tool=charge_card&session=night-run&state=SUCCEEDED") == {"b"}
        assert "No operations match." in client.get("/operations?key=none-such").text
        bad = client.get("/operations?state=DONE")
        assert bad.status_code == 400 and "There is no state &#39;DONE&#39;" in bad.text


# --- resolving ------------------------------------------------------------------------------------


def test_resolving_from_the_page_is_replayed_to_the_retry_and_nothing_runs_again(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    with console_client(ledger_url, loopback_access("alice")) as client:
        token = csrf_of(client.get(f"/operations/{op_id}").text)
        found = {"message_id": "msg_from_outbox", "to": EMAIL["to"]}
        answer = client.post(
            f"/operations/{op_id}/resolve",
            data={
                "csrf_token": token,
                "finding": "succeeded",
                "reason": "the message is in the outbox",
                "result": json.dumps(found),
            },
        )
        assert answer.status_code == 303 and answer.headers["location"] == f"/unknown?resolved={op_id}"
        after = client.get(answer.headers["location"])
        assert "is now <strong>SUCCEEDED</strong>" in after.text
        assert "Nothing to decide" in after.text
        page = client.get(f"/operations/{op_id}").text
        assert "resolved" in page and "alice" in page and 'id="resolve"' not in page

    replay = asyncio.run(call(policy, "send_email", "receipt-1", **EMAIL))
    assert not replay.is_error and replay.structured_content == found
    assert (replay.meta or {})["commitgate/operation"]["replayed"] is True
    assert demo.count("emails") == 1  # sent once, before the answer was lost; never again


def test_the_console_records_a_decision_exactly_as_ops_resolve_does(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    by_page = unknown_email(policy, monkeypatch, "by-page")
    by_cli = unknown_email(policy, monkeypatch, "by-cli")
    with console_client(ledger_url, loopback_access("bo")) as client:
        token = csrf_of(client.get(f"/operations/{by_page}").text)
        form = {"csrf_token": token, "finding": "failed", "reason": "bounced"}
        assert client.post(f"/operations/{by_page}/resolve", data=form).status_code == 303
    assert (
        main(
            [
                "ops",
                "resolve",
                by_cli,
                "--ledger",
                ledger_url,
                "--failed",
                "--reason",
                "bounced",
                "--by",
                "bo",
            ]
        )
        == 0
    )

    def recorded(op_id: str) -> dict[str, object]:
        capsys.readouterr()
        assert main(["ops", "show", op_id, "--ledger", ledger_url, "--json"]) == 0
        view = json.loads(capsys.readouterr().out)
        last = view["history"][-1]
        note = {k: v for k, v in view["reconciliation"].items() if k != "at"}
        return {
            "state": view["state"],
            "error": view["error"],
            "note": note,
            "last": {k: last[k] for k in ("event", "actor", "detail", "to_state")},
        }

    assert recorded(by_page) == recorded(by_cli)
    assert recorded(by_page)["state"] == "FAILED_FINAL"


def test_a_retryable_resolution_lets_the_same_key_run_once_more(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    with console_client(ledger_url, loopback_access()) as client:
        token = csrf_of(client.get(f"/operations/{op_id}").text)
        form = {"csrf_token": token, "finding": "failed-retryable", "reason": "no trace at the mail server"}
        assert client.post(f"/operations/{op_id}/resolve", data=form).status_code == 303
    assert state_of(ledger_url, op_id) is State.FAILED_RETRYABLE
    rerun = asyncio.run(call(policy, "send_email", "receipt-1", **EMAIL))
    assert not rerun.is_error and (rerun.meta or {})["commitgate/operation"]["replayed"] is False
    assert demo.count("emails") == 2


@pytest.mark.parametrize(
    ("form", "status", "message"),
    [
        ({"finding": "failed"}, 400, "a failed outcome needs a reason"),
        ({"finding": "succeeded", "result": "{not json"}, 400, "the result is not valid JSON"),
        (
            {"finding": "failed", "reason": "x", "result": "{}"},
            400,
            "a result goes only with a succeeded outcome",
        ),
        ({"finding": "maybe"}, 400, "Choose one of the three outcomes."),
        ({}, 400, "Choose one of the three outcomes."),
    ],
)
def test_a_bad_resolution_is_refused_with_the_form_kept(
    policy: Path,
    ledger_url: str,
    monkeypatch: pytest.MonkeyPatch,
    form: dict[str, str],
    status: int,
    message: str,
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    with console_client(ledger_url, loopback_access()) as client:
        token = csrf_of(client.get(f"/operations/{op_id}").text)
        answer = client.post(f"/operations/{op_id}/resolve", data={"csrf_token": token, **form})
        assert answer.status_code == status and message in answer.text
        assert 'role="alert"' in answer.text and 'id="resolve"' in answer.text  # the form is shown again
    assert state_of(ledger_url, op_id) is State.UNKNOWN


def test_only_unknown_operations_can_be_resolved(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    with console_client(ledger_url, loopback_access()) as client:
        token = csrf_of(client.get(f"/operations/{op_id}").text)
        form = {"csrf_token": token, "finding": "failed", "reason": "bounced"}
        assert client.post(f"/operations/{op_id}/resolve", data=form).status_code == 303
        again = client.post(f"/operations/{op_id}/resolve", data={**form, "finding": "succeeded"})
        assert again.status_code == 409 and "only UNKNOWN operations are resolved by hand" in again.text
        assert client.post("/operations/op_nope/resolve", data=form).status_code == 404
    assert state_of(ledger_url, op_id) is State.FAILED_FINAL


@pytest.mark.postgres
def test_the_console_searches_resolves_and_decides_on_a_postgresql_ledger() -> None:
    from support.postgres import fresh_url

    url = asyncio.run(fresh_url())
    op_id = asyncio.run(claim(url, session="pg-run", step="pg-1"))
    done = asyncio.run(claim(url, session="pg-run", step="pg-2", state=State.SUCCEEDED))
    with console_client(url, loopback_access("carol")) as client:
        assert op_id in client.get("/unknown").text
        listed = client.get("/operations?session=pg-run&key=pg-2").text
        assert done in listed and op_id not in listed
        token = csrf_of(client.get(f"/operations/{op_id}").text)
        form = {"csrf_token": token, "finding": "failed", "reason": "no such charge"}
        assert client.post(f"/operations/{op_id}/resolve", data=form).status_code == 303
        page = client.get(f"/operations/{op_id}").text
        assert "FAILED_FINAL" in page and "carol" in page

    waiting = asyncio.run(claim(url, session="pg-run", step="pg-3", state=State.AWAITING_APPROVAL))
    # Recorded a second ago with a wait of 50 ms: its wait ran out before the console lists it.
    late = asyncio.run(
        claim(
            url,
            session="pg-run",
            step="pg-4",
            state=State.AWAITING_APPROVAL,
            at=time.time() - 1,
            timeout=0.05,
        )
    )
    with console_client(url, loopback_access("carol")) as client:
        listed = client.get("/approvals").text
        assert waiting in listed and late not in listed  # the listing expired the one that ran out
        form = {"csrf_token": csrf_of(listed), "decision": "approve"}
        assert client.post(f"/operations/{waiting}/decide", data=form).status_code == 303
        assert client.post(f"/operations/{late}/decide", data=form).status_code == 409
        assert "approved" in client.get(f"/operations/{waiting}").text
    assert state_of(url, waiting) is State.PENDING and state_of(url, late) is State.FAILED_FINAL


# --- CSRF -----------------------------------------------------------------------------------------


def test_a_form_post_without_the_sessions_csrf_token_is_refused(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = unknown_email(policy, monkeypatch)
    access = loopback_access()
    with console_client(ledger_url, access) as other:
        foreign = csrf_of(other.get(f"/operations/{op_id}").text)  # a valid token of another sign-in
    form = {"finding": "failed", "reason": "bounced"}
    with console_client(ledger_url, access) as client:
        mine = csrf_of(client.get(f"/operations/{op_id}").text)
        assert mine != foreign
        for attempt in ({}, {"csrf_token": ""}, {"csrf_token": "x" * 64}, {"csrf_token": foreign}):
            answer = client.post(f"/operations/{op_id}/resolve", data={**form, **attempt})
            assert answer.status_code == 403, attempt
            assert "reload the page and send it again" in answer.text
        elsewhere = client.post(
            f"/operations/{op_id}/resolve",
            data={**form, "csrf_token": mine},
            headers={"Origin": "http://attacker.example"},
        )
        assert elsewhere.status_code == 403 and "from another site" in elsewhere.text
        same = client.post(
            f"/operations/{op_id}/resolve", data={**form, "csrf_token": mine}, headers={"Origin": BASE_URL}
        )
        assert same.status_code == 303
    assert state_of(ledger_url, op_id) is State.FAILED_FINAL


def test_every_post_route_checks_the_csrf_token(policy: Path, ledger_url: str) -> None:
    """A page added later cannot forget it: every POST route of the app is tried without a token."""
    with console_client(ledger_url, loopback_access()) as client:
        posts = [r for r in client.app.routes if isinstance(r, Route) and "POST" in (r.methods or ())]  # type: ignore[attr-defined]
        assert {r.path for r in posts} >= {
            "/operations/{operation_id}/resolve",
            "/operations/{operation_id}/decide",
        }
        for route in posts:
            path = route.path.replace("{operation_id}", "op_any")
            form = {"finding": "failed", "decision": "approve"}
            assert client.post(path, data=form).status_code == 403, route.path


# --- escaping and masking ---------------------------------------------------------------------------


def test_markup_from_clients_is_shown_escaped_on_every_page(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    op_id = asyncio.run(
        claim(
            tmp_path / "ledger.db",
            principal=f"p{SCRIPT}",
            session=f"s{IMG}",
            step=f"k{SCRIPT}",
            tool=f"t{IMG}",
            arguments={"note": SCRIPT, IMG: "value"},
        )
    )
    with console_client(ledger_url, loopback_access()) as client:
        pages = [
            "/approvals",
            "/approvals/rows",
            "/unknown",
            "/unknown/rows",
            "/operations",
            f"/operations/{op_id}",
        ]
        pages += [f"/operations?session=s{IMG}", f"/operations?tool={SCRIPT}&key={IMG}"]
        for path in pages:
            answer = client.get(path, params=None)
            assert answer.status_code == 200, path
            assert "<script>alert" not in answer.text and "<img src=x" not in answer.text, path
        shown = client.get(f"/operations/{op_id}").text
        assert "&lt;script&gt;alert(" in shown and "&lt;img src=x onerror=alert(1)&gt;" in shown


BIDI = "\u202etxt.exe\u202c"  # reads "exe.txt" backwards when shown raw
ZERO_WIDTH = "ann\u200b@example.com"


def test_invisible_and_bidirectional_characters_are_shown_escaped_on_every_page(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    op_id = asyncio.run(
        claim(
            tmp_path / "ledger.db",
            session=f"s{BIDI}",
            step=f"k\u2066{BIDI}",
            arguments={"file": BIDI, "to": ZERO_WIDTH, "\u200fkey": "v"},
        )
    )
    with console_client(ledger_url, loopback_access()) as client:
        for path in ("/unknown", "/unknown/rows", "/operations", f"/operations/{op_id}"):
            page = client.get(path).text
            raw = [
                ch
                for ch in page
                if "\u200b" <= ch <= "\u200f" or "\u202a" <= ch <= "\u202e" or "\u2066" <= ch <= "\u2069"
            ]
            assert raw == [], path
        page = client.get(f"/operations/{op_id}").text
        for escaped in ("\\u202etxt.exe\\u202c", "ann\\u200b@example.com", "\\u200fkey", "k\\u2066"):
            assert escaped in page, escaped


def test_secret_looking_arguments_are_masked(policy: Path, ledger_url: str, tmp_path: Path) -> None:
    asyncio.run(write_policy_ledger(policy))
    secrets = {
        "card": CARD,
        "password": "hunter2-hunter2",
        "api_key": "sk_live_abcdef123456",
        "auth_token": "tok_abcdef123456",
        "note": f"pay with {CARD[:4]} {CARD[4:8]} {CARD[8:12]} {CARD[12:]}",
        "nested": {"client_secret": "shh-very-secret"},
    }
    op_id = asyncio.run(
        claim(tmp_path / "ledger.db", step="masked", arguments={**secrets, "amount_cents": 500})
    )
    with console_client(ledger_url, loopback_access()) as client:
        for path in ["/unknown", f"/operations/{op_id}"]:
            text = client.get(path).text
            for value in (
                "hunter2-hunter2",
                "sk_live_abcdef123456",
                "tok_abcdef123456",
                "shh-very-secret",
                CARD,
                "4242 4242 4242 4242",
            ):
                assert value not in text, (path, value)
            assert "•••• 4242" in text and "***" in text and "500" in text


# --- other ways in --------------------------------------------------------------------------------


def _policy_tokens() -> Access:
    alice = hashlib.sha256(b"alice-token-0123456789").hexdigest()
    bob = hashlib.sha256(b"bob-token-0123456789ab").hexdigest()
    table = load_tokens(
        AuthPolicy(
            tokens=[
                AuthToken(principal="ops-alice", role="operator", principals=["alice"], token_sha256=alice),
                AuthToken(principal="ops-bob", role="operator", principals=["bob"], token_sha256=bob),
            ]
        )
    )
    return Access.for_bind("0.0.0.0", 8766, table, operator="nobody")


def test_bound_elsewhere_an_operator_token_signs_in_and_sees_only_its_principals(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    mine = asyncio.run(claim(tmp_path / "ledger.db", principal="alice", step="a-1"))
    theirs = asyncio.run(claim(tmp_path / "ledger.db", principal="bob", step="b-1"))
    access = _policy_tokens()
    assert access.console_token is None and not access.loopback
    with console_client(ledger_url, access, sign_in=False) as client:
        assert client.get("/unknown").status_code == 401
        bearer = {"Authorization": "Bearer alice-token-0123456789", "Host": "console.example:8766"}
        listed = client.get("/unknown", headers=bearer).text
        assert mine in listed and theirs not in listed and "principal alice" in listed
        assert client.get(f"/operations/{theirs}", headers=bearer).status_code == 404
        assert theirs not in client.get("/operations?principal=bob", headers=bearer).text
        token = csrf_of(client.get(f"/operations/{mine}", headers=bearer).text)
        form = {"csrf_token": token, "finding": "failed", "reason": "refunded by hand"}
        assert client.post(f"/operations/{theirs}/resolve", data=form, headers=bearer).status_code == 404
        assert client.post(f"/operations/{mine}/resolve", data=form, headers=bearer).status_code == 303
        signed = client.get("/unknown?token=bob-token-0123456789ab", headers={"Host": "console.example"})
        assert signed.status_code == 303 and "token" not in signed.headers["location"]
    assert state_of(ledger_url, mine) is State.FAILED_FINAL and state_of(ledger_url, theirs) is State.UNKNOWN


def test_on_loopback_the_printed_link_sees_every_principal_and_an_agents_token_is_refused(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    theirs = asyncio.run(claim(tmp_path / "ledger.db", principal="bob", step="b-1"))
    agent = hashlib.sha256(b"agent-token-0123456789").hexdigest()
    tokens = load_tokens(AuthPolicy(tokens=[AuthToken(principal="alice", token_sha256=agent)]))
    access = Access.for_bind("127.0.0.1", 8766, tokens, operator="nobody")
    with console_client(ledger_url, access) as client:
        assert theirs in client.get("/unknown").text  # the printed link: an operator of every principal
    with console_client(ledger_url, access, sign_in=False) as client:
        refused = client.get("/unknown", headers={"Authorization": "Bearer agent-token-0123456789"})
        assert refused.status_code == 403 and "agent&#39;s token" in refused.text
        assert client.get("/unknown?token=agent-token-0123456789").status_code == 403


def test_bound_elsewhere_without_tokens_the_console_refuses_to_start(
    policy: Path, ledger_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(write_policy_ledger(policy))
    monkeypatch.setattr("commitgate.server.serve.http.listen", never_listen)  # refused before binding
    with pytest.raises(ConsoleRefused, match="without an operator's token"):
        Access.for_bind("0.0.0.0", 8766, load_tokens(None), "alice")
    assert main(["console", "--policy", str(policy), "--host", "0.0.0.0", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "refusing to serve the console on '0.0.0.0' without an operator's token" in err
    assert 'role = "operator"' in err and "[[auth.tokens]]" in err and "Traceback" not in err


def test_the_console_never_creates_a_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.db"
    assert main(["console", "--ledger", f"sqlite:///{missing}", "--port", "0"]) == 1
    assert "no ledger at" in capsys.readouterr().err and not missing.exists()


def never_listen(host: str, port: int) -> socket.socket:
    raise AssertionError(f"the console bound {host}:{port} before refusing to start")


def never_serve(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the console started serving")


def refused_start(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """What `commitgate console argv` says on stderr when it refuses to start; it never serves."""
    monkeypatch.setattr("uvicorn.Server.serve", never_serve)
    assert main(["console", *argv, "--port", "0"]) == 1
    out, err = capsys.readouterr()
    assert "console at" not in out, "the sign-in link was printed before the refusal"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err  # the ledger line, the reason
    return err


def test_a_foreign_sqlite_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    foreign = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(foreign)) as conn, conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY)")
    err = refused_start(["--ledger", f"sqlite:///{foreign}"], capsys, monkeypatch)
    assert "is not a commitgate ledger" in err


def test_an_unreachable_postgresql_ledger_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        url = f"postgresql://postgres@127.0.0.1:{closed.getsockname()[1]}/app"
    policy = tmp_path / "pg.toml"
    policy.write_text(f'[ledger]\nurl = "{url}"\n')
    for argv in (["--ledger", url], ["--policy", str(policy)]):
        assert "cannot connect to the ledger" in refused_start(argv, capsys, monkeypatch)


@pytest.mark.postgres
def test_the_console_never_creates_tables_in_a_postgresql_database(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncpg
    from support.postgres import fresh_url

    async def tables_and_functions(url: str, create: str = "") -> set[str]:
        conn = await asyncpg.connect(url)
        try:
            if create:
                await conn.execute(create)
            rows = await conn.fetch(
                "SELECT table_name AS name FROM information_schema.tables WHERE table_schema = current_schema()"
                " UNION SELECT routine_name FROM information_schema.routines"
                " WHERE routine_schema = current_schema()"
            )
            return {row["name"] for row in rows}
        finally:
            await conn.close()

    url = asyncio.run(fresh_url())
    assert asyncio.run(tables_and_functions(url, "CREATE TABLE customers (id int)")) == {"customers"}
    err = refused_start(["--ledger", url], capsys, monkeypatch)
    assert "no commitgate ledger in this database" in err  # the words of `ops list`
    assert asyncio.run(tables_and_functions(url)) == {"customers"}


def test_an_invalid_host_is_refused_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("console", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--host", "not a host!"])
        err = capsys.readouterr().err
        assert "'not a host!' is not a host" in err and "authentication" not in err


def test_browser_tests_skip_without_chromium_but_fail_under_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMMITGATE_CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="browser tests must run under CI"):
        require_browser()


def test_a_compensable_operation_asks_for_the_result_its_compensation_needs(
    policy: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(demo.ENV_FAULTS, "reserve.lose_ack=100%")
    result = asyncio.run(call(policy, "reserve", "booking-1", resource="room-1", customer="ann"))
    monkeypatch.delenv(demo.ENV_FAULTS)
    assert error_code(result) == "operation_outcome_unknown"
    op_id = result.structured_content["error"]["operation"]["operation_id"]
    with console_client(ledger_url, loopback_access()) as client:
        page = client.get(f"/operations/{op_id}").text
        assert "a compensation that refers to {result.X} will not find it" in page


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ({"card": CARD}, {"card": "•••• 4242"}),
        ({"card_number": 4242424242424242}, {"card_number": "•••• 4242"}),
        (
            {"cvv": "123", "pin": "0000", "user_pin": "1111", "spin": 3},
            {"cvv": "***", "pin": "***", "user_pin": "***", "spin": 3},
        ),
        ({"iban": "DE89370400440532013000", "account_number": "1"}, {"iban": "***", "account_number": "***"}),
        ({"headers": {"Authorization": "Bearer abc"}}, {"headers": {"Authorization": "***"}}),
        (
            {"apiKey": "k", "db_password": "p", "refresh_token": "t"},
            {"apiKey": "***", "db_password": "***", "refresh_token": "***"},
        ),
        ({"note": f"card {CARD} ok"}, {"note": "card •••• 4242 ok"}),
        ({"order": "1234567890123"}, {"order": "1234567890123"}),  # not a card number (Luhn)
        (
            {"amount_cents": 500, "to": "ann@example.com", "items": [1, 2]},
            {"amount_cents": 500, "to": "ann@example.com", "items": [1, 2]},
        ),
    ],
)
def test_masking_hides_credentials_and_cuts_card_numbers(
    value: dict[str, Any], shown: dict[str, Any]
) -> None:
    assert mask_values(value) == shown


def test_a_port_in_use_is_said_with_what_to_do(
    policy: Path, ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(write_policy_ledger(policy))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["console", "--ledger", ledger_url, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert "pick another with --port" in err and "commitgate: commitgate:" not in err


# --- waiting for approval ---------------------------------------------------------------------------

OUTSIDE = {"to": "bob@elsewhere.org", "subject": "Quarterly numbers", "body": "attached"}


def awaiting_mail(policy: Path, key: str = "mail-1", session: str = "s1", **changes: str) -> str:
    """A call of `mail_out` to an outside address: recorded AWAITING_APPROVAL, nothing sent. Its id."""
    result = asyncio.run(call(policy, "mail_out", key, session, **{**OUTSIDE, **changes}))
    assert error_code(result) == "approval_pending", result.content
    return str(result.structured_content["error"]["operation"]["operation_id"])


def decide_form(client: Any, op_id: str, decision: str, reason: str = "", where: str = "list") -> Any:
    page = client.get("/approvals" if where == "list" else f"/operations/{op_id}").text
    form = {"csrf_token": csrf_of(page), "decision": decision, "reason": reason, "from": where}
    return client.post(f"/operations/{op_id}/decide", data=form)


def test_the_waiting_list_is_the_first_page_and_shows_each_call_with_its_question(
    policy: Path, ledger_url: str
) -> None:
    op_id = awaiting_mail(policy, session="night-run")
    with console_client(ledger_url, loopback_access(), policy=policy) as client:
        assert client.get("/").headers["location"] == "/approvals"
        page = client.get("/approvals")
        assert page.status_code == 200
        card = page.text.split(f'id="op-{op_id}"', 1)[1]
        for fact in (
            "mail_out",
            "agent",
            "night-run",
            "mail-1",
            "Send &#39;Quarterly numbers&#39; to bob@elsewhere.org?",
        ):
            assert fact in card, fact
        assert "bob@elsewhere.org" in card and "&#34;body&#34;: &#34;attached&#34;" in card  # the arguments
        assert "Waiting</dt><dd>under a minute" in card and "Expires</dt><dd>in 23 h 59 min" in card
        assert "1 call waiting for approval." in page.text
        assert 'data-poll="/approvals/rows"' in page.text  # live updates
        assert page.text.index('href="/approvals"') < page.text.index('href="/unknown"')  # first in the menu

        rows = client.get("/approvals/rows")
        assert op_id in rows.text and "<html" not in rows.text  # a fragment, not a page
        later = awaiting_mail(policy, "mail-2", subject="Second")  # a new request shows in the fragment
        rows = client.get("/approvals/rows")
        assert later in rows.text and "2 calls waiting for approval." in rows.text
        assert demo.count("emails") == 0


def test_without_a_policy_the_question_is_the_generic_one(policy: Path, ledger_url: str) -> None:
    awaiting_mail(policy)
    with console_client(ledger_url, loopback_access()) as client:
        assert "Approve this call of mail_out?" in client.get("/approvals").text


def test_a_console_given_only_a_ledger_does_not_take_the_bundled_policys_prompts(policy: Path) -> None:
    bundled = default_policy()
    assert prompt_policy(bundled, None, "sqlite:////srv/ledger.db") is None  # someone else's tools
    assert prompt_policy(bundled, None, None) is bundled  # the demo's own ledger
    mine = load_policy(policy)
    assert prompt_policy(mine, str(policy), "sqlite:////srv/ledger.db") is mine


def test_approving_from_the_list_lets_the_retry_run_exactly_once(policy: Path, ledger_url: str) -> None:
    op_id = awaiting_mail(policy)
    with console_client(ledger_url, loopback_access("alice"), policy=policy) as client:
        answer = decide_form(client, op_id, "approve")  # no reason needed to approve
        assert answer.status_code == 303 and answer.headers["location"] == f"/approvals?decided={op_id}"
        after = client.get(answer.headers["location"]).text
        assert "is now <strong>PENDING</strong>: approved by alice" in after
        assert "Nothing waits for approval." in after
        page = client.get(f"/operations/{op_id}").text
        block = page.split('id="approval"', 1)[1].split("</section>", 1)[0]
        for fact in ("approved", "alice", "operator", "Decided"):
            assert fact in block, fact
        assert 'id="decide"' not in page
    assert demo.count("emails") == 0  # approving runs nothing by itself
    first = asyncio.run(call(policy, "mail_out", "mail-1", **OUTSIDE))
    assert not first.is_error, first.content
    again = asyncio.run(call(policy, "mail_out", "mail-1", **OUTSIDE))
    assert (again.meta or {})["commitgate/operation"]["replayed"] is True
    assert demo.count("emails") == 1


def test_a_console_signed_in_as_the_agents_principal_decides_nothing(policy: Path, ledger_url: str) -> None:
    """`--as agent` starts (no policy names every principal), but cannot approve the agent's own call."""
    op_id = awaiting_mail(policy)  # the policy's [server] principal is "agent"
    with console_client(ledger_url, loopback_access("agent"), policy=policy) as client:
        refused = decide_form(client, op_id, "approve")
        assert refused.status_code == 409 and "is the principal of the agent that made" in refused.text
        assert "--as NAME" in refused.text
    assert state_of(ledger_url, op_id) is State.AWAITING_APPROVAL
    assert error_code(asyncio.run(call(policy, "mail_out", "mail-1", **OUTSIDE))) == "approval_pending"
    assert demo.count("emails") == 0


def test_denying_needs_a_reason_and_the_retry_answers_approval_denied(policy: Path, ledger_url: str) -> None:
    op_id = awaiting_mail(policy)
    with console_client(ledger_url, loopback_access("alice"), policy=policy) as client:
        bare = decide_form(client, op_id, "deny", "  ")
        assert bare.status_code == 400 and "A denial needs a reason" in bare.text
        assert 'aria-invalid="true"' in bare.text and 'id="decide"' in bare.text  # the operation's form
        assert state_of(ledger_url, op_id) is State.AWAITING_APPROVAL
        on_page = decide_form(client, op_id, "deny", "", where="operation")
        assert (
            on_page.status_code == 400
            and 'id="decide"' in on_page.text
            and "A denial needs a reason" in on_page.text
        )
        odd = decide_form(client, op_id, "maybe")
        assert odd.status_code == 400 and "Choose Approve or Deny." in odd.text
        long = decide_form(client, op_id, "approve", "x" * 2001)
        assert long.status_code == 400 and "at most 2000 characters" in long.text
        link = client.get(f"/approvals?decided={op_id}").text  # a link cannot fake a decision
        assert (
            "is now <strong>AWAITING_APPROVAL</strong>." in link
            and " by " not in link.split("notice", 1)[1][:300]
        )
        denied = decide_form(client, op_id, "deny", "not to outside addresses")
        assert denied.status_code == 303
        assert (
            "is now <strong>FAILED_FINAL</strong>: denied by alice"
            in client.get(denied.headers["location"]).text
        )
    answer = asyncio.run(call(policy, "mail_out", "mail-1", **OUTSIDE))
    assert error_code(answer) == "approval_denied"
    assert "not to outside addresses" in answer.structured_content["error"]["message"]
    assert demo.count("emails") == 0


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_the_console_records_a_decision_exactly_as_ops_approve_and_deny_do(
    policy: Path, ledger_url: str, capsys: pytest.CaptureFixture[str], decision: str
) -> None:
    by_page = awaiting_mail(policy, "by-page")
    by_cli = awaiting_mail(policy, "by-cli")
    with console_client(ledger_url, loopback_access("bo"), policy=policy) as client:
        assert decide_form(client, by_page, decision, "checked with finance").status_code == 303
    command = [
        "ops",
        decision,
        by_cli,
        "--ledger",
        ledger_url,
        "--reason",
        "checked with finance",
        "--by",
        "bo",
    ]
    assert main(command) == 0

    def recorded(op_id: str) -> dict[str, object]:
        capsys.readouterr()
        assert main(["ops", "show", op_id, "--ledger", ledger_url, "--json"]) == 0
        view = json.loads(capsys.readouterr().out)
        last = view["history"][-1]
        error = view.get("error")
        if error is not None:
            error = {**error, "message": error["message"].replace(op_id, "OP")}
        return {
            "state": view["state"],
            "error": error,
            "approval": {k: v for k, v in view["approval"].items() if k != "decided_at"},
            "last": {k: last[k] for k in ("event", "actor", "detail", "from_state", "to_state")},
        }

    assert recorded(by_page) == recorded(by_cli)
    assert recorded(by_page)["approval"] == {
        "state": "approved" if decision == "approve" else "denied",
        "by": "bo",
        "via": "operator",
        "reason": "checked with finance",
    }


def test_deciding_twice_is_refused_with_the_state_it_is_in(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    op_id = awaiting_mail(policy)
    unknown = asyncio.run(claim(tmp_path / "ledger.db", step="not-waiting"))
    with console_client(ledger_url, loopback_access("alice"), policy=policy) as client:
        token = csrf_of(client.get("/approvals").text)
        form = {"csrf_token": token, "decision": "approve", "reason": "", "from": "list"}
        assert client.post(f"/operations/{op_id}/decide", data=form).status_code == 303
        for again in ({**form, "decision": "deny", "reason": "changed my mind"}, form):
            answer = client.post(f"/operations/{op_id}/decide", data=again)
            assert answer.status_code == 409, answer.text
            assert (
                "Not recorded:" in answer.text and "was already approved by alice (operator)" in answer.text
            )
            assert "it is now PENDING. A decision is taken once." in answer.text
        on_page = client.post(f"/operations/{op_id}/decide", data={**form, "from": "operation"})
        assert on_page.status_code == 409 and "A decision is taken once." in on_page.text
        assert 'id="approval"' in on_page.text  # the operation's own page, with its approval block
        other = client.post(f"/operations/{unknown}/decide", data=form)
        assert other.status_code == 409 and "is not awaiting approval: it is UNKNOWN" in other.text
        assert client.post("/operations/op_nope/decide", data=form).status_code == 404
    assert state_of(ledger_url, op_id) is State.PENDING and state_of(ledger_url, unknown) is State.UNKNOWN


def test_a_wait_that_ran_out_is_shown_as_expired_and_cannot_be_decided(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    ago = time.time() - 1  # recorded a second ago with a wait of 50 ms: run out before they are shown
    listed, opened, decided = (
        asyncio.run(
            claim(tmp_path / "ledger.db", step=step, state=State.AWAITING_APPROVAL, at=ago, timeout=0.05)
        )
        for step in ("late-1", "late-2", "late-3")
    )
    fresh = asyncio.run(claim(tmp_path / "ledger.db", step="fresh", state=State.AWAITING_APPROVAL))
    with console_client(ledger_url, loopback_access(), policy=policy) as client:
        token = csrf_of(client.get(f"/operations/{fresh}").text)
        form = {"csrf_token": token, "decision": "approve", "from": "list"}
        answer = client.post(f"/operations/{decided}/decide", data=form)  # touched first by the decision
        assert (
            answer.status_code == 409
            and "nobody decided before its timeout, it is FAILED_FINAL" in answer.text
        )
        page = client.get(f"/operations/{opened}").text  # touched first by its page
        block = page.split('id="approval"', 1)[1].split("</section>", 1)[0]
        assert "expired" in block and "timeout" in block and 'id="decide"' not in page
        assert "approval_expired" in page and "FAILED_FINAL" in page
        waiting = client.get("/approvals").text  # the listing expires what ran out, as the sweep does
        assert fresh in waiting and listed not in waiting and "1 call waiting for approval." in waiting
    for op_id in (listed, opened, decided):
        assert state_of(ledger_url, op_id) is State.FAILED_FINAL


def test_a_tool_only_the_clients_user_may_decide_has_no_form(policy: Path, ledger_url: str) -> None:
    result = asyncio.run(call(policy, "ask_the_user", "ask-1", **OUTSIDE))
    assert error_code(result) == "approval_pending"
    op_id = result.structured_content["error"]["operation"]["operation_id"]
    awaiting_mail(policy)  # one the console may decide, whose form carries a token
    with console_client(ledger_url, loopback_access(), policy=policy) as client:
        listed = client.get("/approvals").text
        card = listed.split(f'id="op-{op_id}"', 1)[1].split("</li>", 1)[0]
        assert "Only client may decide this one" in card and "<form" not in card
        assert "Only client may decide this one" in client.get(f"/operations/{op_id}").text
        form = {"csrf_token": csrf_of(listed), "decision": "approve", "from": "operation"}
        answer = client.post(f"/operations/{op_id}/decide", data=form)
        assert answer.status_code == 409 and "may be decided only via client, not via operator" in answer.text
    assert state_of(ledger_url, op_id) is State.AWAITING_APPROVAL


def test_the_decide_form_without_the_sessions_csrf_token_is_refused(policy: Path, ledger_url: str) -> None:
    op_id = awaiting_mail(policy)
    access = loopback_access()
    with console_client(ledger_url, access) as other:
        foreign = csrf_of(other.get("/approvals").text)
    with console_client(ledger_url, access) as client:
        mine = csrf_of(client.get("/approvals").text)
        for decision in ("approve", "deny"):
            form = {"decision": decision, "reason": "because"}
            for attempt in ({}, {"csrf_token": ""}, {"csrf_token": foreign}):
                answer = client.post(f"/operations/{op_id}/decide", data={**form, **attempt})
                assert answer.status_code == 403 and "reload the page" in answer.text, attempt
            elsewhere = client.post(
                f"/operations/{op_id}/decide",
                data={**form, "csrf_token": mine},
                headers={"Origin": "http://attacker.example"},
            )
            assert elsewhere.status_code == 403 and "from another site" in elsewhere.text
    assert state_of(ledger_url, op_id) is State.AWAITING_APPROVAL


def test_markup_in_a_waiting_call_is_shown_escaped_and_secrets_masked(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    op_id = asyncio.run(
        claim(
            tmp_path / "ledger.db",
            session=f"s{IMG}",
            step=f"k{SCRIPT}",
            tool="mail_out",
            arguments={
                "to": f"x{IMG}",
                "subject": f"pay with {CARD} {SCRIPT}",
                "password": "hunter2-hunter2",
            },
            state=State.AWAITING_APPROVAL,
        )
    )
    with console_client(ledger_url, loopback_access(), policy=policy) as client:
        for path in ("/approvals", "/approvals/rows", f"/operations/{op_id}"):
            text = client.get(path).text
            assert op_id in text, path
            assert "<script>alert" not in text and "<img src=x" not in text, path
            assert "&lt;script&gt;alert(" in text and "&lt;img src=x onerror=alert(1)&gt;" in text, path
            assert CARD not in text and "hunter2-hunter2" not in text, path
            assert "Send &#39;pay with •••• 4242" in text, path  # the prompt, masked too


def test_an_operator_of_one_principal_cannot_see_or_decide_another_principals_call(
    policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(policy))
    mine = asyncio.run(
        claim(tmp_path / "ledger.db", principal="alice", step="a-1", state=State.AWAITING_APPROVAL)
    )
    theirs = asyncio.run(
        claim(tmp_path / "ledger.db", principal="bob", step="b-1", state=State.AWAITING_APPROVAL)
    )
    with console_client(ledger_url, _policy_tokens(), sign_in=False) as client:
        bearer = {"Authorization": "Bearer alice-token-0123456789", "Host": "console.example:8766"}
        listed = client.get("/approvals", headers=bearer).text
        assert mine in listed and theirs not in listed
        form = {"csrf_token": csrf_of(listed), "decision": "approve"}
        assert client.post(f"/operations/{theirs}/decide", data=form, headers=bearer).status_code == 404
        assert client.post(f"/operations/{mine}/decide", data=form, headers=bearer).status_code == 303
    assert (
        state_of(ledger_url, mine) is State.PENDING
        and state_of(ledger_url, theirs) is State.AWAITING_APPROVAL
    )

    async def approval_of(op_id: str) -> ApprovalRecord | None:
        ledger = await open_ledger(ledger_url, read_only=True)
        try:
            op = await ledger.get_by_id(None, op_id)
            return None if op is None else op.approval
        finally:
            await ledger.close()

    decided = asyncio.run(approval_of(mine))
    assert decided is not None and decided.by == "ops-alice" and decided.via == "operator"


@pytest.mark.parametrize(
    ("seconds", "said"),
    [(0, "under a minute"), (59, "under a minute"), (60, "1 min"), (3600, "1 h"), (3720, "1 h 2 min"),
     (86400, "1 d"), (97200, "1 d 3 h"), (-5, "under a minute")],
)  # fmt: skip
def test_waits_are_said_to_the_minute(seconds: float, said: str) -> None:
    assert duration(seconds) == said


# --- budgets ----------------------------------------------------------------------------------------


def scopes_shown(html: str) -> dict[str, list[dict[str, Any]]]:
    """Each budget's scope cards as the page shows them, in order: their figures (data attributes),
    and the sum of their chart's bars."""
    import html as markup
    import re

    shown: dict[str, list[dict[str, Any]]] = {}
    for card in html.split('<li class="card scope"')[1:]:
        card = card.split("</li>")[0]
        head = card.split(">", 1)[0]
        fields = {k: markup.unescape(v) for k, v in re.findall(r'data-(\w+)="([^"]*)"', head)}
        bars = re.findall(r'<rect class="bar"[^>]*data-spent="([^"]+)"', card)
        entry: dict[str, Any] = {
            "scope": fields["scope"],
            "spent": json.loads(fields["spent"]),
            "left": json.loads(fields["left"]),
            "chart_sum": sum(json.loads(b) for b in bars),
            "bars": len(bars),
        }
        for name in ("operations", "own"):
            if name in fields:
                entry[name] = json.loads(fields[name])
        shown.setdefault(fields["budget"], []).append(entry)
    return shown


def ops_budgets_json(capsys: pytest.CaptureFixture[str], policy: Path, ledger: str) -> dict[str, Any]:
    from support.policy import run

    done = run(capsys, ["ops", "budgets", "--policy", str(policy), "--ledger", ledger, "--json"])
    assert done.code == 0, done.err
    return {b["name"]: b for b in json.loads(done.out)["budgets"]}


def assert_same_figures(shown: dict[str, list[dict[str, Any]]], report: dict[str, Any]) -> None:
    for name, budget in report.items():
        expected = [
            {k: s[k] for k in ("scope", "spent", "left", "operations")} for s in budget["scopes"]
        ] or [{"scope": "all", "spent": 0, "left": budget["limit"], "operations": 0}]
        cards = [{k: c[k] for k in ("scope", "spent", "left", "operations") if k in c} for c in shown[name]]
        assert cards == expected, name
        for card in shown[name]:  # the chart's spans add up to what the scope spent
            assert card["chart_sum"] == pytest.approx(card["spent"]), (name, card)


@pytest.fixture
def budget_policy(tmp_path: Path, sandbox: Path) -> Path:
    return write_policy(tmp_path, BUDGETS)


def test_the_budgets_page_shows_the_figures_ops_budgets_prints_with_charts_that_add_up(
    budget_policy: Path, ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(write_policy_ledger(budget_policy))
    asyncio.run(spend_in_every_budget(tmp_path / "ledger.db", time.time()))
    with console_client(ledger_url, loopback_access(), policy=budget_policy) as client:
        page = client.get("/budgets")
        assert page.status_code == 200
        nav = page.text.split("</nav>")[0]
        assert nav.rstrip().endswith('<li><a href="/budgets" aria-current="page">Budgets</a></li>\n    </ul>')
    report = ops_budgets_json(capsys, budget_policy, ledger_url)
    shown = scopes_shown(page.text)
    assert_same_figures(shown, report)
    assert [c["scope"] for c in shown["payments"]] == ["bob", "alice"]
    assert shown["payments"][0]["spent"] == 2610.5 and shown["payments"][0]["operations"] == 3
    assert shown["payments"][0]["bars"] == 3  # three days with spending: one bar each
    assert [c["scope"] for c in shown["travel"]] == ["alice/s1", f"alice/{MARKUP_SESSION}", "bob/s2"]
    assert shown["shared"] == [
        {"scope": "all", "spent": 4000, "left": 16000, "operations": 2, "chart_sum": 4000, "bars": 2}
    ]
    for words in (
        "30d (sliding)",
        "2,610.5</strong> of 1,000,000 spent",  # exact: no digits added
        "per day",
        "per hour",
        "per 5 minutes",
    ):
        assert words in page.text, words


def test_the_budgets_page_shows_markup_from_clients_escaped(
    budget_policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(budget_policy))
    at = time.time()
    asyncio.run(spend(tmp_path / "ledger.db", "travel", [(f"p{IMG}", f"s{SCRIPT}", 10, at - 60)]))
    with console_client(ledger_url, loopback_access(), policy=budget_policy) as client:
        text = client.get("/budgets").text
    assert "<script>alert" not in text and "<img src=x" not in text
    assert (
        "p&#34;&gt;&lt;img src=x onerror=alert(1)&gt;/s&lt;script&gt;alert(&#39;xss&#39;)&lt;/script&gt;"
        in text
    )


def test_the_budgets_page_bounds_the_scopes_it_shows_and_says_how_many_more(
    budget_policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    from commitgate.server.console.pages.budgets import SHOWN

    asyncio.run(write_policy_ledger(budget_policy))
    at = time.time()
    runs = [("agent", f"run-{i}", 100 + i, at - 60 * i) for i in range(SHOWN + 5)]
    asyncio.run(spend(tmp_path / "ledger.db", "travel", runs))
    with console_client(ledger_url, loopback_access(), policy=budget_policy) as client:
        text = client.get("/budgets").text
    cards = scopes_shown(text)["travel"]
    assert [c["spent"] for c in cards] == [100 + i for i in reversed(range(5, SHOWN + 5))]  # the highest
    assert f"The {SHOWN} scopes that spent the most, of {SHOWN + 5}" in text


def test_a_principals_sign_in_sees_its_own_budget_scopes_and_only_the_total_of_a_shared_one(
    budget_policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(budget_policy))
    asyncio.run(spend_in_every_budget(tmp_path / "ledger.db", time.time()))
    app = create_app(ledger_opener(ledger_url), _policy_tokens(), policy=load_policy(budget_policy))
    with TestClient(app, base_url=BASE_URL) as client:
        bearer = {"Authorization": "Bearer alice-token-0123456789", "Host": "console.example:8766"}
        text = client.get("/budgets", headers=bearer).text
    shown = scopes_shown(text)
    assert [c["scope"] for c in shown["payments"]] == ["alice"]
    assert [c["scope"] for c in shown["travel"]] == ["alice/s1", f"alice/{MARKUP_SESSION}"]
    (shared,) = shown["shared"]
    # everyone's total against the limit (what alice's agent is told in budget_exceeded), no count of
    # others' operations, and a chart of her own share only
    assert shared == {"scope": "all", "spent": 4000, "left": 16000, "own": 1000, "chart_sum": 1000, "bars": 1}
    assert "bob" not in text and "yours: 1,000" in text and "Your spending per 5 minutes" in text


def test_a_console_without_a_policy_or_budgets_says_how_to_see_them(policy: Path, ledger_url: str) -> None:
    with console_client(ledger_url, loopback_access()) as client:  # `--ledger` alone
        page = client.get("/budgets")
    assert page.status_code == 200
    assert "knows no budget definitions" in page.text and "commitgate console --policy" in page.text
    with console_client(ledger_url, loopback_access(), policy=policy) as client:  # a policy without budgets
        assert "The console's policy declares no budgets" in client.get("/budgets").text


@pytest.mark.postgres
def test_the_budgets_page_shows_the_figures_ops_budgets_prints_on_postgresql(
    budget_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from support.postgres import fresh_url

    url = asyncio.run(fresh_url())
    asyncio.run(spend_in_every_budget(url, time.time()))
    with console_client(url, loopback_access(), policy=budget_policy) as client:
        text = client.get("/budgets").text
    assert_same_figures(scopes_shown(text), ops_budgets_json(capsys, budget_policy, url))
    assert scopes_shown(text)["payments"][0]["bars"] == 3


def test_a_scope_past_its_limit_says_so_in_words_not_colour_alone(
    budget_policy: Path, ledger_url: str, tmp_path: Path
) -> None:
    asyncio.run(write_policy_ledger(budget_policy))
    # exceeded = "approval": a person let this session spend past the 50,000 limit
    asyncio.run(spend(tmp_path / "ledger.db", "travel", [("agent", "trip", 60000, time.time() - 60)]))
    with console_client(ledger_url, loopback_access(), policy=budget_policy) as client:
        text = client.get("/budgets").text
    assert scopes_shown(text)["travel"] == [
        {"scope": "agent/trip", "spent": 60000, "left": 0, "operations": 1, "chart_sum": 60000, "bars": 1}
    ]
    assert "<strong>60,000</strong> of 50,000 spent (over 100 %)" in text and "past the limit" in text
    assert 'class="gauge-fill over"' in text


@pytest.mark.parametrize(
    ("window", "span", "bars"),
    [
        (3600.0, 300.0, 12),
        (86400.0, 3600.0, 24),
        (30 * 86400.0, 86400.0, 30),
        (360 * 86400.0, 30 * 86400.0, 12),
    ],
)
def test_a_spending_chart_has_at_most_48_bars_of_whole_minutes_hours_or_days(
    window: float, span: float, bars: int
) -> None:
    from commitgate.server.core.budgets import MAX_SPANS, span_for

    assert span_for(window) == span and window / span <= MAX_SPANS and round(window / span) == bars


def test_the_question_of_a_budgeted_call_shows_its_budget_with_the_unit(
    tmp_path: Path, sandbox: Path
) -> None:
    asking = BUDGETS.replace('per = "principal"\n', 'per = "principal"\nunit = "USD cents"\n', 1) + (
        '\n[tools.pay_ask]\nclass = "key-required"\npython = "commitgate.server.demo.tools:charge_card"\n'
        'approval = { via = ["operator"] }\nbudget = "payments"\n'
    )
    policy = write_policy(tmp_path, asking)
    spent = asyncio.run(call(policy, "pay", "p1", card="4242", amount_cents=2500, description="first"))
    assert not spent.is_error, spent.content
    waiting = asyncio.run(call(policy, "pay_ask", "p2", card="4242", amount_cents=4000, description="second"))
    assert error_code(waiting) == "approval_pending", waiting.content
    op_id = str(waiting.structured_content["error"]["operation"]["operation_id"])
    line = (
        "Budget 'payments': limit 1000000 USD cents, spent 2500 USD cents, left 997500 USD cents; "
        "this call spends 4000 USD cents."
    )
    with console_client(f"sqlite:///{tmp_path / 'ledger.db'}", loopback_access(), policy=policy) as client:
        assert line in html.unescape(client.get("/approvals").text)
        assert line in html.unescape(client.get(f"/operations/{op_id}").text)
        budgets = html.unescape(client.get("/budgets").text)
        assert "2,500 USD cents</strong> of 1,000,000 USD cents spent" in budgets


def test_the_printed_link_never_decides_as_an_agents_principal(
    tmp_path: Path,
    sandbox: Path,
    ledger_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the policy gives the OS user's name to an agent, the link's decisions would read as the
    agent's: the console asks for --as, and records its decisions under that name."""
    import getpass

    asyncio.run(write_policy_ledger(write_policy(tmp_path)))
    policy = tmp_path / "agent-named.toml"
    policy.write_text(f'[server]\nprincipal = "{getpass.getuser()}"\n[ledger]\nurl = "{ledger_url}"\n')
    err = refused_start(["--policy", str(policy)], capsys, monkeypatch)
    assert f"the OS user {getpass.getuser()!r} is an agent's principal" in err and "--as" in err
    err = refused_start(["--policy", str(policy), "--as", getpass.getuser()], capsys, monkeypatch)
    assert "is an agent's principal" in err

    seen: list[Access] = []

    def keep_access(opener: Any, access: Access, **kwargs: Any) -> Any:
        seen.append(access)
        raise SystemExit(0)  # the app is not needed: what matters is who it would record

    monkeypatch.setattr("commitgate.server.console.app.create_app", keep_access)
    with pytest.raises(SystemExit):
        main(["console", "--policy", str(policy), "--as", "dana", "--port", "0"])
    assert [a.operator for a in seen] == ["dana"]
