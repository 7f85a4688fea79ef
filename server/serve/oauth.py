"""JWT access tokens of `[auth.oauth]`, checked against the issuer's published keys (docs/operating.md#identities-from-your-identity-provider).

What is accepted, and nothing else: a JWT signed with RS256, ES256 or EdDSA by a key of the
issuer's JWKS, whose `iss` is the issuer, whose `aud` contains the audience, with `exp` in the
future and any `nbf` past (60 s leeway each way). The cryptography is PyJWT's; this module only
chooses the key and reads the claims. Every refusal is a `Refused` with a one-line reason for the
log; the token itself is never put in a message.

The keys are fetched once and kept. A token naming a key id the set lacks (the provider rotated
its keys) makes the set be fetched again, at most once a minute, so junk tokens cannot turn the
server into a flood of requests to the provider; a set older than 15 minutes is fetched again
beside the next call, so a key the provider withdrew stops being trusted. A provider that cannot
be reached lets nobody in whose key is not already known (the last set it published stays), and
never raises anything but `Refused`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx2

from commitgate.server.policy.oauth import OAuthPolicy
from commitgate.server.policy.tokens import Role
from commitgate.server.serve.logs import extra

# PyJWT (and the X.509 half of cryptography it brings) is imported where a key or a token is read:
# every server imports this module for `Caller` and `Refused`, few have an [auth.oauth] to check.
if TYPE_CHECKING:
    import jwt
    from jwt.exceptions import PyJWTError

log = logging.getLogger("commitgate.auth")

ALGORITHMS = ("RS256", "ES256", "EdDSA")
KEY_TYPES = {"RS256": ("RSA", None), "ES256": ("EC", "P-256"), "EdDSA": ("OKP", "Ed25519")}
LEEWAY = 60  # seconds of clock skew allowed on exp, nbf and iat
MAX_TOKEN_CHARS = 8192  # far above any real access token; a larger one is refused unread
REFETCH_INTERVAL = 60.0  # an unknown key id fetches the keys again at most this often ...
RETRY_INTERVAL = 5.0  # ... and a fetch that failed is tried again after this long at the earliest
KEYS_MAX_AGE = 900.0  # a set older than this is fetched again (in the background) when next used
FETCH_TIMEOUT = 5.0
MAX_DOCUMENT_BYTES = 512 * 1024
MAX_PRINCIPAL_CHARS = 255


class Refused(Exception):
    """A token that is not accepted; the message is one line for the log and never holds the token."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a token speaks for: `role` None when it carries neither the agent's nor the operator's scope;
    `sees` the principals an operator decides for (None: every principal)."""

    principal: str
    role: Role | None
    sees: frozenset[str] | None = None
    expires_at: int | None = None


@dataclass(frozen=True, slots=True)
class Endpoints:
    """What the provider's metadata says (discovered once): its keys, and where a person signs in."""

    jwks_uri: str
    authorization_endpoint: str | None = None
    token_endpoint: str | None = None
    end_session_endpoint: str | None = None


def metadata_urls(issuer: str) -> list[str]:
    """OpenID discovery first, then the RFC 8414 form (`/.well-known/...` before the issuer's path)."""
    parts = urlsplit(issuer)
    path = parts.path.rstrip("/")
    return [
        issuer.rstrip("/") + "/.well-known/openid-configuration",
        f"{parts.scheme}://{parts.netloc}/.well-known/oauth-authorization-server{path}",
    ]


