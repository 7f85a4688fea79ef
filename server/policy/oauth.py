"""`[auth.oauth]`: identities from the team's OAuth / OpenID provider (docs/policy.md#authoauth).

The server is an OAuth 2.1 resource server as the MCP authorization spec describes it: it accepts
JWT access tokens its issuer signed for it, and tells clients where to get one. Each key checks
what it can tell alone; that `resource` is needed off loopback is decided when the server binds.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A scope token of RFC 6749 3.3: printable ASCII, no space, quote or backslash.
_SCOPE = re.compile(r"[\x21\x23-\x5B\x5D-\x7E]+")
_CLAIM = re.compile(r"[^\s]+")


def http_url(value: str, example: str) -> str:
    """`value` if it is an absolute http(s) URL without a fragment; ValueError saying why otherwise."""
    try:
        parts = urlsplit(value)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL such as {example}, not {value!r}")
    if parts.fragment or parts.query:
        raise ValueError(f"must not carry a query or a fragment: {value!r}")
    return value


class OAuthPolicy(BaseModel):
    """Access tokens from the team's identity provider, beside (or instead of) `[[auth.tokens]]`."""

    model_config = ConfigDict(extra="forbid")

    issuer: str = Field(
        description="The provider's issuer URL, exactly as its tokens' `iss` claim spells it.",
        json_schema_extra={"examples": ["https://idp.example.com/realms/team"]},
    )
    resource: str | None = Field(
        None,
        description="The public URL of this server's /mcp (the RFC 8707 resource clients ask tokens for);"
        " required unless the server listens on loopback.",
    )
    audience: str | None = Field(
        None, description="What the tokens' `aud` claim must contain (default: `resource`)."
    )
    jwks_url: str | None = Field(
        None,
        description="Where the provider's signing keys are (default: `jwks_uri` of the issuer's"
        " /.well-known/openid-configuration, else of its /.well-known/oauth-authorization-server).",
    )
    principal_claim: str = Field(
        "sub", min_length=1, description="The claim whose value is the caller's principal."
    )
    agent_scope: str = Field("mcp", description="The scope an agent's token carries to call MCP.")
    operator_scope: str = Field(
        "commitgate:operator",
        description="The scope of an operator's token: the console and /metrics, never MCP.",
    )
    operator_principals_claim: str | None = Field(
        None,
        description="A claim listing the principals an operator decides for (default: every principal).",
    )

    console_client_id: str | None = Field(
        None,
        min_length=1,
        description="The client the console signs operators in as (authorization code with PKCE, a"
        " public client whose redirect URI is the console's /oauth/callback); without it the console"
        " takes operators' access tokens only as a bearer header.",
    )

    @field_validator("issuer")
    @classmethod
    def _issuer_url(cls, value: str) -> str:
        return http_url(value, "https://idp.example.com/realms/team")

    @field_validator("resource")
    @classmethod
    def _resource_url(cls, value: str | None) -> str | None:
        return None if value is None else http_url(value, "https://mcp.example.com/mcp")

    @field_validator("jwks_url")
    @classmethod
    def _jwks_url(cls, value: str | None) -> str | None:
        return None if value is None else http_url(value, "https://idp.example.com/jwks")

    @field_validator("agent_scope", "operator_scope")
    @classmethod
    def _scope_name(cls, value: str) -> str:
        if not value:
            raise ValueError("a scope name must not be empty")
        if not _SCOPE.fullmatch(value):
            raise ValueError(f"{value!r} is not a scope name: no spaces, quotes or backslashes")
        return value

    @field_validator("principal_claim", "operator_principals_claim")
    @classmethod
    def _claim_name(cls, value: str | None) -> str | None:
        if value is not None and not _CLAIM.fullmatch(value):
            raise ValueError("a claim name is one word without spaces, such as sub or email")
        return value

    @field_validator("audience")
    @classmethod
    def _audience(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out to use `resource`)")
        return value

    @model_validator(mode="after")
    def _distinct_scopes(self) -> OAuthPolicy:
        if self.agent_scope == self.operator_scope:
            raise ValueError(
                f"agent_scope and operator_scope are both {self.agent_scope!r}: an operator must never be"
                " an agent, so give them different scopes"
            )
        return self
