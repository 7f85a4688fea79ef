"""Bearer tokens for the HTTP transports: `[[auth.tokens]]` → principals (docs/policy.md#auth).

The table of digests lives in the policy layer (policy/tokens.py), shared with the
console. The principal a token maps to becomes `AccessToken.client_id`, which
the MCP surface reads as the caller's identity (and so as part of every ledger
key). Each token's role decides where it is admitted (`RoleGate`): agents' tokens
on MCP only, operators' tokens on `/metrics` only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from commitgate.server.policy.models import AuthPolicy
from commitgate.server.policy.tokens import AuthConfigError, Holder, TokenTable, digest, load_tokens

__all__ = [
    "AuthConfigError",
    "PolicyTokenVerifier",
    "RoleGate",
    "TokenTable",
    "load_tokens",
    "principal_of_request",
]

log = logging.getLogger("commitgate.auth")


class PolicyTokenVerifier:
    """The MCP SDK's TokenVerifier over the live policy's `[auth]`.

    A reloaded policy brings its tokens with it; a reload whose tokens cannot be
    loaded (say, an unset variable) keeps the previous table and logs why.
    """

    def __init__(self, auth_of: Callable[[], AuthPolicy | None], environ: Mapping[str, str] | None = None):
        self._auth_of = auth_of
        self._environ = environ
        self._source = auth_of()
        self.table = load_tokens(self._source, environ)  # the table we start with must load

    def _current(self) -> TokenTable:
        source = self._auth_of()
        if source is not self._source:
            self._source = source
            try:
                self.table = load_tokens(source, self._environ)
            except AuthConfigError as exc:
                log.error("keeping the previous tokens: %s", exc)
        return self.table

    def holder_of(self, token: str) -> Holder | None:
        return self._current().holder_of(token)

    async def verify_token(self, token: str) -> AccessToken | None:
        holder = self.holder_of(token)
        if holder is None:
            return None
        # The secret itself never travels further: the SDK only needs an identity (and its role).
        return AccessToken(
            token="sha256:" + digest(token).hex()[:16],
            client_id=holder.principal,
            scopes=[holder.role],
            subject=holder.principal,
        )


OPERATOR_PATHS = ("/metrics",)  # everything else but /healthz is MCP: agents only
OPEN_PATHS = ("/healthz",)
REFUSALS = {
    "operator": "this is an operator's token: operators use the console and /metrics, not MCP;"
    ' an agent calls with a token of its own ([[auth.tokens]] without role = "operator")',
    "agent": "this is an agent's token: agents call MCP and nothing else; /metrics needs an operator's"
    ' token ([[auth.tokens]] with role = "operator")',
}


class RoleGate:
    """ASGI middleware: a known token on the wrong surface is refused (403) before anything reads it.

    Unknown or missing tokens pass on to the SDK's bearer check, which answers 401 as before.
    """

    def __init__(self, app: ASGIApp, verifier: PolicyTokenVerifier) -> None:
        self.app = app
        self.verifier = verifier

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            holder = self.verifier.holder_of(token.strip()) if scheme.lower() == "bearer" else None
            wanted = "operator" if scope["path"] in OPERATOR_PATHS else "agent"
            if holder is not None and holder.role != wanted:
                body = {"error": "forbidden", "error_description": REFUSALS[holder.role]}
                await JSONResponse(body, status_code=403)(scope, receive, send)
                return
            if holder is not None:  # `request.state.holder`: what an operator's token may see (/metrics)
                scope.setdefault("state", {})["holder"] = holder
        await self.app(scope, receive, send)


def principal_of_request() -> str | None:
    """The identity behind the bearer token on HTTP transports; None on stdio (the gateway's default)."""
    token = get_access_token()
    return token.client_id if token is not None else None