class ProviderKeys:
    """The issuer's JWKS, fetched when first needed and again for an unknown key id (rate-limited)."""

    def __init__(
        self,
        issuer: str,
        jwks_url: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        refetch_interval: float = REFETCH_INTERVAL,
    ) -> None:
        self.issuer = issuer
        self.jwks_url = jwks_url
        self.clock = clock
        self.refetch_interval = refetch_interval
        self.endpoints: Endpoints | None = None
        self.keys: dict[str | None, PublishedKey] = {}
        self.fetches = 0  # how many times the JWKS was fetched (the tests count them)
        self._next_fetch = float("-inf")
        self._fetched_at = float("-inf")
        self._renewal: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def key_for(self, kid: str | None, alg: str) -> jwt.PyJWK:
        key = self._usable(kid, alg)
        if key is not None:
            self._renew_if_old()
            return key
        async with self._lock:  # concurrent calls with the same new key id share one fetch
            key = self._usable(kid, alg)
            if key is None and self.clock() >= self._next_fetch:
                await self._refresh()
                key = self._usable(kid, alg)
        if key is None:
            raise Refused(f"no key {kid!r} for {alg} in the issuer's key set")
        return key

    def _renew_if_old(self) -> None:
        """A set older than KEYS_MAX_AGE is fetched again beside the call, which goes on with it: a key
        the provider withdrew stops being trusted, and a slow provider delays nobody."""
        now = self.clock()
        if now - self._fetched_at < KEYS_MAX_AGE or now < self._next_fetch or self._lock.locked():
            return
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        try:
            async with self._lock:
                if self.clock() >= self._next_fetch:
                    await self._refresh()
        except Exception as exc:  # nobody awaits this task: say what went wrong, keep the set
            log.warning("cannot fetch the issuer's keys: %s", type(exc).__name__)

    def _usable(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        if kid is not None:
            key = self.keys.get(kid)
            return key.jwk if key is not None and key.fits(alg) else None
        fitting = [k.jwk for k in self.keys.values() if k.fits(alg)]
        return fitting[0] if len(fitting) == 1 else None  # no key id: only an unambiguous key will do

    async def discover(self) -> Endpoints:
        """The provider's endpoints, from its metadata (or `jwks_url` alone when that is configured)."""
        if self.endpoints is not None:
            return self.endpoints
        async with httpx2.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=False) as client:
            problems: list[str] = []
            for url in metadata_urls(self.issuer):
                try:
                    document = await _get_json(client, url)
                except Refused as exc:
                    problems.append(str(exc))
                    continue
                if document.get("issuer") != self.issuer:
                    raise Refused(
                        f"the metadata at {url} names the issuer {document.get('issuer')!r}, not {self.issuer!r}"
                    )
                found = Endpoints(
                    jwks_uri=self.jwks_url or _url_in(document, "jwks_uri", url),
                    authorization_endpoint=_optional_url(document, "authorization_endpoint"),
                    token_endpoint=_optional_url(document, "token_endpoint"),
                    end_session_endpoint=_optional_url(document, "end_session_endpoint"),
                )
                self.endpoints = found
                return found
        if self.jwks_url is not None:  # metadata is optional when the keys' address is configured
            self.endpoints = Endpoints(jwks_uri=self.jwks_url)
            return self.endpoints
        raise Refused("cannot discover the issuer's keys: " + "; ".join(problems))

    async def _refresh(self) -> None:
        self._next_fetch = self.clock() + RETRY_INTERVAL
        try:
            endpoints = await self.discover()
            async with httpx2.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=False) as client:
                document = await _get_json(client, endpoints.jwks_uri)
        except Refused as exc:
            log.warning("cannot fetch the issuer's keys: %s", exc)
            return
        self.keys = parse_keys(document)
        self.fetches += 1
        self._fetched_at = self.clock()
        self._next_fetch = self.clock() + self.refetch_interval
        log.info("fetched the issuer's keys", extra=extra(keys=len(self.keys)))


@dataclass(frozen=True, slots=True)
class PublishedKey:
    """One key of the JWKS as published, and PyJWT's form of it."""

    data: Mapping[str, Any]
    jwk: jwt.PyJWK

    def fits(self, alg: str) -> bool:
        """Only a key of the algorithm's own type and curve, not marked for another use or algorithm."""
        kty, crv = KEY_TYPES[alg]
        if self.data.get("kty") != kty or (crv is not None and self.data.get("crv") != crv):
            return False
        return self.data.get("alg") in (None, alg) and self.data.get("use") in (None, "sig")


def parse_keys(document: Mapping[str, Any]) -> dict[str | None, PublishedKey]:
    import jwt
    from jwt.exceptions import PyJWKError, PyJWTError

    keys: dict[str | None, PublishedKey] = {}
    raw = document.get("keys")
    for entry in raw if isinstance(raw, list) else []:
        if not isinstance(entry, dict) or entry.get("kty") not in ("RSA", "EC", "OKP"):
            continue  # symmetric ("oct") keys are never used: HMAC tokens are refused
        if "d" in entry:
            continue  # a private key published by mistake is no key of ours to trust
        try:
            key = jwt.PyJWK(entry)
        except (PyJWKError, PyJWTError, ValueError, TypeError):
            continue
        keys[entry.get("kid") if isinstance(entry.get("kid"), str) else None] = PublishedKey(entry, key)
    return keys


