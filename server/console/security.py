"""Who may use the console, and how its pages defend themselves.

Two ways in, chosen by the address the console listens on:
- loopback (the default): a random token made at start and printed in the console's URL, as
  Jupyter does. The first visit with `?token=` sets a signed cookie and redirects to the same
  page without the token, so it leaves the address bar and the history. Whoever holds it is an
  operator of the whole ledger, like a person with `commitgate ops` on this machine.
- any other address: only operator tokens of the policy (`[[auth.tokens]]` with
  `role = "operator"`), as a bearer token or once in the URL. The console then decides in that
  operator's name and sees only the operations of the principals the token lists. Without an
  operator token (or `[auth.oauth]`) it refuses to start (`ConsoleRefused`).
With `[auth.oauth]`, on either: an operator's access token as a bearer token, or a person signed in
through the identity provider (signin.py), who gets the same signed cookie.
On either, an agent's token is refused (403): an agent must never approve or resolve its own calls.

Every page is sent with a strict Content-Security-Policy (no inline script or style, nothing from
elsewhere, no framing); every form POST carries a CSRF token bound to the signed-in session, and
a POST from another origin is refused before its form is read.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlencode, urlsplit

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from commitgate.server.model.errors import UserFacingError
from commitgate.server.policy.tokens import Holder, TokenTable
from commitgate.server.serve.oauth import Caller, OAuthVerifier, Refused

log = logging.getLogger("commitgate.console")
CSRF_FIELD = "csrf_token"
COOKIE_LIFETIME = 12 * 3600.0
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # the Origin of our own form POSTs must reach us (no-referrer sends "null")
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class ConsoleRefused(UserFacingError):
    """The console will not start as asked; the message says why and what to do."""


class Denied(Exception):
    """A request the console refuses: `status` and a sentence for the person."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


AGENT_REFUSED = (
    "This is an agent's token: agents call MCP, they cannot use the console. Sign in with an"
    ' operator\'s token (an [[auth.tokens]] entry with role = "operator").'
)


NOT_AN_OPERATOR = (
    "This identity is not an operator's: the console needs an access token with the operator's scope"
    " ({scope}), which the identity provider grants to operators only."
)


