"""Asking the client's user for an approval, in either protocol era (docs/contract.md#approvals).

Handshake era: an `elicitation/create` request sent during the call (`elicit`). Protocol
2026-07-28 has no back-channel: the call answers an `InputRequiredResult` holding the
elicitation and a `requestState`; the client asks its user and calls again with the answer
(`answer`, `request_state`). The state names only the operation, and is sealed by the SDK's
request-state boundary; the gateway checks it against the ledger (the operation, its
principal, session, key, tool and arguments) before it counts the answer, so any replica
sharing the ledger and the sealing key can take the second round.

The surface puts one `ClientChannel` in each tools/call's envelope; the gateway reads it there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import mcp.types as types
from mcp.server import ServerRequestContext
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

log = logging.getLogger("commitgate.asking")

INPUT_KEY = "commitgate/approval"  # the key of our elicitation in input_requests / input_responses
STATE_PREFIX = "approval:"
# Several replicas behind one address: give each the same secret(s), comma separated, newest first.
KEYS_ENV = "COMMITGATE_REQUEST_STATE_KEYS"

# What the person fills in: nothing is required; a reason is kept with the decision.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "reason": {"type": "string", "title": "Reason (optional)", "description": "Kept with your decision."}
    },
}

Elicit = Callable[[str, dict[str, Any]], Awaitable[types.ElicitResult]]


@dataclass(frozen=True, slots=True)
class ClientChannel:
    """How the client of this call can be asked, and what it answered to an earlier round."""

    elicit: Elicit | None = None  # handshake era, the client declared elicitation
    multi_round: bool = False  # 2026-07-28, the client declared elicitation
    answer: types.ElicitResult | None = None  # its answer to our InputRequiredResult
    request_state: str | None = None  # unsealed by the SDK boundary

    @property
    def can_ask(self) -> bool:
        return self.elicit is not None or self.multi_round

    @property
    def answered_operation(self) -> str | None:
        state = self.request_state
        if state is None or not state.startswith(STATE_PREFIX):
            return None
        return state.removeprefix(STATE_PREFIX)


_ELICITATION = types.ClientCapabilities(elicitation=types.ElicitationCapability())


def channel_of(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> ClientChannel:
    """The channel of one tools/call, from its protocol era and the client's declared capabilities."""
    try:
        declared = ctx.session.check_client_capability(_ELICITATION)
    except Exception:  # no session (an in-process call): nobody to ask
        declared = False
    modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
    answer = _elicit_answer(params.input_responses)
    if not declared:
        return ClientChannel(answer=answer, request_state=params.request_state)
    if modern:
        return ClientChannel(multi_round=True, answer=answer, request_state=params.request_state)

    async def elicit(message: str, schema: dict[str, Any]) -> types.ElicitResult:
        return await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)

    return ClientChannel(elicit=elicit)


def _elicit_answer(responses: Any) -> types.ElicitResult | None:
    if not responses or INPUT_KEY not in responses:
        return None
    response = responses[INPUT_KEY]
    if isinstance(response, types.ElicitResult):
        return response
    try:  # the wire union may have parsed it as another result shape: read it as ours
        data = response.model_dump(by_alias=True) if hasattr(response, "model_dump") else response
        return types.ElicitResult.model_validate(data)
    except Exception:
        return None


class InputRequired(Exception):
    """The call's answer is this InputRequiredResult: the surface returns it as it is."""

    def __init__(self, result: types.InputRequiredResult) -> None:
        super().__init__("input required")
        self.result = result


def input_required(operation_id: str, message: str) -> types.InputRequiredResult:
    request = types.ElicitRequest(
        params=types.ElicitRequestFormParams(message=message, requested_schema=SCHEMA)
    )
    return types.InputRequiredResult(
        input_requests={INPUT_KEY: request}, request_state=STATE_PREFIX + operation_id
    )


def request_state_boundary(name: str, principal: Callable[[], str | None]) -> RequestStateBoundary:
    """Seals the request state; with `COMMITGATE_REQUEST_STATE_KEYS` every replica can open it."""
    keys = [k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()]
    bind: Callable[[ServerRequestContext[Any, Any]], str | None] = lambda _ctx: principal()  # noqa: E731
    if keys:
        security = RequestStateSecurity(keys=keys, bind_principal=bind)
    else:
        security = RequestStateSecurity(keys=[os.urandom(32)], bind_principal=bind)
    return RequestStateBoundary(security, default_audience=name)
