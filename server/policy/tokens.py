"""Bearer tokens of `[[auth.tokens]]` as a table of digests → principals (docs/policy.md#auth).

Only SHA-256 digests are kept in memory: a `token_env` secret is hashed once at
load time, a `token_sha256` entry is its digest already. A presented token is
hashed and compared with every entry by `hmac.compare_digest`, without an early
exit, so the time taken says nothing about which entry (or how much of one)
matched. The HTTP transports and the console both check tokens with this table.

Each entry has a role: an agent's token calls MCP, an operator's token signs in to the
console and reads `/metrics` (docs/policy.md#auth); each surface refuses the other role.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from commitgate.server.policy.models import AuthPolicy, AuthToken
from commitgate.server.policy.problems import Problem

Role = Literal["agent", "operator"]

MIN_TOKEN_LENGTH = 16
TOKEN_HINT = "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class AuthConfigError(Exception):
    """The `[auth]` section cannot be used; the message lists every problem with its location."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("[auth] cannot be used:\n" + "\n".join(f"  {p}" for p in problems))


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a token: an agent's principal, or an operator and the principals it sees (None: all)."""

    principal: str
    role: Role = "agent"
    sees: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    holder: Holder


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def token_key(token: AuthToken) -> str:
    """Which token an entry names, as far as the policy alone tells: its digest (hex digits in either
    case are the same digest) or the variable that holds it."""
    return f"sha256:{token.token_sha256.lower()}" if token.token_sha256 else f"env:{token.token_env}"


def holder_of_entry(token: AuthToken) -> Holder:
    return Holder(token.principal, token.role, token.sees)


def _given_twice(other: Holder) -> str:
    return f"the same token is also given to {other.role} {other.principal!r}"


def shared_token_problems(auth: AuthPolicy | None) -> list[Problem]:
    """Entries naming one token for two holders (`policy check` finds them, as `serve` would)."""
    owners: dict[str, Holder] = {}
    problems = []
    for i, item in enumerate(auth.tokens if auth else []):
        holder = holder_of_entry(item)
        other = owners.setdefault(token_key(item), holder)
        if other != holder:
            problems.append(Problem(f"auth.tokens[{i}]", _given_twice(other)))
    return problems


@dataclass(frozen=True, slots=True)
class TokenTable:
    entries: tuple[_Entry, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def holder_of(self, token: str) -> Holder | None:
        presented = digest(token)
        found: Holder | None = None
        for entry in self.entries:  # no early exit: every entry is compared every time
            if hmac.compare_digest(presented, entry.digest) and found is None:
                found = entry.holder
        return found

    def has(self, role: Role) -> bool:
        return any(entry.holder.role == role for entry in self.entries)


def load_tokens(auth: AuthPolicy | None, environ: Mapping[str, str] | None = None) -> TokenTable:
    """The table for a policy's `[auth]`; empty when there is none. Raises AuthConfigError."""
    if auth is None:
        return TokenTable()
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    entries: list[_Entry] = []
    owners: dict[bytes, Holder] = {}
    for i, item in enumerate(auth.tokens):
        where = f"auth.tokens[{i}]"
        if not item.principal.strip():
            problems.append(f"{where}.principal: must not be empty")
            continue
        if item.token_sha256 is not None:
            value = bytes.fromhex(item.token_sha256)
        else:
            assert item.token_env is not None  # the policy model guarantees exactly one
            secret = environ.get(item.token_env, "").strip()
            if not secret:
                problems.append(
                    f"{where}.token_env: environment variable {item.token_env} is not set or empty"
                )
                continue
            if len(secret) < MIN_TOKEN_LENGTH:
                problems.append(
                    f"{where}.token_env: the token in {item.token_env} is shorter than "
                    f"{MIN_TOKEN_LENGTH} characters; {TOKEN_HINT}"
                )
                continue
            value = digest(secret)
        holder = holder_of_entry(item)
        other = owners.get(value)
        if other is not None and other != holder:
            problems.append(f"{where}: {_given_twice(other)}")
            continue
        owners[value] = holder
        entries.append(_Entry(value, holder))
    if problems:
        raise AuthConfigError(problems)
    return TokenTable(tuple(entries))
