"""Bearer tokens for the HTTP transports: `[[auth.tokens]]` and `[auth.oauth]` → principals (docs/policy.md#auth).

The table of static tokens lives in the policy layer (policy/tokens.py), shared with the console;
JWT access tokens of an identity provider are checked by oauth.py. Either way the principal becomes
`AccessToken.client_id`, which the MCP surface reads as the caller's identity (and so as part of
every ledger key), and the role its one scope. `AuthGate` then admits each role where it belongs:
agents on MCP only, operators on `/metrics` only; it answers 401 (saying where to get a token when
`[auth.oauth]` is set) and 403 itself, before anything else reads the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from mcp.server.auth.middleware.auth_context import AuthContextMiddleware, get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend
from starlette.datastructures import Headers
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from commitgate.server.policy.models import AuthPolicy
from commitgate.server.policy.oauth import OAuthPolicy
from commitgate.server.policy.tokens import AuthConfigError, Holder, TokenTable, digest, load_tokens
from commitgate.server.serve.oauth import Caller, OAuthVerifier, Refused

__all__ = [
    "AuthConfigError",
    "AuthGate",
    "PolicyTokenVerifier",
    "TokenTable",
    "load_tokens",
    "principal_of_request",
]

log = logging.getLogger("commitgate.auth")
METADATA_PATH = "/.well-known/oauth-protected-resource"


class PolicyTokenVerifier:
    """The live policy's `[auth]`: its static tokens, and its provider's access tokens when configured.

    A reloaded policy brings its tokens with it; a reload whose tokens cannot be loaded (say, an
    unset variable) keeps the previous table and logs why. `[auth.oauth]` is read at start: the
    routes it adds cannot change while serving, so an edit of it waits for a restart (logged).
    """

    def __init__(
        self,
        auth_of: Callable[[], AuthPolicy | None],
        environ: Mapping[str, str] | None = None,
        oauth: OAuthVerifier | None = None,
    ):
        self._auth_of = auth_of
        self._environ = environ
        self._source = auth_of()
        self.table = load_tokens(self._source, environ)  # the table we start with must load
        if oauth is None and self._source is not None and self._source.oauth is not None:
            oauth = OAuthVerifier(self._source.oauth)
        self.oauth = oauth

    def __bool__(self) -> bool:
        return bool(self.table) or self.oauth is not None

    def _current(self) -> TokenTable:
        source = self._auth_of()
        if source is not self._source:
            self._source = source
            try:
                self.table = load_tokens(source, self._environ)
            except AuthConfigError as exc:
                log.error("keeping the previous tokens: %s", exc)
            edited = source.oauth if source is not None else None
            if edited != (self.oauth.policy if self.oauth is not None else None):
                log.warning("[auth.oauth] changed: restart the server to apply it; the previous one serves")
        return self.table

    def holder_of(self, token: str) -> Holder | None:
        return self._current().holder_of(token)

    async def caller_of(self, token: str, resource: str | None = None) -> Caller | None:
        """Who `token` speaks for: a static token's holder, else a valid access token's caller.

        `resource`: the URL this request was sent to, the audience when none is configured. A refused
        access token is logged with its reason (never the token) and answers None.
        """
        holder = self.holder_of(token)
        if holder is not None:
            return Caller(holder.principal, holder.role, holder.sees)
        if self.oauth is None or token.count(".") != 2:
            return None
        try:
            return await self.oauth.verify(token, resource)
        except Refused as exc:
            log.warning("refused an access token: %s", exc)
        except Exception as exc:  # a malformed token must never fail the request with anything but 401
            log.warning("refused an access token: cannot read it (%s)", type(exc).__name__)
        return None

    async def verify_token(self, token: str) -> AccessToken | None:
        caller = await self.caller_of(token)
        return None if caller is None else access_token(token, caller)


def access_token(token: str, caller: Caller) -> AccessToken:
    # The secret itself never travels further (nor upstream): the SDK only needs an identity and its role.
    return AccessToken(
        token="sha256:" + digest(token).hex()[:16],
        client_id=caller.principal,
        scopes=[caller.role] if caller.role is not None else [],
        subject=caller.principal,
    )


class BearerBackend(AuthenticationBackend):
    """Starlette's authentication backend over the verifier: the request's user is the caller."""

    def __init__(self, verifier: PolicyTokenVerifier, resource_path: str) -> None:
        self.verifier = verifier
        self.resource_path = resource_path

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, AuthenticatedUser] | None:
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        caller = await self.verifier.caller_of(
            token.strip(), request_resource(conn.scope, self.resource_path)
        )
        if caller is None:
            return None
        # `request.state.sees`: the principals an operator's token may see (what /metrics shows it)
        conn.scope.setdefault("state", {})["sees"] = caller.sees
        issued = access_token(token.strip(), caller)
        return AuthCredentials(issued.scopes), AuthenticatedUser(issued)


def request_resource(scope: Scope, path: str) -> str:
    """The URL of this server's MCP endpoint as the request names it (used on loopback without `resource`)."""
    host = Headers(scope=scope).get("host", "")
    return f"{scope.get('scheme', 'http')}://{host}{path}"