async def _get_json(client: httpx2.AsyncClient, url: str) -> dict[str, Any]:
    try:
        async with client.stream("GET", url, headers={"Accept": "application/json"}) as response:
            if response.status_code != 200:
                raise Refused(f"{url} answered HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise Refused(f"{url} sent more than {MAX_DOCUMENT_BYTES} bytes")
    except httpx2.HTTPError as exc:
        raise Refused(f"cannot reach {url}: {type(exc).__name__} {exc}".strip()) from None
    try:
        document = json.loads(body)
    except ValueError:
        raise Refused(f"{url} did not send JSON") from None
    if not isinstance(document, dict):
        raise Refused(f"{url} did not send a JSON object")
    return document


def _url_in(document: Mapping[str, Any], name: str, where: str) -> str:
    value = _optional_url(document, name)
    if value is None:
        raise Refused(f"the metadata at {where} has no {name}")
    return value


def _optional_url(document: Mapping[str, Any], name: str) -> str | None:
    value = document.get(name)
    if isinstance(value, str) and urlsplit(value).scheme in ("http", "https"):
        return value
    return None


class OAuthVerifier:
    """Checks access tokens for one `[auth.oauth]` and says who they speak for."""

    def __init__(self, policy: OAuthPolicy, keys: ProviderKeys | None = None) -> None:
        self.policy = policy
        self.keys = keys or ProviderKeys(policy.issuer, policy.jwks_url)

    def audience(self, resource: str | None = None) -> str | None:
        """What `aud` must contain: the configured audience, else the resource (configured, else the
        one this request was sent to, for a server on loopback)."""
        return self.policy.audience or self.policy.resource or resource

    async def verify(self, token: str, resource: str | None = None) -> Caller:
        """The caller behind `token`; Refused with the reason otherwise."""
        audience = self.audience(resource)
        if audience is None:
            raise Refused(
                "[auth.oauth] has neither `audience` nor `resource` to check the token's aud against"
            )
        claims = await self._claims(token, audience)
        return self._caller(claims)

    async def _claims(self, token: str, audience: str) -> dict[str, Any]:
        if len(token) > MAX_TOKEN_CHARS:
            raise Refused(f"token longer than {MAX_TOKEN_CHARS} characters")
        import jwt
        from jwt.exceptions import PyJWTError

        try:
            header = jwt.get_unverified_header(token)
        except PyJWTError:
            raise Refused("not a JWT") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Refused(f"signed with {alg!r}; only {', '.join(ALGORITHMS)} are accepted")
        kid = header.get("kid")
        key = await self.keys.key_for(kid if isinstance(kid, str) else None, alg)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=audience,
                issuer=self.policy.issuer,
                leeway=LEEWAY,
                options={"require": ["exp", "iss", "aud"]},
            )
        except PyJWTError as exc:
            raise Refused(self._why(exc, kid, audience)) from None
        return claims

    def _why(self, exc: PyJWTError, kid: object, audience: str) -> str:
        """The one-line reason for a token PyJWT refused."""
        from jwt.exceptions import (
            ExpiredSignatureError,
            ImmatureSignatureError,
            InvalidAudienceError,
            InvalidIssuerError,
            InvalidSignatureError,
            MissingRequiredClaimError,
        )

        if isinstance(exc, ExpiredSignatureError):
            return "expired (exp is past)"
        if isinstance(exc, ImmatureSignatureError):
            return "not valid yet (nbf or iat is in the future)"
        if isinstance(exc, InvalidAudienceError):
            return f"issued for another audience (aud does not contain {audience!r})"
        if isinstance(exc, InvalidIssuerError):
            return f"issued by another issuer (iss is not {self.policy.issuer!r})"
        if isinstance(exc, InvalidSignatureError):
            return f"bad signature for key {kid!r}"
        if isinstance(exc, MissingRequiredClaimError):
            return f"the {exc.claim!r} claim is missing"
        return f"invalid JWT: {type(exc).__name__}"

    def _caller(self, claims: Mapping[str, Any]) -> Caller:
        name = self.policy.principal_claim
        principal = claims.get(name)
        if not isinstance(principal, str) or not principal.strip():
            raise Refused(f"the principal claim {name!r} is missing or not a string")
        if len(principal) > MAX_PRINCIPAL_CHARS:
            raise Refused(f"the principal claim {name!r} is longer than {MAX_PRINCIPAL_CHARS} characters")
        scopes = scopes_of(claims)
        expires = claims.get("exp")
        expires_at = int(expires) if isinstance(expires, int | float) else None
        if self.policy.operator_scope in scopes:
            return Caller(principal, "operator", self._sees(claims), expires_at)
        role: Role | None = "agent" if self.policy.agent_scope in scopes else None
        return Caller(principal, role, None, expires_at)

    def _sees(self, claims: Mapping[str, Any]) -> frozenset[str] | None:
        name = self.policy.operator_principals_claim
        if name is None:
            return None
        listed = claims.get(name)
        if isinstance(listed, str):
            listed = listed.split()
        if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise Refused(
                f"an operator's token without the {name!r} claim listing the principals it decides for"
            )
        return None if "*" in listed else frozenset(listed)


def scopes_of(claims: Mapping[str, Any]) -> set[str]:
    """`scope` (RFC 9068: one space-separated string) or `scp` (a list, as some providers send)."""
    found: set[str] = set()
    scope = claims.get("scope")
    if isinstance(scope, str):
        found.update(scope.split())
    scp = claims.get("scp")
    if isinstance(scp, str):
        found.update(scp.split())
    elif isinstance(scp, list):
        found.update(s for s in scp if isinstance(s, str))
    return found
