"""The console as an ASGI app: its pages, the sign-in guard in front of them, and the ledger it opens."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from commitgate.server.console.pages import PAGES, Page
from commitgate.server.console.rendering import STATIC, render
from commitgate.server.console.security import Access, Denied, with_headers
from commitgate.server.console.signin import LOGIN_PATH, OPEN_PATHS, SIGN_IN_ROUTES, signs_in
from commitgate.server.ledger import Ledger, LedgerUnavailable, open_ledger
from commitgate.server.ledger.evidence import Evidence
from commitgate.server.policy.models import Policy
from commitgate.server.serve.evidence import attach

OpenLedger = Callable[[], Awaitable[Ledger]]


class Guard(BaseHTTPMiddleware):
    """In front of every page: the Host check, sign-in (URL token, bearer or cookie), refusals as
    pages, and the security headers on every answer."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        access: Access = request.app.state.access
        try:
            return with_headers(await self._admit(request, call_next, access))
        except Denied as exc:
            return with_headers(_refusal(request, exc, access))
        except LedgerUnavailable as exc:
            return with_headers(_refusal(request, Denied(503, f"The ledger cannot be read: {exc}"), access))

    async def _admit(self, request: Request, call_next: RequestResponseEndpoint, access: Access) -> Response:
        access.check_host(request)
        if request.url.path.startswith("/static/"):
            return await call_next(request)  # the stylesheet and script: public, nothing secret
        at = time.time()
        if "token" in request.query_params:
            return access.sign_in_from_url(request, at)
        if request.url.path in OPEN_PATHS:
            return await call_next(request)  # signing in through the identity provider
        identity = await access.signed_in(request, at)
        if identity is None:
            raise Denied(401, _sign_in_hint(access))
        request.state.identity = identity
        return await call_next(request)


def _sign_in_hint(access: Access) -> str:
    if access.oauth is not None and access.oauth.policy.console_client_id is not None:
        return "Sign in with your identity provider, or with an operator's bearer token."
    if access.loopback:
        return "Sign in with the link the console printed when it started (it ends in ?token=…)."
    return (
        "Sign in with an operator's token of the policy's [[auth.tokens]] (role = \"operator\"): open this"
        " page with ?token=YOUR_TOKEN."
    )


def _refusal(request: Request, denied: Denied, access: Access) -> Response:
    signed_in = getattr(request.state, "identity", None) is not None
    back = urlencode({"next": request.url.path})  # signed in, the person lands where they were going
    sign_in = f"{LOGIN_PATH}?{back}" if denied.status == 401 and signs_in(access) else ""
    response = render(
        request, "refused.html", denied.status, title="Refused", message=str(denied), sign_in=sign_in
    )
    if denied.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    if not signed_in:
        response.headers["X-Robots-Tag"] = "noindex"
    return response


async def _home(request: Request) -> Response:
    pages: Sequence[Page] = request.app.state.pages
    return RedirectResponse(pages[0].path, status_code=303)


async def _denied(request: Request, exc: Exception) -> Response:
    if isinstance(exc, LedgerUnavailable):
        exc = Denied(503, f"The ledger cannot be read or written: {exc}")
    assert isinstance(exc, Denied)
    return _refusal(request, exc, request.app.state.access)


def create_app(
    open_the_ledger: OpenLedger,
    access: Access,
    pages: Sequence[Page] = PAGES,
    policy: Policy | None = None,
    policy_dir: Path | None = None,
) -> Starlette:
    """The console over the ledger `open_the_ledger` gives (opened at start, closed at stop).

    `policy`: where the tools' approval prompts come from (None: each question is the generic one),
    and the tools whose status checks *Check again* runs, importing from `policy_dir`.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.ledger = await open_the_ledger()
        try:
            yield
        finally:
            await app.state.ledger.close()

    routes: list[BaseRoute] = [
        Route("/", _home, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    for page in pages:
        routes.extend(page.routes)
    routes.extend(SIGN_IN_ROUTES)
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Guard)],
        exception_handlers={Denied: _denied, LedgerUnavailable: _denied},
        lifespan=lifespan,
    )
    app.state.access = access
    app.state.pages = tuple(pages)
    app.state.policy = policy
    app.state.policy_dir = policy_dir  # where the policy's own tool modules import from (Check again)
    return app


def ledger_opener(url: str, evidence: Evidence | None = None) -> OpenLedger:
    async def opener() -> Ledger:
        ledger = await open_ledger(url, auto_migrate=False)  # the console never creates tables
        if evidence is not None:
            attach(ledger, evidence)
        return ledger

    return opener