OPERATOR_PATHS = ("/metrics",)  # everything else but the open paths is MCP: agents only
OPEN_PATHS = ("/healthz",)
REFUSALS = {
    "operator": "this is an operator's token: operators use the console and /metrics, not MCP;"
    ' an agent calls with a token of its own ([[auth.tokens]] without role = "operator", or an'
    " access token with the agent's scope)",
    "agent": "this is an agent's token: agents call MCP and nothing else; /metrics needs an operator's"
    ' token ([[auth.tokens]] with role = "operator", or an access token with the operator\'s scope)',
}


class AuthGate:
    """ASGI middleware behind the authentication: who may reach which path.

    No valid token: 401 (with where to get one under `[auth.oauth]`). A token of the other role: 403.
    A valid access token with neither role's scope: 403 `insufficient_scope`, naming the scope.
    """

    def __init__(self, app: ASGIApp, oauth: OAuthPolicy | None, resource_path: str) -> None:
        self.app = app
        self.oauth = oauth
        self.resource_path = resource_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(METADATA_PATH):
            await self.app(scope, receive, send)
            return
        wanted = "operator" if path in OPERATOR_PATHS else "agent"
        user = scope.get("user")
        if not isinstance(user, AuthenticatedUser):
            await self._refuse(scope, receive, send, 401, "invalid_token", "Authentication required")
        elif wanted in user.scopes:
            await self.app(scope, receive, send)
        elif user.scopes:  # the other role
            body = {"error": "forbidden", "error_description": REFUSALS[user.scopes[0]]}
            await JSONResponse(body, status_code=403)(scope, receive, send)
        else:
            needed = self._scope_of(wanted)
            await self._refuse(
                scope,
                receive,
                send,
                403,
                "insufficient_scope",
                f"this token lacks the scope {needed!r}",
                needed,
            )

    def _scope_of(self, role: str) -> str:
        if self.oauth is None:
            return role
        return self.oauth.operator_scope if role == "operator" else self.oauth.agent_scope

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, error: str, why: str, needed: str = ""
    ) -> None:
        parts = [f'error="{error}"', f'error_description="{why}"']
        if needed:
            parts.append(f'scope="{needed}"')
        if self.oauth is not None:
            resource = self.oauth.resource or request_resource(scope, self.resource_path)
            parts.append(f'resource_metadata="{metadata_url(resource)}"')
        response = JSONResponse({"error": error, "error_description": why}, status_code=status)
        response.headers["WWW-Authenticate"] = "Bearer " + ", ".join(parts)
        await response(scope, receive, send)


def metadata_url(resource: str) -> str:
    """RFC 9728 3.1: the well-known path goes between the host and the resource's path."""
    parts = urlsplit(resource)
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{METADATA_PATH}{path}"


def metadata_routes(oauth: OAuthPolicy, resource_path: str) -> list[Route]:
    """RFC 9728 protected-resource metadata, at the well-known path alone and with the resource's path.

    Only the agent's scope is listed: an MCP client asks for the scopes listed here, and a token that
    also carried the operator's scope would be an operator's, refused on MCP.
    """

    async def metadata(request: Request) -> Response:
        resource = oauth.resource or request_resource(request.scope, resource_path)
        body = {
            "resource": resource,
            "authorization_servers": [oauth.issuer],
            "scopes_supported": [oauth.agent_scope],
            "bearer_methods_supported": ["header"],
        }
        return JSONResponse(
            body, headers={"Access-Control-Allow-Origin": "*", "Cache-Control": "max-age=300"}
        )

    suffixes = {resource_path, urlsplit(oauth.resource).path.rstrip("/") if oauth.resource else ""}
    paths = [METADATA_PATH] + [METADATA_PATH + s for s in sorted(suffixes) if s]
    return [Route(path, metadata, methods=["GET"]) for path in paths]


def install_auth(app: Starlette, verifier: PolicyTokenVerifier, resource_path: str) -> None:
    """Authentication, the SDK's auth context, then the gate: the gate runs last of the three."""
    oauth = verifier.oauth.policy if verifier.oauth is not None else None
    app.add_middleware(AuthGate, oauth=oauth, resource_path=resource_path)
    app.add_middleware(AuthContextMiddleware)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend(verifier, resource_path))


def principal_of_request() -> str | None:
    """The identity behind the bearer token on HTTP transports; None on stdio (the gateway's default)."""
    token = get_access_token()
    return token.client_id if token is not None else None