def check_bind(host: str, tokens: TokenTable, oauth: OAuthVerifier | None = None) -> None:
    """A console bound elsewhere than loopback needs an operator's token or an identity provider:
    ConsoleRefused otherwise."""
    if not is_loopback(host) and not tokens.has("operator") and oauth is None:
        raise ConsoleRefused(
            f"refusing to serve the console on {host!r} without an operator's token: there, only"
            " operators sign in (agents' tokens are refused, so that no agent approves or resolves its own"
            ' calls). Add role = "operator" to an [[auth.tokens]] entry of the'
            ' policy given with --policy (a principal name of its own, e.g. "ops-alice", with token_env'
            " or token_sha256), or [auth.oauth] to sign operators in through your identity provider,"
            " or bind a loopback address such as 127.0.0.1 (the default) and open the"
            " link the console prints."
        )


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is signed in: `name` is recorded as the decider; `principals` None sees every principal."""

    name: str
    principals: frozenset[str] | None
    session: str  # a per-sign-in value the CSRF token is bound to

    def sees(self, principal: str) -> bool:
        return self.principals is None or principal in self.principals


@dataclass
class Access:
    """The console's way in: its own random token (loopback) and the policy's operator tokens."""

    operator: str  # who decides when signed in with the console's own token
    console_token: str | None = None
    tokens: TokenTable = field(default_factory=TokenTable)
    loopback: bool = True
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    cookie: str = "commitgate_console"
    oauth: OAuthVerifier | None = None  # operators' access tokens of [auth.oauth]
    signed_out: set[str] = field(default_factory=set)  # sessions ended here, their cookies refused

    @classmethod
    def for_bind(
        cls, host: str, port: int, tokens: TokenTable, operator: str, oauth: OAuthVerifier | None = None
    ) -> Access:
        """Loopback: a fresh console token. Elsewhere: the policy's operator tokens or identity
        provider, or ConsoleRefused."""
        cookie = f"commitgate_console_{port}"  # cookies ignore ports: two consoles must not clash
        if is_loopback(host):
            token = secrets.token_urlsafe(32)
            return cls(operator, console_token=token, tokens=tokens, cookie=cookie, oauth=oauth)
        check_bind(host, tokens, oauth)
        return cls(operator, tokens=tokens, loopback=False, cookie=cookie, oauth=oauth)

    # --- tokens and cookies ------------------------------------------------------------------

    def identity_for_token(self, token: str) -> Identity | None:
        """The identity a token signs in as; None for no known token; Denied(403) for an agent's."""
        session = hashlib.sha256(token.encode("utf-8")).hexdigest()
        if self.console_token is not None and hmac.compare_digest(
            token.encode("utf-8"), self.console_token.encode("utf-8")
        ):
            return Identity(self.operator, None, session)
        holder: Holder | None = self.tokens.holder_of(token)
        if holder is None:
            return None
        if holder.role != "operator":
            raise Denied(403, AGENT_REFUSED)
        return Identity(holder.principal, holder.sees, session)

    def _sign(self, payload: str) -> str:
        return hmac.new(self.secret, payload.encode("ascii"), hashlib.sha256).hexdigest()

    def sign(self, payload: str) -> str:
        """This console's signature of `payload` (ASCII), for the values it hands a browser to keep."""
        return self._sign(payload)

    async def identity_for_bearer(self, token: str) -> Identity | None:
        """A static or console token's identity, else an operator's access token's; Denied(403) for
        any other role."""
        identity = self.identity_for_token(token)
        if identity is not None or self.oauth is None or token.count(".") != 2:
            return identity
        try:
            caller = await self.oauth.verify(token)
        except Refused as exc:
            log.warning("refused an access token: %s", exc)
            return None
        except Exception as exc:  # a malformed token is a refusal, never an error page
            log.warning("refused an access token: cannot read it (%s)", type(exc).__name__)
            return None
        return self.operator_identity(caller, hashlib.sha256(token.encode("utf-8")).hexdigest())

    def operator_identity(self, caller: Caller, session: str) -> Identity:
        """An access token's caller as the console's identity: operators only (Denied(403) otherwise)."""
        if caller.role == "agent":
            raise Denied(403, AGENT_REFUSED)
        if caller.role != "operator":
            scope = self.oauth.policy.operator_scope if self.oauth is not None else "operator"
            raise Denied(403, NOT_AN_OPERATOR.format(scope=scope))
        return Identity(caller.principal, caller.sees, session)

    def cookie_value(self, identity: Identity, now: float, lifetime: float = COOKIE_LIFETIME) -> str:
        seen = None if identity.principals is None else sorted(identity.principals)
        body = json.dumps({"n": identity.name, "p": seen, "x": now + lifetime})
        payload = base64.urlsafe_b64encode(body.encode("utf-8")).decode("ascii")
        session = secrets.token_hex(16)
        return f"{payload}.{session}.{self._sign(payload + '.' + session)}"

    def identity_for_cookie(self, value: str, now: float) -> Identity | None:
        payload, _, rest = value.partition(".")
        session, _, signature = rest.partition(".")
        if not (payload and session and signature):
            return None
        if not hmac.compare_digest(signature, self._sign(payload + "." + session)):
            return None
        if session in self.signed_out:
            return None
        try:
            data = json.loads(base64.urlsafe_b64decode(payload.encode("ascii")))
        except ValueError:
            return None
        if not isinstance(data, dict) or float(data.get("x", 0)) < now:
            return None
        seen = data.get("p")
        return Identity(str(data["n"]), None if seen is None else frozenset(map(str, seen)), session)

    def csrf_token(self, identity: Identity) -> str:
        return self._sign("csrf." + identity.session)

    def csrf_ok(self, identity: Identity, presented: str) -> bool:
        return hmac.compare_digest(presented.encode("utf-8"), self.csrf_token(identity).encode("utf-8"))

    # --- one request --------------------------------------------------------------------------

    def check_host(self, request: Request) -> None:
        """On loopback, only loopback Host names: a page of another site that rebinds its DNS name
        to 127.0.0.1 gets no answer."""
        if not self.loopback:
            return
        host = request.headers.get("host", "")
        try:
            name = urlsplit(f"//{host}").hostname or ""
        except ValueError:  # not even a host name
            name = ""
        if not is_loopback(name):
            raise Denied(400, "This console answers only to a loopback address such as 127.0.0.1.")

    async def signed_in(self, request: Request, now: float) -> Identity | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return await self.identity_for_bearer(token.strip())
        value = request.cookies.get(self.cookie)
        return self.identity_for_cookie(value, now) if value else None

    def sign_in_from_url(self, request: Request, now: float) -> Response:
        """A visit with `?token=`: set the cookie and go to the same page without the token."""
        identity = self.identity_for_token(request.query_params.get("token", ""))
        if identity is None:
            raise Denied(
                401,
                "That token is not valid for this console: open the link the console printed, or use an"
                " operator's token of the policy.",
            )
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        # Only a path of this console: "//host/x" or "/\\host/x" would leave it (an open redirect).
        target = "/" + request.url.path.lstrip("/\\") + ("?" + urlencode(rest) if rest else "")
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            self.cookie,
            self.cookie_value(identity, now),
            max_age=int(COOKIE_LIFETIME),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        return response


def same_origin(request: Request) -> bool:
    """A POST's Origin (when the browser sends one) must be this console's own."""
    origin = request.headers.get("origin")
    if origin is None:  # not a browser, or one that sends no Origin: the CSRF token still decides
        return True
    return urlsplit(origin).netloc == request.headers.get("host", "")


async def checked_form(request: Request) -> FormData:
    """The form of a POST, once its CSRF token matched the signed-in session; Denied(403) otherwise."""
    access: Access = request.app.state.access
    identity: Identity = request.state.identity
    if not same_origin(request):
        raise Denied(403, "This form was sent from another site; the console refused it.")
    form = await request.form()
    presented = form.get(CSRF_FIELD)
    if not isinstance(presented, str) or not access.csrf_ok(identity, presented):
        raise Denied(
            403, "This form has expired or did not come from this console: reload the page and send it again."
        )
    return form


def with_headers(response: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response
