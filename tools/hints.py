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
