"""The tools/call path of streamable HTTP finds a tool's input schema without a whole tools/list.

The SDK checks a 2026-07-28 tools/call's `Mcp-Param-*` headers against the called tool's schema
before dispatch. Given no lookup, it runs the server's tools/list handler (through every middleware)
on every call; commitgate gives it the schemas of the listing, kept per policy generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.envelope import Generation
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.surface import build_server

POLICY = """
[tools.charge_card]
class = "key-required"
python = "commitgate.server.demo.tools:charge_card"
"""

pytestmark = pytest.mark.anyio


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    policy = loads_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    gw = await Gateway.open(policy, None)
    try:
        yield gw
    finally:
        await gw.close()


async def test_the_schema_lookup_answers_what_tools_list_lists(gateway: Gateway) -> None:
    server = build_server(gateway)
    lookup = server.get_tool_input_schema
    assert lookup is not None  # else the SDK runs tools/list on every tools/call
    listed = {tool.name: tool.input_schema for tool in gateway.list_tools()}
    assert "charge_card" in listed and "get_operation_status" in listed
    for name, schema in listed.items():
        assert lookup(name) == schema, name
    assert "idempotency_key" in lookup("charge_card")["properties"]  # type: ignore[index]
    assert lookup("no_such_tool") is None  # nothing to validate: the dispatch answers "Unknown tool"


async def test_the_schema_lookup_follows_a_reload(gateway: Gateway) -> None:
    lookup = build_server(gateway).get_tool_input_schema
    assert lookup is not None and lookup("charge_card") is not None
    gateway.generation = Generation.of(gateway.policy, {})  # a policy without the tool
    assert lookup("charge_card") is None
    assert lookup("get_operation_status") is not None  # the meta tools stay
