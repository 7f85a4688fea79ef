"""The lean streamable-HTTP path for tools/call answers as the SDK's path does.

Two real `commitgate serve --transport streamable-http` processes with the same policy, one
with the lean path and one with it switched off (`COMMITGATE_HTTP_SDK_CALLS=1`), hold the same
conversations with real SDK clients; their answers are compared as JSON (results with their
`_meta`, errors), with what differs run to run (operation ids, times) masked. Effects are
counted in each server's own sandbox store.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import MCPError
from support import http_servers
from support.http_servers import (
    GATED_ENV,
    GATED_TOOL,
    Served,
    bearer,
    connect,
    operation_of,
    running_together,
    write_policy,
)

from commitgate.server.demo import tools as demo
from commitgate.server.serve.http_calls import OFF_ENV

PATHS = ("lean", "sdk")
LEAN_LINE = "on the lean path"


def _start(workdir: Path, policy: Path, path: str, args: list[str]) -> dict[str, Any]:
    env = {**GATED_ENV, **({OFF_ENV: "1"} if path == "sdk" else {})}
    return {
        "workdir": workdir,
        "policy": policy,
        "transport": "streamable-http",
        "ledger": workdir / f"ledger-{path}.db",
        "sandbox": workdir / f"sandbox-{path}.db",
        "env": env,
        "log_level": "debug",
        "args": args,
    }


@contextlib.contextmanager
def _pair(workdir: Path, args: list[str]) -> Iterator[dict[str, Served]]:
    """Both servers started at once (their imports overlap), each given time on a busy machine."""
    policy = write_policy(workdir, extra_tools=GATED_TOOL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(http_servers, "READY_TIMEOUT", 120.0)
        with running_together(*(_start(workdir, policy, path, args) for path in PATHS)) as servers:
            yield dict(zip(PATHS, servers, strict=True))


@pytest.fixture(scope="module")
def stateful(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    with _pair(tmp_path_factory.mktemp("stateful"), []) as servers:
        yield servers


@pytest.fixture(scope="module")
def stateless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    with _pair(tmp_path_factory.mktemp("stateless"), ["--stateless"]) as servers:
        yield servers


def count(served_path: str, workdir: Path, key: str, monkeypatch: pytest.MonkeyPatch, table: str) -> int:
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(workdir / f"sandbox-{served_path}.db"))
    return demo.count(table, idempotency_key=key)


_VOLATILE = re.compile(r"^(op_|\d{4}-\d\d-\d\dT)")
_TIMES = re.compile(r"\d{4}-\d\d-\d\dT[0-9:.]+Z?")


def masked(value: Any) -> Any:
    """`value` with what differs from run to run (ids, times) replaced by placeholders."""
    if isinstance(value, dict):
        return {k: masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    if isinstance(value, str):
        if _VOLATILE.match(value):
            return "<volatile>"
        return _TIMES.sub(
            "<time>", re.sub(r"op_[0-9a-zA-Z_-]+", "<op>", re.sub(r"(ch|tk|task)_[0-9a-f]+", "<id>", value))
        )
    return value


async def conversation(served: Served, mode: str, key: str) -> list[Any]:
    """One client's calls: success, replay, bad arguments, missing key, unknown tool, a meta tool."""
    answers: list[Any] = []
    async with connect(served, "alice", mode) as client:
        ticket = {"title": f"t-{key}", "idempotency_key": key}
        for arguments in (ticket, ticket, {"title": 5, "idempotency_key": key + "x"}, {"title": "no key"}):
            result = await client.call_tool("create_ticket", arguments)
            answers.append(result.model_dump(mode="json", by_alias=True))
        try:
            await client.call_tool("no_such_tool", {})
        except MCPError as exc:
            answers.append({"code": exc.error.code, "message": exc.error.message})
        status = await client.call_tool("get_operation_status", {"idempotency_key": key})
        answers.append(status.model_dump(mode="json", by_alias=True))
        answers.append(client.protocol_version)
    return answers


def lean_calls(served: Served) -> int:
    return served.stderr().count(LEAN_LINE)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_same_conversation_gets_the_same_answers(
    stateful: dict[str, Served], mode: str, tmp_path: Path
) -> None:
    key = f"k-{uuid.uuid4().hex[:12]}"
    before = lean_calls(stateful["lean"])
    lean = await conversation(stateful["lean"], mode, key)
    sdk = await conversation(stateful["sdk"], mode, key)
    assert masked(lean) == masked(sdk)
    assert lean[0]["structuredContent"]["title"] == f"t-{key}"
    assert lean[1]["_meta"]["commitgate/operation"]["replayed"] is True
    assert "serverInfo" in json.dumps(lean[0]) or mode == "legacy"
    # The 2026-07-28 era takes the lean path; a stateful handshake-era session the SDK's.
    served_lean = lean_calls(stateful["lean"]) - before
    assert served_lean == (5 if mode == "auto" else 0)
    assert lean_calls(stateful["sdk"]) == 0


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_stateless_servers_answer_alike_on_both_paths(stateless: dict[str, Served], mode: str) -> None:
    key = f"k-{uuid.uuid4().hex[:12]}"
    before = lean_calls(stateless["lean"])
    lean = await conversation(stateless["lean"], mode, key)
    sdk = await conversation(stateless["sdk"], mode, key)
    assert masked(lean) == masked(sdk)
    assert lean_calls(stateless["lean"]) - before == 5  # both eras: each POST stands alone


