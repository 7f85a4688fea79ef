"""The lean stdio transport (server/fast_stdio.py) behaves exactly as the SDK's.

Each test runs the same conversation against `commitgate serve` with the SDK's
stdio transport and with the lean one (`commitgate serve --stdio fast
serve`), real processes over real pipes, and compares what came back: both
protocol eras, tool errors and protocol errors, malformed input lines, a tool
printing to stdout, large messages, concurrent calls, notifications of a
policy edit, and end of input.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.subscriptions import ToolsListChanged

from commitgate.server.serve.stdio import _is_pipe_or_socket

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

DEADLINE = 30.0
TRANSPORTS = ("sdk", "fast")

POLICY = """
[server]
name = "fast-stdio-test"
lease = "2s"
respond_within = "5s"
in_progress_wait = "2s"

[ledger]
synchronous = "FULL"

[tools.get_balance]
class = "safe-retry"
python = "commitgate.server.demo.tools:get_balance"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
timeout = "10s"

[tools.shout]
class = "safe-retry"
python = "fastio_tools:shout"
"""
TICKET = """
[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
"""
TOOLS_MODULE = '''
def shout(text: str) -> dict:
    """Print to stdout (which must never reach the protocol stream) and answer the text's length."""
    print("stray output from a tool:", text[:20], flush=True)
    return {"length": len(text)}
'''


class Deployment:
    """One directory per transport: policy, tool module, ledger and sandbox, so effects compare."""

    def __init__(self, root: Path, transport: str) -> None:
        self.root = root / transport
        self.root.mkdir()
        self.transport = transport
        self.policy = self.root / "policy.toml"
        self.write_policy(POLICY)
        (self.root / "fastio_tools.py").write_text(TOOLS_MODULE)
        self.notifications: list[str] = []

    def write_policy(self, text: str) -> None:
        tmp = self.policy.with_suffix(".tmp")
        tmp.write_text(textwrap.dedent(text))
        os.replace(tmp, self.policy)

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "commitgate.server.cli",
            "serve",
            "--stdio",
            self.transport,
            "--policy",
            str(self.policy),
            "--ledger",
            f"sqlite:///{self.root / 'ledger.db'}",
        ]

    def env(self) -> dict[str, str]:
        return {
            "COMMITGATE_SANDBOX": str(self.root / "sandbox.db"),
            "PYTHONUNBUFFERED": "1",
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(self.root),
        }

    async def on_message(self, message: Any) -> None:
        method = getattr(message, "method", None)
        if method:
            self.notifications.append(method)

    @asynccontextmanager
    async def client(self, mode: str) -> AsyncIterator[Client]:
        command, *args = self.argv()
        params = StdioServerParameters(command=command, args=args, env=self.env(), cwd=str(self.root))
        with (self.root / "stderr.log").open("a") as errlog:
            transport = stdio_client(params, errlog=errlog)
            async with Client(
                transport, mode=mode, message_handler=self.on_message, read_timeout_seconds=DEADLINE
            ) as client:
                yield client

    def count(self, table: str) -> int:
        import sqlite3

        with sqlite3.connect(self.root / "sandbox.db") as conn:
            return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])

    def stderr(self) -> str:
        return (self.root / "stderr.log").read_text(errors="replace")


@pytest.fixture
def deployments(tmp_path: Path) -> dict[str, Deployment]:
    return {name: Deployment(tmp_path, name) for name in TRANSPORTS}


_VOLATILE_KEYS = {"operation_id", "created_at", "completed_at", "updated_at", "expires_at", "at"}
_VOLATILE_TEXT = re.compile(r"\b(op|ch)_[0-9a-f]{16,}\b|\d{4}-\d\d-\d\dT[0-9:.]+(Z|[+-]\d\d:\d\d)?")


def normalised(value: Any) -> Any:
    """Ids and timestamps differ between any two runs; everything else must not."""
    if isinstance(value, dict):
        return {k: "<volatile>" if k in _VOLATILE_KEYS else normalised(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return _VOLATILE_TEXT.sub("<volatile>", value)
        return json.dumps(normalised(decoded), sort_keys=True) if isinstance(decoded, dict | list) else value
    return value


async def conversation(client: Client) -> list[Any]:
    """Everything a client sees of one scripted session, in order."""
    seen: list[Any] = [client.protocol_version, client.server_info, client.instructions]
    listed = await client.list_tools()
    seen.append(sorted((t.model_dump(mode="json") for t in listed.tools), key=lambda t: t["name"]))
    charge = {"card": "4242424242424242", "amount_cents": 1999, "idempotency_key": "order-1"}

    async def call(name: str, arguments: dict[str, Any]) -> None:
        try:
            result = await client.call_tool(name, arguments)
        except MCPError as exc:  # a protocol error, not a tool error
            seen.append({"protocol_error": exc.code, "message": exc.message})
            return
        seen.append(result.model_dump(mode="json", by_alias=True))

    await call("charge_card", charge)  # first run
    await call("charge_card", charge)  # replay
    await call("charge_card", {**charge, "amount_cents": 1})  # the key reused for other arguments
    await call("charge_card", {"card": "4242424242424242", "amount_cents": 5})  # no key
    await call("charge_card", {"card": 42, "idempotency_key": "order-2"})  # arguments off the schema
    await call("no_such_tool", {})
    await call("get_operation_status", {"idempotency_key": "order-1"})
    await call("list_operations", {})
    await call("shout", {"text": "hello"})  # prints to stdout: the wire must stay clean
    await call("shout", {"text": "é" * 300_000})  # a message far larger than any pipe buffer
    balances = await asyncio.gather(
        *(client.call_tool("get_balance", {"card": f"card-{n}"}) for n in range(20))
    )
    seen.append(sorted(json.dumps(b.structured_content, sort_keys=True) for b in balances))
    return normalised(seen)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_same_conversation_gives_the_same_answers(
    deployments: dict[str, Deployment], mode: str
) -> None:
    transcripts = {}

    async def talk(name: str, deployment: Deployment) -> None:
        async with deployment.client(mode) as client:
            transcripts[name] = await conversation(client)

    async with anyio.create_task_group() as both:  # two servers of their own: side by side
        for name, deployment in deployments.items():
            both.start_soon(talk, name, deployment)
    for deployment in deployments.values():
        assert deployment.count("charges") == 1  # first run, replay, and nothing else
        assert "stray output from a tool: hello" in deployment.stderr()  # stdout went to stderr
    assert transcripts["fast"][0] == ("2026-07-28" if mode == "auto" else transcripts["fast"][0])
    assert transcripts["fast"] == transcripts["sdk"]


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    with anyio.fail_after(DEADLINE):
        while not await check():
            await anyio.sleep(0.05)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_policy_edit_is_announced_in_the_handshake_era(
    deployments: dict[str, Deployment], transport: str
) -> None:
    deployment = deployments[transport]
    deployment.write_policy(POLICY + TICKET)
    async with deployment.client("legacy") as client:
        assert "create_ticket" in {t.name for t in (await client.list_tools()).tools}
        deployment.write_policy(POLICY)  # a tool removed: it applies at once (adding one waits for quiet)

        async def announced() -> bool:
            return "notifications/tools/list_changed" in deployment.notifications

        await eventually(announced)
        names = {t.name for t in (await client.list_tools()).tools}
        assert "create_ticket" not in names and "charge_card" in names


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_policy_edit_reaches_a_modern_listen_stream(
    deployments: dict[str, Deployment], transport: str
) -> None:
    deployment = deployments[transport]
    deployment.write_policy(POLICY + TICKET)
    async with deployment.client("auto") as client:
        assert client.protocol_version == "2026-07-28"
        async with client.listen(tools_list_changed=True) as subscription:
            deployment.write_policy(POLICY)  # a tool removed: it applies at once
            with anyio.fail_after(DEADLINE):
                event = await subscription.__anext__()
            assert isinstance(event, ToolsListChanged)


# --- the framing itself, byte for byte -------------------------------------------------------------------

RAW_CONVERSATION: list[tuple[str, int | None]] = [
    # (line sent, id of the answer to wait for; None: wait for the ping that follows instead)
    ("this is not json", None),
    ("", None),
    ('{"jsonrpc": "2.0", "method": "no/id/and/no/params"}', None),
    (
        '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
        '"capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}',
        1,
    ),
    ('{"jsonrpc":"2.0","method":"notifications/initialized"}', None),
    ('{"jsonrpc":"2.0","id":2,"method":"tools/list"}', 2),
    ('{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"nope","arguments":{}}}', 3),
    ('{"jsonrpc":"2.0","id":4,"method":"no/such/method"}', 4),
    ('{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"shout","arguments":{"text":"x"}}}', 5),
    ("{broken json, then a good line\n" + '{"jsonrpc":"2.0","id":6,"method":"ping"}', 6),
    ('{"id": 7, "not": "json-rpc"}', None),
]

# What both transports add to the SDK's reader: JSON-RPC's answer to each line that is not a
# message (the SDK's reader drops them without a word, and the client waits forever).
ERROR_REPLIES = [
    '{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error: the line is not JSON"}}',
    '{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error: the line is not JSON"}}',
    '{"jsonrpc":"2.0","id":7,"error":{"code":-32600,"message":"Invalid request: not a JSON-RPC 2.0 message"}}',
]


async def raw_transcript(
    deployment: Deployment, conversation: list[tuple[str, int | None]]
) -> tuple[list[str], int]:
    """Every line the server writes for a raw conversation, verbatim, and its exit code after end of input."""
    with (deployment.root / "stderr.log").open("a") as errlog:
        process = await asyncio.create_subprocess_exec(
            *deployment.argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=errlog,
            env=deployment.env(),
            cwd=str(deployment.root),
        )
    assert process.stdin is not None and process.stdout is not None
    lines: list[str] = []
    ping = 100

    stdout = process.stdout
    assert stdout is not None

    async def answer_to(request_id: int) -> None:
        while True:
            line = (await asyncio.wait_for(stdout.readline(), DEADLINE)).decode()
            assert line.endswith("\n"), "the server closed stdout early"
            lines.append(line.removesuffix("\n"))
            if json.loads(line).get("id") == request_id:
                return

    for sent, wait_for in conversation:
        process.stdin.write(sent.encode() + b"\n")
        if wait_for is None:  # maybe no answer at all: a ping after it shows what came first
            ping += 1
            process.stdin.write(f'{{"jsonrpc":"2.0","id":{ping},"method":"ping"}}\n'.encode())
            wait_for = ping
        await process.stdin.drain()
        await answer_to(wait_for)
    process.stdin.close()
    rest = await asyncio.wait_for(process.stdout.read(), DEADLINE)
    lines += rest.decode().split("\n")[:-1] if rest else []
    return lines, await asyncio.wait_for(process.wait(), DEADLINE)


async def test_raw_framing_is_line_for_line_the_sdks(deployments: dict[str, Deployment]) -> None:
    sdk, fast = await asyncio.gather(  # side by side: each has a server of its own
        *(raw_transcript(deployments[name], RAW_CONVERSATION) for name in ("sdk", "fast"))
    )
    replies = [line for line in fast[0] if '"code":-32700' in line or '"code":-32600' in line]
    assert replies == ERROR_REPLIES
    assert fast == sdk
    lines, exit_code = fast
    assert exit_code == 0  # end of input ends the server cleanly
    answered = {json.loads(line).get("id") for line in lines}
    assert {1, 2, 3, 4, 5, 6} <= answered


HOSTILE_LINES: list[tuple[str, int | None]] = [
    ('{"jsonrpc":"2.0","id":1,"method":"ping","params":{"a":' + "[" * 1000 + "]" * 1000 + "}}", None),
    ('{"jsonrpc":"2.0","id":null,"method":"ping"}', None),
    ('{"jsonrpc":"2.0","id":{"an":"object"},"method":"ping"}', None),
    ('{"jsonrpc":"2.0","id":true,"method":"ping"}', None),
    ('{"jsonrpc":"2.0","id":2,"method":"ping","params":{"n":' + "7" * 5000 + "}}", None),
]
HOSTILE_REPLIES = [
    (None, "Invalid request: nested too deeply to read"),
    (None, "Invalid request: an id must be a string or an integer"),
    (None, "Invalid request: an id must be a string or an integer"),
    (None, "Invalid request: an id must be a string or an integer"),
    (2, "Invalid request: a number in it is too large to read"),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_hostile_line_is_answered_and_the_server_lives_on(
    deployments: dict[str, Deployment], transport: str
) -> None:
    lines, exit_code = await raw_transcript(deployments[transport], HOSTILE_LINES)
    answers = [json.loads(line) for line in lines]
    errors = [(a["id"], a["error"]["message"]) for a in answers if "error" in a]
    assert errors == HOSTILE_REPLIES
    assert all(a["error"]["code"] == -32600 for a in answers if "error" in a)
    assert [a["id"] for a in answers if "result" in a] == list(range(101, 101 + len(HOSTILE_LINES)))
    assert exit_code == 0
    assert "Traceback" not in deployments[transport].stderr()


def test_only_pipes_and_sockets_take_the_fast_path(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        assert _is_pipe_or_socket(read_end) and _is_pipe_or_socket(write_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    with (tmp_path / "file").open("w") as regular:
        assert not _is_pipe_or_socket(regular.fileno())
    assert not _is_pipe_or_socket(10_000)  # not open at all


def test_serve_uses_the_lean_transport_unless_told_otherwise() -> None:
    from commitgate.server.cli.main import build_parser

    assert build_parser().parse_args(["serve"]).stdio == "fast"
    assert build_parser().parse_args(["serve", "--stdio", "sdk"]).stdio == "sdk"


async def test_a_line_longer_than_many_chunks_arrives_whole() -> None:
    """Lines are reassembled from chunks once, however many chunks they span."""
    from mcp.shared._context_streams import create_context_streams
    from mcp.shared.message import SessionMessage

    from commitgate.server.serve import stdio

    reader = asyncio.StreamReader()
    big = "x" * (3 << 20)
    first = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"big": big}})
    for start in range(0, len(first), 1000):  # arriving in small pieces, as a pipe delivers
        reader.feed_data(first[start : start + 1000].encode())
    reader.feed_data(b'\n{"jsonrpc":"2.0","id":2,"method":"ping"}')  # the last line has no newline
    reader.feed_eof()
    send, receive = create_context_streams[SessionMessage | Exception](10)

    class Sink:
        def write(self, data: bytes) -> None:
            raise AssertionError(f"nothing to answer here: {data[:80]!r}")

        async def drain(self) -> None:
            return None

    got: list[SessionMessage | Exception] = []
    async with anyio.create_task_group() as tasks:

        async def collect() -> None:
            async with receive:
                async for item in receive:
                    got.append(item)

        tasks.start_soon(collect)
        await stdio._pump_in(reader, send, Sink())  # type: ignore[arg-type]
    requests = [item.message for item in got if isinstance(item, SessionMessage)]
    assert len(requests) == len(got) == 2
    one, two = (request.model_dump(by_alias=True) for request in requests)
    assert (one["id"], two["id"]) == (1, 2)
    assert one["params"]["big"] == big
