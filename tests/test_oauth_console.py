"""The console with `[auth.oauth]`: operators sign in through a real OpenID provider (npm `oidc-provider`).

A real `commitgate console` process on loopback over a seeded SQLite ledger; the provider's
development login form signs in any name, and grants the operator's scope only to its operators
(carol decides for alice, dave for everyone). The sign-in runs in headless Chromium.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import anyio
import httpx2
import pytest
from support.browser import chromium, console_process, require_browser
from support.console import console_client, seed
from support.oidc import AGENT_SCOPE, OPERATOR_SCOPE, PRINCIPALS_CLAIM, IdP, running_idp

from commitgate.server.console.security import Access
from commitgate.server.policy.oauth import OAuthPolicy
from commitgate.server.policy.tokens import TokenTable
from commitgate.server.serve.oauth import OAuthVerifier

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

RESOURCE = "https://mcp.example.com/mcp"  # the server's public URL: the audience operators' tokens carry


@dataclass
class Console:
    base: str
    idp: IdP
    ledger: Path

    def get(self, path: str, token: str | None = None) -> httpx2.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx2.get(self.base + path, headers=headers, follow_redirects=True, timeout=30)


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    root = tmp_path_factory.mktemp("oauth-console")
    ledger = root / "ledger.db"
    anyio.run(seed, ledger, 6, 2)
    with running_idp() as idp:
        policy = root / "policy.toml"
        policy.write_text(
            f"""
[auth.oauth]
issuer = "{idp.issuer}"
resource = "{RESOURCE}"
principal_claim = "sub"
operator_principals_claim = "{PRINCIPALS_CLAIM}"
console_client_id = "console"
""",
            encoding="utf-8",
        )
        with console_process(ledger, policy) as link:
            base = link.split("/?")[0].rstrip("/")
            idp.allow_redirects(base + "/oauth/callback")
            yield Console(base, idp, ledger)


# --- bearer tokens ----------------------------------------------------------------------------------------


def test_an_operator_access_token_is_admitted_and_sees_its_principals(console: Console) -> None:
    carol = console.idp.token("ops-carol", OPERATOR_SCOPE, RESOURCE)
    page = console.get("/operations", carol)
    assert page.status_code == 200
    assert "Signed in as <strong>ops-carol</strong>" in page.text and "principal alice" in page.text
    dave = console.idp.token("ops-dave", OPERATOR_SCOPE, RESOURCE)
    everyone = console.get("/operations", dave)
    assert everyone.status_code == 200 and "every principal" in everyone.text


def test_an_agent_or_scopeless_token_is_refused_and_a_foreign_one_is_not_known(console: Console) -> None:
    agent = console.get("/operations", console.idp.token("agent-alice", AGENT_SCOPE, RESOURCE))
    assert agent.status_code == 403 and "agent&#39;s token" in agent.text
    plain = console.get("/operations", console.idp.token("plain-client", "profile:read", RESOURCE))
    assert plain.status_code == 403 and OPERATOR_SCOPE in plain.text
    elsewhere = console.idp.token("ops-carol", OPERATOR_SCOPE, "https://other.example.com/mcp")
    assert console.get("/operations", elsewhere).status_code == 401


# --- signing in through the provider, in a browser ------------------------------------------------------------


@pytest.fixture(scope="module")
async def browser(anyio_backend: str) -> AsyncIterator[Any]:
    """One Chromium for the module; each test signs in from a context of its own (no shared cookies)."""
    require_browser()
    async with chromium() as launched:
        yield launched


async def sign_in(page: Any, console: Console, login: str) -> None:
    """From the console's refusal to the provider's login form and back."""
    answer = await page.goto(console.base + "/operations")
    assert answer.status == 401
    await page.get_by_role("link", name="Sign in with your identity provider").click()
    await page.locator("input[name=login]").fill(login)
    await page.locator("input[name=password]").fill("any password")
    await page.get_by_role("button", name="Sign-in").click()
    await page.get_by_role("button", name="Continue").click()  # consent to the console's request


@pytest.mark.browser
async def test_an_operator_signs_in_through_the_provider_and_out_again(
    console: Console, browser: Any
) -> None:
    context = await browser.new_context()
    page = await context.new_page()
    await sign_in(page, console, "carol")
    await page.wait_for_url(console.base + "/operations", timeout=30000)
    who = await page.locator(".who").inner_text()
    assert "Signed in as carol" in who and "principal alice" in who
    cookies = {c["name"]: c for c in await context.cookies(console.base)}
    session = next(
        c for name, c in cookies.items() if name.startswith("commitgate_console_") and "signin" not in name
    )
    assert session["httpOnly"] and session["sameSite"] == "Strict"
    assert not session["secure"]  # loopback: plain HTTP must keep it; off loopback it is Secure
    kept = session["value"]
    await page.get_by_role("button", name="Sign out").click()
    await page.get_by_text("You are signed out of this console.").wait_for()
    assert (await page.goto(console.base + "/operations")).status == 401
    replayed = httpx2.get(console.base + "/operations", cookies={session["name"]: kept})
    assert replayed.status_code == 401  # a copy of the cookie ends with the sign-in
    await context.close()


@pytest.mark.browser
async def test_a_person_who_is_not_an_operator_does_not_get_in(console: Console, browser: Any) -> None:
    context = await browser.new_context()
    page = await context.new_page()
    await sign_in(page, console, "mallory")
    await page.get_by_text("This identity is not an operator's").wait_for()
    assert "/oauth/callback" in page.url
    names = [c["name"] for c in await context.cookies(console.base)]
    assert not [n for n in names if n.startswith("commitgate_console_") and "signin" not in n]
    await context.close()


def test_a_callback_that_did_not_start_here_is_refused(console: Console) -> None:
    refused = httpx2.get(console.base + "/oauth/callback?code=stolen&state=guessed", timeout=30)
    assert refused.status_code == 400 and "did not start at this console" in refused.text


def test_off_loopback_the_sign_in_asks_for_pkce_and_its_cookies_are_secure(console: Console) -> None:
    oauth = OAuthVerifier(
        OAuthPolicy(issuer=console.idp.issuer, resource=RESOURCE, console_client_id="console")
    )
    access = Access.for_bind("0.0.0.0", 8766, TokenTable(), "nobody", oauth)
    with console_client(f"sqlite:///{console.ledger}", access, sign_in=False) as client:
        refused = client.get("/approvals")
        assert refused.status_code == 401 and "/oauth/login?next=%2Fapprovals" in refused.text
        started = client.get("/oauth/login?next=/approvals")
    assert started.status_code == 303
    target = urlsplit(started.headers["location"])
    query = dict(parse_qsl(target.query))
    assert f"{target.scheme}://{target.netloc}{target.path}" == console.idp.issuer + "/auth"
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert query["resource"] == RESOURCE and query["client_id"] == "console"
    assert query["scope"] == f"openid {OPERATOR_SCOPE}" and query["redirect_uri"].endswith("/oauth/callback")
    cookie = started.headers["set-cookie"].lower()
    assert "secure" in cookie and "httponly" in cookie and "samesite=lax" in cookie