async def _duplicates(served: Served, key: str, calls: int) -> list[Any]:
    """`calls` clients (both eras in turn) make the same keyed call at once."""
    results: list[Any] = []

    async def one(mode: str) -> None:
        async with connect(served, "alice", mode) as client:
            ticket = {"title": f"t-{key}", "idempotency_key": key}
            results.append(await client.call_tool("create_ticket", ticket))

    async with anyio.create_task_group() as group:
        for i in range(calls):
            group.start_soon(one, "auto" if i % 2 else "legacy")
    return results


@pytest.mark.anyio
async def test_concurrent_duplicates_have_one_effect_on_each_path(
    stateless: dict[str, Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in PATHS:
        served, key = stateless[path], f"dup-{uuid.uuid4().hex[:12]}"
        results = await _duplicates(served, key, 6)
        ids = {operation_of(r)["operation_id"] for r in results if not r.is_error}
        assert len(ids) == 1, [r.content for r in results]
        assert count(path, served.stderr_path.parent, key, monkeypatch, "tickets") == 1


def _raw_call(key: str, accept: str, modern: bool) -> tuple[dict[str, str], dict[str, Any]]:
    params: dict[str, Any] = {"name": "create_ticket", "arguments": {"title": key, "idempotency_key": key}}
    headers = {"Accept": accept, "Content-Type": "application/json"}
    if modern:
        version = "2026-07-28"
        params["_meta"] = {
            "io.modelcontextprotocol/protocolVersion": version,
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        headers.update(
            {"MCP-Protocol-Version": version, "Mcp-Method": "tools/call", "Mcp-Name": "create_ticket"}
        )
    return headers, {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}


@pytest.mark.parametrize("modern", [True, False])
@pytest.mark.parametrize(
    "accept", ["text/event-stream", "application/json", "application/json, text/event-stream"]
)
def test_raw_posts_are_answered_alike(stateless: dict[str, Served], modern: bool, accept: str) -> None:
    """What a client accepts, and a token missing or wrong: the same status and body on both paths."""
    seen: list[tuple[Any, ...]] = []
    key = f"raw-{uuid.uuid4().hex[:12]}"  # each server has its own ledger and sandbox
    for path in PATHS:
        served = stateless[path]
        headers, body = _raw_call(key, accept, modern)
        answers = []
        for token in (bearer("alice"), {}, {"Authorization": "Bearer nope"}):
            response = httpx2.post(served.endpoint, json=body, headers={**headers, **token}, timeout=30)
            text = response.text
            if "event: message" in text:  # the SDK frames a handshake-era answer as one SSE event
                text = text.split("data: ", 1)[1].strip()
            with contextlib.suppress(ValueError):
                text = masked(json.loads(text))
            answers.append((response.status_code, text))
        seen.append(tuple(answers))
    assert seen[0] == seen[1]


@pytest.mark.anyio
async def test_a_client_leaving_a_keyed_call_leaves_it_to_run_to_its_outcome_once(
    stateless: dict[str, Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    served, key = stateless["lean"], f"gone-{uuid.uuid4().hex[:12]}"
    workdir = served.stderr_path.parent
    gate = workdir / f"gate-{key}"
    before = lean_calls(served)
    async with connect(served, "alice", "auto") as client:
        with anyio.move_on_after(1.0):
            await client.call_tool("gated_task", {"gate": str(gate), "label": key, "idempotency_key": key})
    assert lean_calls(served) == before + 1
    gate.touch()
    async with connect(served, "alice", "auto") as client:
        with anyio.fail_after(20):
            while True:
                status = await client.call_tool("get_operation_status", {"idempotency_key": key})
                if ((status.structured_content or {}).get("operation") or {}).get("state") == "SUCCEEDED":
                    break
                await anyio.sleep(0.05)
        again = await client.call_tool(
            "gated_task", {"gate": str(gate), "label": key, "idempotency_key": key}
        )
    assert operation_of(again)["replayed"] is True
    assert count("lean", workdir, key, monkeypatch, "tasks") == 1
