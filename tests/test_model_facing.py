"""What the model reads: a real MCP client against a real `commitgate serve` over stdio.

Clients such as Claude Desktop show the model a result's content blocks, not its `_meta`; so
what the model must know (this was a replay; nothing matches that key; the record as JSON it
can read) has to be in the content, while the structured content stays what the contract says.
The tests that need no policy of their own share one server, each with keys and a session of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, TextContent
from support.e2e import Deployment, Server, new_id, operation, serve

from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.registry import definition_for
from commitgate.tools.base import ToolSource

pytestmark = pytest.mark.anyio

SAGA_TOOLS = """
[tools.reserve]
class = "compensable"
python = "commitgate.server.demo.tools:reserve"
compensate = { tool = "release", arguments = { booking_id = "{result.booking_id}" } }

[tools.release]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:release"
status_check = "commitgate.server.demo.tools:find_release"
expose = false
"""


def texts(result: CallToolResult) -> list[str]:
    return [block.text for block in result.content if isinstance(block, TextContent)]


def email(key: str) -> dict[str, Any]:
    return {"to": "a@example.com", "subject": "hi", "body": "hello", "idempotency_key": key}


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory, anyio_backend: str) -> AsyncIterator[Server]:
    """A server over the end-to-end tools with no policy of a test's own."""
    async with serve(Deployment.create(tmp_path_factory.mktemp("shared"))) as running:
        yield running


async def test_a_replay_says_in_words_that_nothing_ran_again(server: Server) -> None:
    d = server.deployment
    key, session = new_id("mail"), new_id("s")
    first = await server.call("send_email", email(key), session=session)
    again = await server.call("send_email", email(key), session=session)
    assert not first.is_error and not again.is_error
    assert operation(again)["replayed"] is True
    assert again.structured_content == first.structured_content
    assert again.content[: len(first.content)] == first.content  # the tool's own blocks, then the note
    note = texts(again)[-1]
    assert note.startswith(f"Already done at {operation(first)['completed_at']}")
    assert "nothing was executed again" in note and key in note
    assert not any("Already done" in t for t in texts(first))
    assert d.count("emails", idempotency_key=key, session=session) == 1


async def test_meta_tools_answer_readable_json_and_advice_when_nothing_is_found(server: Server) -> None:
    d = server.deployment
    key, session = new_id("mail"), new_id("s")
    await server.call("send_email", email(key), session=session)
    status = await server.call("get_operation_status", {"idempotency_key": key}, session=session)
    listing = await server.call("list_operations", {"session": session})
    missing = await server.call("get_operation_status", {"idempotency_key": "never-used"}, session=session)
    for result in (status, listing):
        text = texts(result)[0]
        assert '\\"' not in text, text  # no JSON escaped inside a JSON string
        json.loads(text)
    shown_status = json.loads(texts(status)[0])
    assert (
        shown_status["operation"]["result"]
        == status.structured_content["operation"]["result"]["structuredContent"]
    )
    assert missing.structured_content == {"found": False, "operation": None}
    advice = texts(missing)[-1]
    assert "never-used" in advice and "never started" in advice and "list_operations" in advice
    assert d.count("emails", idempotency_key=key, session=session) == 1


async def test_compensate_session_is_offered_only_when_a_tool_can_be_compensated(
    server: Server, tmp_path: Path
) -> None:
    names = {tool.name for tool in (await server.client.list_tools()).tools}  # no compensable tool
    with pytest.raises(MCPError, match="Unknown tool: compensate_session"):
        await server.call("compensate_session", {})
    assert "compensate_session" not in names and {"get_operation_status", "list_operations"} <= names
    saga = Deployment.create(tmp_path / "saga")
    saga.policy.write_text(saga.policy.read_text() + SAGA_TOOLS)
    async with serve(saga) as saga_server:
        names = {tool.name for tool in (await saga_server.client.list_tools()).tools}
    assert "compensate_session" in names


class _Source:
    def __init__(self, description: str) -> None:
        self.description = description
        self.input_schema: dict[str, Any] = {"type": "object", "properties": {}}
        self.output_schema = None


@pytest.mark.parametrize("written", ["Create an issue", "Create an issue  ", "Create an issue."])
def test_an_upstream_description_ends_its_sentence_before_the_key_sentence(written: str) -> None:
    policy = loads_policy('[tools.t]\nclass = "key-required"\nupstream = "u"\n[upstreams.u]\ncommand = "x"\n')
    description = definition_for("t", policy.tools["t"], cast(ToolSource, _Source(written))).description or ""
    assert description.startswith("Create an issue. Pass a new idempotency_key")


async def test_the_printed_claude_desktop_entry_starts_the_server_as_the_app_would(tmp_path: Path) -> None:
    """Command and args exactly as printed, in a small environment without this venv on PATH."""
    d = Deployment.create(tmp_path)
    d.policy.write_text(
        f'[ledger]\nurl = "sqlite:///{d.ledger}"\n'
        '[tools.send_email]\nclass = "key-required"\npython = "commitgate.server.demo.tools:send_email"\n'
    )
    printed = subprocess.run(
        [str(Path(sys.executable).parent / "commitgate"), "claude-config", "--policy", str(d.policy)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert printed.returncode == 0, printed.stderr
    assert "claude_desktop_config.json" in printed.stderr and "Application Support" in printed.stderr
    entry = json.loads(printed.stdout)["mcpServers"]["commitgate"]
    assert Path(entry["command"]).is_absolute() and str(d.policy) in entry["args"]
    bare = {  # what a desktop app hands its servers: no virtual environment, no project directory
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "COMMITGATE_SANDBOX": str(d.sandbox),
        "PYTHONPATH": "",
    }
    key = new_id("desk")
    params = StdioServerParameters(command=entry["command"], args=entry["args"], env=bare, cwd="/")
    async with Client(params, read_timeout_seconds=30) as client:
        result = await client.call_tool("send_email", email(key))
    assert not result.is_error, result.content
    assert d.count("emails", idempotency_key=key) == 1
