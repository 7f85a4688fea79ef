"""What an MCP tool's own annotations say about how commitgate should guard it (docs/policy.md).

Annotations are hints from the server, not guarantees: they may only make commitgate more
careful. A tool that declares `readOnlyHint: true` may be retried blindly; anything else (no
annotations, `readOnlyHint: false`, `idempotentHint` alone) could repeat an effect and needs a key.

`policy init` reads one thing more, for a tool that declares nothing: a name that reads as a query
(`get_user`, `listTables`, `search.issues`) with no word of a write in it is proposed `safe-retry`,
and says so (docs/wrapping.md). `tools = "all"` serves tools nobody has looked at, so it keeps to
the annotations alone.
"""

from __future__ import annotations

import re
from typing import Literal

import mcp.types as types

from commitgate.server.model.facts import IdempotencyClass

# A name's first word that reads as a query ...
QUERY_VERBS = frozenset(
    {"get", "list", "search", "read", "describe", "show", "find", "query", "lookup", "count", "fetch"}
)
# ... and words that say it may write, anywhere in the name (more than enough: one too many only
# asks for a key where none was needed).
WRITE_WORDS = frozenset(
    {
        "create", "update", "delete", "write", "set", "add", "remove", "send", "post", "put", "patch",
        "run", "exec", "apply", "commit", "move", "merge", "push",
        "insert", "upsert", "replace", "rename", "edit", "modify", "save", "upload", "submit", "cancel",
        "execute", "invoke", "trigger", "kill", "drop", "truncate", "clear", "reset", "purge", "archive",
        "restore", "assign", "approve", "reject", "grant", "revoke", "publish", "deploy", "install",
        "uninstall", "transfer", "pay", "subscribe", "unsubscribe", "enable", "disable", "mutate",
    }
)  # fmt: skip
# Words of a name: split on `_`, `-`, `.`, spaces and case changes (`getHTTPStatus` = get, http, status).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

Source = Literal["annotations", "name", "default"]


def declared_read_only(annotations: types.ToolAnnotations | None) -> bool:
    return annotations is not None and annotations.read_only_hint is True


def declares_nothing(annotations: types.ToolAnnotations | None) -> bool:
    """No `readOnlyHint` either way and no `destructiveHint: true`: only the name can say more."""
    return annotations is None or (
        annotations.read_only_hint is None and annotations.destructive_hint is not True
    )


def name_words(name: str) -> list[str]:
    return [word.lower() for part in re.split(r"[_\-.\s]+", name) for word in _WORD.findall(part)]


def query_verb(name: str) -> str | None:
    """The name's first word when it is a query verb, else None."""
    words = name_words(name)
    return words[0] if words and words[0] in QUERY_VERBS else None


def write_word(name: str) -> str | None:
    """The first word of the name that says it may write, else None."""
    return next((word for word in name_words(name) if word in WRITE_WORDS), None)


def reads_by_name(name: str) -> bool:
    return query_verb(name) is not None and write_word(name) is None


def class_source(annotations: types.ToolAnnotations | None, name: str | None) -> Source:
    """What decides the proposed class: the annotations, the name (init only), or the careful default."""
    if declared_read_only(annotations) or not declares_nothing(annotations):
        return "annotations"
    return "name" if name is not None and query_verb(name) is not None else "default"


def proposed_class(annotations: types.ToolAnnotations | None, name: str | None = None) -> str:
    """The idempotency class a tool's annotations give: `safe-retry` only for a declared read, or,
    when a `name` is given and the tool declares nothing, for a name that reads as a query."""
    if declared_read_only(annotations):
        return IdempotencyClass.SAFE_RETRY.value
    if name is not None and declares_nothing(annotations) and reads_by_name(name):
        return IdempotencyClass.SAFE_RETRY.value
    return IdempotencyClass.KEY_REQUIRED.value


def class_warnings(cls: str, declared: types.Tool | None) -> list[str]:
    """What is risky in serving the upstream tool `declared` with class `cls` (None: not listed yet)."""
    if (
        declared is None
        or cls != IdempotencyClass.SAFE_RETRY.value
        or declared_read_only(declared.annotations)
    ):
        return []
    return [
        f"{declared.name} is served as safe-retry, but its server does not declare it read-only "
        "(readOnlyHint: true): safe-retry calls are retried blindly and may repeat its effect; "
        'give it class = "key-required" unless it changes nothing'
    ]
