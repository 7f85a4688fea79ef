"""The test-only fault plan: off unless the process was started with a private token, and then exact.

Effects are counted in the demo tools' system of record (the sandbox store).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import MCPError

from commitgate.server.demo import tools as demo
from commitgate.server.ledger import OperationFilter
from commitgate.server.model.facts import State
from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.faults import CONTROL_TOOL, ENV_TOKEN, LOST_ANSWER_CODE
from commitgate.server.serve.gateway import Gateway

TOKEN = "a-private-token-of-some-length"
POLICY = """
[tools.charge_card]
class = "key-required"
python = "commitgate.server.demo.tools:charge_card"
retry = { attempts = 3, initial = "10ms", max = "20ms" }
"""
CHARGE = {"card": "4242", "amount_cents": 300}

pytestmark = pytest.mark.anyio


async def open_gateway(tmp_path: Path) -> Gateway:
    policy = loads_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    return await Gateway.open(policy, None)


@pytest.fixture
async def gateway(tmp_path: Path, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    gw = await open_gateway(tmp_path)
    try:
        yield gw
    finally:
        await gw.close()


async def charge(gw: Gateway, key: str, card: str = "4242") -> Any:
    call = gw.envelope("charge_card", {**CHARGE, "card": card, "idempotency_key": key}, {}, None)
    return (await gw.handler()(call)).result


async def control(gw: Gateway, token: str = TOKEN, **arguments: Any) -> Any:
    return (await gw.handler()(gw.envelope(CONTROL_TOOL, {"token": token, **arguments}, {}, None))).result


async def test_without_the_token_there_is_no_plan_and_no_control_tool(tmp_path: Path, sandbox: Path) -> None:
    os.environ.pop(ENV_TOKEN, None)
    gw = await open_gateway(tmp_path)
    try:
        assert gw.faults is None and gw.handler() == gw.reply
        assert not gw.has_tool(CONTROL_TOOL)
        assert CONTROL_TOOL not in {tool.name for tool in gw.list_tools()}
    finally:
        await gw.close()


async def test_a_short_token_does_not_enable_faults(
    tmp_path: Path, sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TOKEN, "short")
    gw = await open_gateway(tmp_path)
    try:
        assert gw.faults is None and not gw.has_tool(CONTROL_TOOL)
    finally:
        await gw.close()


async def test_the_token_leaves_the_environment_and_must_be_shown(gateway: Gateway) -> None:
    assert ENV_TOKEN not in os.environ  # tools and child processes never see it
    assert gateway.has_tool(CONTROL_TOOL)
    assert CONTROL_TOOL not in {tool.name for tool in gateway.list_tools()}
    refused = await control(
        gateway, token="a-guess-of-the-same-length!!", action="lose_answer", tool="charge_card"
    )
    assert refused.is_error
    assert (await control(gateway, action="counts")).structured_content["armed"]["lose_answer"] == {}


async def test_a_lost_answer_is_recorded_in_the_ledger_and_replayed(gateway: Gateway) -> None:
    await control(gateway, action="lose_answer", tool="charge_card")
    with pytest.raises(MCPError) as lost:
        await charge(gateway, "k-lost")
    assert lost.value.code == LOST_ANSWER_CODE
    assert demo.count("charges", idempotency_key="k-lost") == 1  # the tool ran; only its answer was lost
    (op,) = await gateway.ledger.find(OperationFilter(None, tool="charge_card"))
    assert op.state is State.SUCCEEDED
    again = await charge(gateway, "k-lost")
    assert not again.is_error and again.meta["commitgate/operation"]["replayed"] is True
    assert demo.count("charges", idempotency_key="k-lost") == 1


async def test_only_a_success_is_dropped(gateway: Gateway) -> None:
    await control(gateway, action="lose_answer", tool="charge_card")
    declined = await charge(gateway, "k-declined", card=demo.DECLINED_CARD)
    assert declined.is_error  # a failure passes through; the plan stays armed for the next success
    with pytest.raises(MCPError):
        await charge(gateway, "k-next")
    assert demo.count("charges") == 1


async def test_a_failure_before_the_call_executes_nothing_and_the_retry_runs_once(gateway: Gateway) -> None:
    await control(gateway, action="fail_before", tool="charge_card", times=2)
    answer = await charge(gateway, "k-before")
    assert not answer.is_error
    assert answer.meta["commitgate/operation"]["attempts"] == 3  # two injected failures, one real run
    assert demo.count("charges", idempotency_key="k-before") == 1
    counts = (await control(gateway, action="counts")).structured_content
    assert counts["invocations"] == {"charge_card": 1}


@pytest.mark.slow
async def test_a_served_control_call_with_a_wrong_token_is_a_clear_error_and_the_token_is_scrubbed(
    tmp_path: Path, sandbox: Path
) -> None:
    """Over a real server process: a tool error result (not JSON-RPC's internal error), and the
    token no longer readable in the process's environment block (/proc/PID/environ)."""
    from commitgate.server.verify.harness import start_gate

    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    async with start_gate(policy, tmp_path / "run") as gate:
        refused = await gate.client.call_tool(CONTROL_TOOL, {"token": "x" * 32, "action": "counts"})
        assert refused.is_error and refused.structured_content == {"error": "wrong or missing token"}
        (pid,) = [
            int(cmdline.parent.name)
            for cmdline in Path("/proc").glob("[0-9]*/cmdline")
            if str(tmp_path / "run") in cmdline.read_bytes().decode(errors="replace")
        ]
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert gate._token.encode() not in environ and ENV_TOKEN.encode() + b"=" in environ


@pytest.mark.slow
async def test_the_gate_counts_effects_of_a_tool_served_by_a_tools_all_upstream(tmp_path: Path) -> None:
    """A tool without a policy entry (`tools = "all"`) is known as the server serves it."""
    import json
    import sys

    from commitgate.server.verify.harness import start_gate

    log, server = tmp_path / "stub.jsonl", Path(__file__).parent / "support" / "upstream_server.py"
    log.touch()
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[upstreams.stub]\ncommand = "{sys.executable}"\nargs = ["{server}"]\n'
        f'env = {{ STUB_LOG = "{log}" }}\ntools = "all"\n'
    )
    async with start_gate(policy, tmp_path / "run") as gate:
        await gate.serving("record", 30.0)
        first = await gate.call("record", {"note": "once"}, key="k1", session="s")
        again = await gate.call("record", {"note": "once"}, key="k1", session="s")
        assert not first.is_error and not again.is_error
        await gate.assert_effects("record", exactly=1)
    assert [json.loads(line)["tool"] for line in log.read_text().splitlines()] == ["record"]
