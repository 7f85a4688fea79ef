"""Bearer tokens for the HTTP transports: `[[auth.tokens]]` → principals (docs/policy.md#auth).

The table of digests lives in the policy layer (policy/tokens.py), shared with the
console. The principal a token maps to becomes `AccessToken.client_id`, which
the MCP surface reads as the caller's identity (and so as part of every ledger
key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken

from commitgate.server.policy.models import AuthPolicy
from commitgate.server.policy.tokens import AuthConfigError, TokenTable, digest, load_tokens

__all__ = ["AuthConfigError", "PolicyTokenVerifier", "TokenTable", "load_tokens", "principal_of_request"]

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

    async def verify_token(self, token: str) -> AccessToken | None:
        principal = self._current().principal_for(token)
        if principal is None:
            return None
        # The secret itself never travels further: the SDK only needs an identity.
        return AccessToken(
            token="sha256:" + digest(token).hex()[:16], client_id=principal, scopes=[], subject=principal
        )


def principal_of_request() -> str | None:
    """The identity behind the bearer token on HTTP transports; None on stdio (the gateway's default)."""
    token = get_access_token()
    return token.client_id if token is not None else None
