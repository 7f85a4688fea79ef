"""What an MCP tool's own annotations say about how commitgate should guard it (docs/policy.md).

Annotations are hints from the server, not guarantees: they may only make commitgate more
careful. A tool that declares `readOnlyHint: true` may be retried blindly; anything else (no
annotations, `readOnlyHint: false`, `idempotentHint` alone) could repeat an effect and needs a key.
"""

from __future__ import annotations

import mcp.types as types

from commitgate.server.model.facts import IdempotencyClass


def declared_read_only(annotations: types.ToolAnnotations | None) -> bool:
    return annotations is not None and annotations.read_only_hint is True


def proposed_class(annotations: types.ToolAnnotations | None) -> str:
    """The idempotency class a tool's annotations give: `safe-retry` only for a declared read."""
    if declared_read_only(annotations):
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
