"""Signing operators in through the identity provider of `[auth.oauth]`, and signing out.

The console is a public OAuth client (`console_client_id`): authorization code with PKCE (S256),
asking for the operator's scope and, as a resource indicator, the audience the server checks. The
access token it gets back is checked exactly as a bearer token is (signature, issuer, audience,
expiry), and only an operator's identity gets the console's session cookie, which lasts as long as
the token does (12 h at most): `HttpOnly`, `SameSite=Strict`, `Secure` off loopback.

The state, the PKCE verifier and the page to return to travel in a short-lived signed cookie of
their own. It is `SameSite=Lax`, since the provider's redirect back is a navigation from another
site; for the same reason the callback answers with a page that moves on by itself, so that the
strict session cookie is sent with the first page after it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from typing import Any
from urllib.parse import urlencode

import httpx2
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from commitgate.server.console.rendering import render
from commitgate.server.console.security import COOKIE_LIFETIME, Access, Denied, checked_form
from commitgate.server.serve.oauth import Endpoints, OAuthVerifier, Refused

LOGIN_PATH, CALLBACK_PATH, SIGN_OUT_PATH = "/oauth/login", "/oauth/callback", "/signout"
OPEN_PATHS = (LOGIN_PATH, CALLBACK_PATH)
PENDING_LIFETIME = 600  # seconds a person has to sign in at the provider
TOKEN_TIMEOUT = 10.0


def signs_in(access: Access) -> bool:
    """Whether this console signs people in through the identity provider."""
    return access.oauth is not None and access.oauth.policy.console_client_id is not None


def _provider(access: Access) -> OAuthVerifier:
    if access.oauth is None or access.oauth.policy.console_client_id is None:
        raise Denied(
            404,
            "This console does not sign in through an identity provider: [auth.oauth] has no console_client_id.",
        )
    return access.oauth


async def _endpoints(oauth: OAuthVerifier) -> Endpoints:
    try:
        endpoints = await oauth.keys.discover()
    except Refused as exc:
        raise Denied(503, f"The identity provider cannot be reached: {exc}.") from None
    if endpoints.authorization_endpoint is None or endpoints.token_endpoint is None:
        raise Denied(503, "The identity provider's metadata names no authorization or token endpoint.")
    return endpoints


def _redirect_uri(request: Request) -> str:
    return str(request.base_url).rstrip("/") + CALLBACK_PATH


def _pending_cookie(access: Access) -> str:
    return access.cookie + "_signin"


def _secure(access: Access, request: Request) -> bool:
    return not access.loopback or request.url.scheme == "https"


async def login(request: Request) -> Response:
    """Off to the provider, with a fresh state and PKCE verifier kept in a signed cookie."""
    access: Access = request.app.state.access
    oauth = _provider(access)
    endpoints = await _endpoints(oauth)
    state, verifier = secrets.token_urlsafe(24), secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=")
    back = request.query_params.get("next", "/")
    pending = {"s": state, "v": verifier, "n": back, "x": time.time() + PENDING_LIFETIME}
    query = {
        "response_type": "code",
        "client_id": oauth.policy.console_client_id,
        "redirect_uri": _redirect_uri(request),
        "scope": f"openid {oauth.policy.operator_scope}",
        "state": state,
        "code_challenge": challenge.decode("ascii"),
        "code_challenge_method": "S256",
    }
    audience = oauth.audience()
    if audience is not None:
        query["resource"] = audience
    response = RedirectResponse(f"{endpoints.authorization_endpoint}?{urlencode(query)}", status_code=303)
    response.set_cookie(
        _pending_cookie(access),
        _seal(access, pending),
        max_age=PENDING_LIFETIME,
        httponly=True,
        samesite="lax",
        secure=_secure(access, request),
        path=CALLBACK_PATH,
    )
    return response


async def callback(request: Request) -> Response:
    """Back from the provider: the code for a token, the token checked, an operator signed in."""
    access: Access = request.app.state.access
    oauth = _provider(access)
    pending = _unseal(access, request.cookies.get(_pending_cookie(access), ""))
    if pending is None or not secrets.compare_digest(
        str(pending.get("s", "")), request.query_params.get("state", "")
    ):
        raise Denied(400, "This sign-in has expired or did not start at this console: sign in again.")
    if "error" in request.query_params:
        said = request.query_params.get("error_description") or request.query_params["error"]
        raise Denied(403, f"The identity provider did not sign you in: {said}")
    token = await _exchange(request, oauth, str(pending["v"]))
    try:
        caller = await oauth.verify(token)
    except Refused as exc:
        raise Denied(401, f"The identity provider's token was refused: {exc}.") from None
    identity = access.operator_identity(caller, secrets.token_hex(16))
    now = time.time()
    lifetime = min(COOKIE_LIFETIME, (caller.expires_at or now) - now)
    back = "/" + str(pending.get("n", "/")).lstrip("/\\")  # a path of this console only
    response = render(request, "continue.html", title="Signed in", target=back, name=identity.name)
    response.set_cookie(
        access.cookie,
        access.cookie_value(identity, now, lifetime),
        max_age=max(int(lifetime), 0),
        httponly=True,
        samesite="strict",
        secure=_secure(access, request),
        path="/",
    )
    response.delete_cookie(_pending_cookie(access), path=CALLBACK_PATH)
    return response


async def _exchange(request: Request, oauth: OAuthVerifier, verifier: str) -> str:
    endpoints = await _endpoints(oauth)
    assert endpoints.token_endpoint is not None  # _endpoints made sure
    form = {
        "grant_type": "authorization_code",
        "code": request.query_params.get("code", ""),
        "redirect_uri": _redirect_uri(request),
        "client_id": str(oauth.policy.console_client_id),
        "code_verifier": verifier,
    }
    audience = oauth.audience()
    if audience is not None:
        form["resource"] = audience
    try:
        async with httpx2.AsyncClient(timeout=TOKEN_TIMEOUT, follow_redirects=False) as client:
            answer = await client.post(endpoints.token_endpoint, data=form)
        body = answer.json()
    except (httpx2.HTTPError, ValueError) as exc:
        raise Denied(503, f"The identity provider's token endpoint failed: {type(exc).__name__}.") from None
    token = body.get("access_token") if isinstance(body, dict) else None
    if answer.status_code != 200 or not isinstance(token, str):
        said = body.get("error_description") or body.get("error") if isinstance(body, dict) else None
        raise Denied(401, f"The identity provider gave no access token: {said or answer.status_code}.")
    return token


async def sign_out(request: Request) -> Response:
    """End this sign-in: its cookie is refused from now on, even if someone kept a copy."""
    await checked_form(request)
    access: Access = request.app.state.access
    access.signed_out.add(request.state.identity.session)
    request.state.identity = None  # the page says so: no navigation, no name
    response = render(
        request, "signed_out.html", title="Signed out", sign_in=LOGIN_PATH if signs_in(access) else ""
    )
    response.delete_cookie(access.cookie, path="/")
    return response


def _seal(access: Access, data: dict[str, Any]) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(data).encode("utf-8")).decode("ascii")
    return f"{payload}.{access.sign('signin.' + payload)}"


def _unseal(access: Access, value: str) -> dict[str, Any] | None:
    payload, _, signature = value.partition(".")
    if not payload or not secrets.compare_digest(signature, access.sign("signin." + payload)):
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(payload.encode("ascii")))
    except ValueError:
        return None
    if not isinstance(data, dict) or float(data.get("x", 0)) < time.time():
        return None
    return data


SIGN_IN_ROUTES = [
    Route(LOGIN_PATH, login, methods=["GET"]),
    Route(CALLBACK_PATH, callback, methods=["GET"]),
    Route(SIGN_OUT_PATH, sign_out, methods=["POST"]),
]
