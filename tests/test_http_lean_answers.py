"""How the lean streamable-HTTP path answers a call, in process (no sockets, no SDK client).

Its answer is JSON when the call is quick, and an SSE stream (keepalive comments, then the answer
as an event) once the call has been silent for the ping interval, each call by its own clock. A
client leaving cancels its call at once, pings accepted or not. The checks of Host/Origin,
Content-Type and Accept are made once per set of those headers, and a request that fails them is
still left to the SDK however many passed before it. Host and Origin reach those checks in lower case.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from starlette.types import Message, Receive, Scope, Send

from commitgate.server.demo import tools as demo
from commitgate.server.ledger import OperationFilter
from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve import http_calls
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.http import MCP_PATH, _HostCase, max_body_bytes, security_settings
from commitgate.server.serve.http_calls import LeanCalls, _Silences, answered
from commitgate.server.serve.surface import build_server

pytestmark = pytest.mark.anyio

REPLY = {"jsonrpc": "2.0", "id": 1, "result": {"content": []}}
MODERN = "2026-07-28"
ENVELOPE = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
    "io.modelcontextprotocol/clientCapabilities": {},
}
POLICY = """
[tools.charge_card]
class = "key-required"
python = "commitgate.server.demo.tools:charge_card"
"""


class Client:
    """One HTTP exchange as the ASGI app sees it: the request is in, then the client waits (or leaves)."""

    def __init__(self, body: bytes = b"") -> None:
        self.body, self.read = body, False
        self.sent: list[Message] = []
        self.gone = anyio.Event()

    async def receive(self) -> Message:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def content_type(self) -> bytes:
        return dict(self.sent[0]["headers"])[b"content-type"]

    @property
    def text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.sent[1:]).decode()


def slow(seconds: float, reply: dict[str, Any] = REPLY, ran: list[str] | None = None) -> Any:
    async def run() -> dict[str, Any]:
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            if ran is not None:
                ran.append("cancelled")
            raise
        return reply

    return run()


async def test_a_quick_call_is_answered_as_json() -> None:
    client = Client()
    client.read = True
    await answered(slow(0), client.receive, client.send, _Silences())
    assert client.sent[0]["status"] == 200 and client.content_type == b"application/json"
    assert json.loads(client.text) == REPLY


async def test_a_silent_call_switches_to_sse_and_pings_until_its_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_calls, "PING_INTERVAL", 0.05)
    client = Client()
    client.read = True
    await answered(slow(0.3), client.receive, client.send, _Silences())
    assert client.content_type == b"text/event-stream"
    assert client.text.count(": ping\r\n\r\n") >= 2
    assert client.text.endswith(f"event: message\r\ndata: {json.dumps(REPLY, separators=(',', ':'))}\r\n\r\n")
    assert client.sent[-1]["more_body"] is False


async def test_each_call_switches_by_its_own_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_calls, "PING_INTERVAL", 0.2)
    silences = _Silences()  # one for all, as one app serves all calls
    clients = {name: Client() for name in ("long", "quick", "late", "later-quick")}
    for client in clients.values():
        client.read = True

    async def call(name: str, after: float, lasts: float) -> None:
        await anyio.sleep(after)
        await answered(slow(lasts), clients[name].receive, clients[name].send, silences)

    async with anyio.create_task_group() as group:
        group.start_soon(call, "long", 0.0, 0.5)
        group.start_soon(call, "quick", 0.0, 0.05)
        group.start_soon(call, "late", 0.1, 0.5)  # due after "long": pinged at its own time
        group.start_soon(call, "later-quick", 0.35, 0.05)  # begun after the first wake, done before its own
    kinds = {name: client.content_type for name, client in clients.items()}
    assert kinds == {
        "long": b"text/event-stream",
        "quick": b"application/json",
        "late": b"text/event-stream",
        "later-quick": b"application/json",
    }


async def test_a_client_leaving_cancels_its_call_at_once() -> None:
    """Pings accepted (every call here accepts SSE): the call still ends as the client leaves."""
    client, ran = Client(), list[str]()
    client.read = True

    async def leave() -> None:
        await anyio.sleep(0.1)
        client.gone.set()

    with anyio.fail_after(5):  # far below the ping interval
        async with anyio.create_task_group() as group:
            group.start_soon(leave)
            await answered(slow(60, ran=ran), client.receive, client.send, _Silences())
    assert ran == ["cancelled"] and client.sent == []
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the task serving it goes on, uncancelled


async def test_a_cancellation_from_elsewhere_is_not_taken_for_the_client_leaving() -> None:
    client, ran = Client(), list[str]()
    client.read = True
    with anyio.move_on_after(0.1) as stopping:  # as the server stopping would
        await answered(slow(60, ran=ran), client.receive, client.send, _Silences())
    assert stopping.cancelled_caught and ran == ["cancelled"] and client.sent == []


# --- the checks of the request, through LeanCalls ----------------------------------------------


@pytest.fixture
async def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "sandbox.db"))  # the demo tools' store
    policy = loads_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    gw = await Gateway.open(policy, None)
    try:
        async with gw.boundary.running():
            yield gw
    finally:
        await gw.close()


def lean_calls(gateway: Gateway, left: list[str]) -> LeanCalls:
    server = build_server(gateway)

    async def sdk(scope: Scope, receive: Receive, send: Send) -> None:
        left.append(dict(scope["headers"])[b"host"].decode())

    return LeanCalls(
        sdk,
        server=server,
        gateway=gateway,
        calls=server.answer_call,
        path=MCP_PATH,
        settings=security_settings("127.0.0.1"),
        max_body=max_body_bytes(gateway),
        stateless=False,
    )


def post(key: str, host: str) -> tuple[Scope, Client]:
    params = {
        "name": "charge_card",
        "arguments": {"card": "4242", "amount_cents": 100 + int(key[2:]), "idempotency_key": key},
    }
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {**params, "_meta": ENVELOPE}}
    )
    headers = {
        "host": host,
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
        "mcp-protocol-version": MODERN,
        "mcp-method": "tools/call",
        "mcp-name": "charge_card",
        "content-length": str(len(body)),
    }
    scope = {
        "type": "http",
        "method": "POST",
        "path": MCP_PATH,
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    return scope, Client(body.encode())


async def keys_recorded(gateway: Gateway) -> set[str]:
    return {op.step for op in await gateway.ledger.find(OperationFilter(gateway.default_principal))}


async def test_a_refused_host_is_left_to_the_sdk_after_admitted_ones(gateway: Gateway) -> None:
    left: list[str] = []
    app = lean_calls(gateway, left)

    async def asked(key: str, host: str) -> Client:
        scope, client = post(key, host)
        await app(scope, client.receive, client.send)
        return client

    first = await asked("k-1", "127.0.0.1:8765")
    evil = await asked("k-2", "evil.example:8765")
    again = await asked("k-3", "127.0.0.1:8765")
    evil_again = await asked("k-4", "evil.example:8765")
    assert left == ["evil.example:8765", "evil.example:8765"]  # the SDK refuses them (421)
    assert evil.sent == [] and evil_again.sent == []
    for client in (first, again):
        assert client.sent[0]["status"] == 200
        assert json.loads(client.text)["result"]["isError"] is False, client.text
    assert await keys_recorded(gateway) == {"k-1", "k-3"}
    assert demo.count("charges") == 2  # the system of record: the two admitted calls, once each


async def test_param_headers_are_compared_only_where_the_schema_declares_one(gateway: Gateway) -> None:
    app = lean_calls(gateway, [])
    plain = {"type": "object", "properties": {"region": {"type": "string"}}}
    declared = {"type": "object", "properties": {"region": {"type": "string", "x-mcp-header": "Region"}}}
    assert app._declares_param_headers(plain) is False
    assert app._declares_param_headers(declared) is True
    assert app._declares_param_headers(plain) is False  # each schema by its own verdict


async def test_host_and_origin_reach_the_checks_in_lower_case_and_a_lower_case_scope_is_not_copied() -> None:
    seen: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)

    plain: Scope = {"type": "http", "headers": [(b"host", b"localhost:80"), (b"accept", b"A/B")]}
    cased: Scope = {"type": "http", "headers": [(b"host", b"LocalHost:80"), (b"origin", b"http://LOCALHOST")]}
    client = Client()
    for scope in (plain, cased):
        await _HostCase(app)(scope, client.receive, client.send)
    assert seen[0] is plain  # nothing to lower: passed on as it is
    assert seen[1]["headers"] == [(b"host", b"localhost:80"), (b"origin", b"http://localhost")]
    assert cased["headers"][0] == (b"host", b"LocalHost:80")  # the server's own scope is left alone
