"""The meta tools every gateway offers beside the policy's tools: what they accept and how they are listed.

Their answers are the gateway's (gateway.py); the definitions sit here, below the call envelope
that names them, so that every layer can tell a meta tool from a served one.
"""

from __future__ import annotations

from typing import Annotated

import mcp.types as types
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from commitgate.server.core.requests import printable
from commitgate.server.model.facts import State


def _printable(value: str | None) -> str | None:
    if value is not None and not printable(value):
        raise ValueError("printable characters only (no control characters, newlines or NUL)")
    return value


def _all_printable(values: list[str] | None) -> list[str] | None:
    for value in values or []:
        _printable(value)
    return values


Printable = Annotated[str | None, AfterValidator(_printable)]


class StatusArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    idempotency_key: Printable = Field(None, min_length=1, max_length=255)
    session: Printable = Field(None, min_length=1, max_length=255)
    operation_id: Printable = Field(None, min_length=1, max_length=100)


class ListArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session: Printable = Field(None, min_length=1, max_length=255)
    state: State | None = None
    tool: Printable = Field(None, min_length=1, max_length=128)
    limit: int = Field(50, ge=1)


class CompensateArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session: Printable = Field(None, min_length=1, max_length=255)
    idempotency_keys: Annotated[list[str] | None, AfterValidator(_all_printable)] = Field(None, min_length=1)
    reason: str | None = Field(None, max_length=1000)


def _meta_tool(name: str, description: str, model: type[BaseModel], read_only: bool = True) -> types.Tool:
    schema = model.model_json_schema()
    schema.pop("title", None)
    return types.Tool(
        name=name,
        description=description,
        input_schema=schema,
        annotations=types.ToolAnnotations(
            read_only_hint=read_only, idempotent_hint=True, destructive_hint=not read_only
        ),
    )


META_TOOLS: dict[str, types.Tool] = {
    "get_operation_status": _meta_tool(
        "get_operation_status",
        "Look up an operation you started: pass its idempotency_key (and session if you set one) or its "
        "operation_id. Answers its state, result or error, and retry_advice: 'done', 'wait_and_poll', "
        "'safe_to_retry_same_key' or 'do_not_retry'. Poll this instead of calling a tool again.",
        StatusArgs,
    ),
    "list_operations": _meta_tool(
        "list_operations",
        "List the operations you already ran, newest first (optionally of one session, state or tool): "
        "how to find out what was already done after losing track.",
        ListArgs,
    ),
    "compensate_session": _meta_tool(
        "compensate_session",
        "Undo what a session did: runs the declared compensating action (cancel, refund, release...) of each "
        "succeeded compensable operation, newest first, each exactly once (calling this again never undoes "
        "twice; it finishes what is left). Optionally only the given idempotency_keys. Use it when a later step "
        "failed and the earlier ones must not stand; do not retry the failed forward calls instead.",
        CompensateArgs,
        read_only=False,
    ),
}
