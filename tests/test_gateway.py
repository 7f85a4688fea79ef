"""The gateway in process: how a tools/call becomes a guarded call (session, key, arguments, limits).

Every refusal here must leave nothing in the ledger and nothing in the system of record; the
end-to-end suites check the same answers through real server processes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp.types import CallToolResult

from commitgate.server.demo import tools as demo
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.gateway import Gateway

pytestmark = pytest.mark.anyio

POLICY = Path(__file__).parent / "policies" / "demo_tools.toml"
CARD = "4242424242424242"


@pytest.fixture
async def gateway(tmp_path: Path, sandbox: Path) -> AsyncIterator[Gateway]:
    policy = load_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    policy.ledger.synchronous = "NORMAL"
    gw = await Gateway.open(policy, None)
    try:
        yield gw
    finally:
        await gw.close()


def code(result: CallToolResult) -> str | None:
    if not result.is_error:
        return None
    assert result.structured_content is not None
    return str(result.structured_content["error"]["code"])


def message(result: CallToolResult) -> str:
    assert result.structured_content is not None
    return str(result.structured_content["error"]["message"])


async def recorded(gateway: Gateway) -> int:
    return sum((await gateway.ledger.counts()).states.values())


def charge(**extra: Any) -> dict[str, Any]:
    return {"card": CARD, "amount_cents": 500, **extra}


async def test_a_key_in_the_arguments_and_another_in_meta_is_refused(gateway: Gateway) -> None:
    result = await gateway.call_tool(
        "charge_card", charge(idempotency_key="a-1"), {"commitgate/step": "a-2"}, "alice"
    )
    assert code(result) == "invalid_idempotency_key"
    assert "differ" in message(result)
    assert await recorded(gateway) == 0 and demo.count("charges") == 0


async def test_the_key_may_come_from_meta_alone_and_replays_under_the_argument(gateway: Gateway) -> None:
    first = await gateway.call_tool("charge_card", charge(), {"commitgate/step": "m-1"}, "alice")
    again = await gateway.call_tool("charge_card", charge(idempotency_key="m-1"), {}, "alice")
    assert code(first) is None and code(again) is None
    assert again.meta is not None and again.meta["commitgate/operation"]["replayed"] is True
    assert again.structured_content == first.structured_content
    assert demo.count("charges") == 1


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (7, "must be a string"),
        ("a" * 256, "at most 255"),
        ("bad key", "outside the allowed set"),
        ("k\n", "outside"),
    ],
)
async def test_malformed_keys_are_refused_before_anything_is_recorded(
    gateway: Gateway, key: object, why: str
) -> None:
    result = await gateway.call_tool("create_ticket", {"title": "t", "idempotency_key": key}, {}, "alice")
    assert code(result) == "invalid_idempotency_key" and why in message(result)
    assert await recorded(gateway) == 0 and demo.count("tickets") == 0


async def test_arguments_over_the_limit_are_measured_once_encoded_and_refused(gateway: Gateway) -> None:
    """The limit (2000 bytes in this policy) applies to the canonical JSON the ledger would keep."""
    fits = await gateway.call_tool(
        "create_ticket", {"title": "t", "body": "x" * 1900, "idempotency_key": "f"}, {}, "a"
    )
    over = await gateway.call_tool(
        "create_ticket", {"title": "t", "body": "x" * 2000, "idempotency_key": "o"}, {}, "a"
    )
    assert code(fits) is None
    assert code(over) == "invalid_arguments" and "at most 2000 are accepted" in message(over)
    assert demo.count("tickets") == 1 and await recorded(gateway) == 1


async def test_unknown_and_mistyped_arguments_name_the_field(gateway: Gateway) -> None:
    unknown = await gateway.call_tool(
        "create_ticket", {"title": "t", "colour": 1, "idempotency_key": "u"}, {}, "a"
    )
    mistyped = await gateway.call_tool(
        "charge_card", charge(amount_cents="lots", idempotency_key="m"), {}, "a"
    )
    assert code(unknown) == "invalid_arguments" and "colour: unknown argument" in message(unknown)
    assert code(mistyped) == "invalid_arguments" and "amount_cents" in message(mistyped)
    assert await recorded(gateway) == 0 and demo.count("charges") + demo.count("tickets") == 0


@pytest.mark.parametrize("session", [7, "", "s" * 256])
async def test_a_malformed_session_in_meta_is_refused(gateway: Gateway, session: object) -> None:
    result = await gateway.call_tool(
        "create_ticket", {"title": "t", "idempotency_key": "s"}, {"commitgate/session": session}, "a"
    )
    assert code(result) == "invalid_arguments" and "commitgate/session" in message(result)
    assert await recorded(gateway) == 0 and demo.count("tickets") == 0


async def test_the_session_comes_from_meta_and_keys_are_per_session_and_principal(gateway: Gateway) -> None:
    args = {"title": "t", "idempotency_key": "same"}
    for session, principal in [("s1", "alice"), ("s2", "alice"), ("s1", "bob"), ("s1", "alice")]:
        assert (
            code(await gateway.call_tool("create_ticket", args, {"commitgate/session": session}, principal))
            is None
        )
    assert demo.count("tickets") == 3  # the fourth call replays the first
    mine = await gateway.call_tool("list_operations", {}, {}, "bob")
    assert mine.structured_content is not None and len(mine.structured_content["operations"]) == 1


async def test_safe_retry_tools_take_no_key_and_record_nothing(gateway: Gateway) -> None:
    result = await gateway.call_tool("get_balance", {"card": CARD, "idempotency_key": "ignored"}, {}, "a")
    assert code(result) is None and await recorded(gateway) == 0
