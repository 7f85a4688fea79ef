"""SSE and streamable HTTP through real server processes on 127.0.0.1: auth, tenants, replay, limits.

Effects are counted in the sandbox store the servers write to (`COMMITGATE_SANDBOX`).
Servers shared by several tests get a fresh idempotency key (and session) per test.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.e2e import as_meta, text_of
from support.http_servers import (
    GATED_ENV,
    GATED_TOOL,
    TOKEN_ENV,
    TOKENS,
    RoundRobin,
    Served,
    bearer,
    connect,
    error_code,
    free_port,
    operation_of,
    running,
    running_together,
    server_env,
    start_server,
    write_policy,
)
from support.node import INSPECTOR, NodeMissing, npm_binary

from commitgate.client import Gate
from commitgate.server.demo import tools as demo
from commitgate.server.ledger import open_ledger
from commitgate.server.model.facts import State

TRANSPORTS = ["streamable-http", "sse"]
SESSION = "commitgate/session"
MCP_ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http")


@pytest.fixture(scope="module")
def shared(workdir: Path) -> Iterator[dict[str, Served]]:
    """One server per transport with two principals (alice by token_env, bob by token_sha256), logging
    at debug level: the log tests read what every test of the module made them write."""
    policy = write_policy(workdir, max_concurrent_per_principal=2, extra_tools=GATED_TOOL)
    starts = [
        {
            "workdir": workdir,
            "policy": policy,
            "transport": transport,
            "ledger": workdir / f"ledger-{transport}.db",
            "sandbox": workdir / "sandbox.db",
            "env": GATED_ENV,
            "log_level": "debug",
        }
        for transport in TRANSPORTS
    ]
    with running_together(*starts) as servers:
        yield dict(zip(TRANSPORTS, servers, strict=True))


@pytest.fixture(autouse=True)
def sandbox(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point `demo.count` at the store the servers of this module write to."""
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(workdir / "sandbox.db"))
    return workdir / "sandbox.db"


def new_key() -> str:
    return f"k-{uuid.uuid4().hex[:16]}"


def charge(key: str, amount: int = 500, description: str = "") -> dict[str, Any]:
    # each key its own charge: the same arguments under a new key would be a possible duplicate
    return {"card": "4242", "amount_cents": amount, "description": description or key, "idempotency_key": key}


def scrape(served: Served, principal: str | None = "ops") -> dict[tuple[str, frozenset[Any]], float]:
    response = httpx2.get(served.base + "/metrics", headers=bearer(principal))
    assert response.status_code == 200, response.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def metric(scraped: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    return scraped.get((name, frozenset(labels.items())), 0.0)


async def wait_for_state(served: Served, key: str, state: str, principal: str = "alice") -> None:
    async with connect(served, principal) as client:
        with anyio.fail_after(20):
            while True:
                status = await client.call_tool("get_operation_status", {"idempotency_key": key})
                operation = (status.structured_content or {}).get("operation") or {}
                if operation.get("state") == state:
                    return
                await anyio.sleep(0.02)


# --- replay, tenants -------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_retry_after_reconnecting_replays_the_first_outcome(
    shared: dict[str, Served], transport: str
) -> None:
    served, key = shared[transport], new_key()
    async with connect(served, "alice", "auto") as client:
        first = await client.call_tool("charge_card", charge(key))
        assert client.protocol_version == "2026-07-28"
    async with connect(served, "alice", "legacy") as client:  # the other protocol era, a new connection
        again = await client.call_tool("charge_card", charge(key))
        assert client.protocol_version != "2026-07-28"
    assert not first.is_error and not again.is_error
    assert again.structured_content == first.structured_content
    assert operation_of(first)["replayed"] is False and operation_of(again)["replayed"] is True
    assert operation_of(again)["operation_id"] == operation_of(first)["operation_id"]
    assert demo.count("charges", idempotency_key=key) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_principals_with_one_key_get_two_operations_and_see_only_their_own(
    shared: dict[str, Served], transport: str
) -> None:
    served, key, session = shared[transport], new_key(), f"s-{uuid.uuid4().hex[:8]}"
    ids: dict[str, str] = {}
    for who in ("alice", "bob"):
        async with connect(served, who) as client:
            result = await client.call_tool(
                "create_ticket",
                {"title": "printer", "idempotency_key": key},
                meta=as_meta({SESSION: session}),
            )
            assert not result.is_error and operation_of(result)["replayed"] is False
            ids[who] = operation_of(result)["operation_id"]
    assert ids["alice"] != ids["bob"]
    assert demo.count("tickets", idempotency_key=key) == 2
    assert demo.count("tickets", idempotency_key=key, principal="alice") == 1
    assert demo.count("tickets", idempotency_key=key, principal="bob") == 1

    for who, other in (("alice", "bob"), ("bob", "alice")):
        async with connect(served, who, "legacy") as client:
            mine = await client.call_tool(
                "get_operation_status", {"idempotency_key": key, "session": session}
            )
            assert mine.structured_content["operation"]["operation_id"] == ids[who]
            theirs = await client.call_tool("get_operation_status", {"operation_id": ids[other]})
            assert theirs.structured_content == {"found": False, "operation": None}
            listed = await client.call_tool("list_operations", {"limit": 20})
            listed_ids = {op["operation_id"] for op in listed.structured_content["operations"]}
            assert ids[who] in listed_ids and ids[other] not in listed_ids


# --- auth and host checks ------------------------------------------------------------------------------

WRONG = [
    {},
    {"Authorization": "Bearer not-a-token-at-all-0000"},
    {"Authorization": f"Bearer {TOKENS['alice']}x"},
    {"Authorization": f"Basic {TOKENS['alice']}"},
]


@pytest.mark.parametrize("headers", WRONG, ids=["missing", "unknown", "almost", "not-bearer"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_missing_or_wrong_token_is_refused(
    shared: dict[str, Served], transport: str, headers: dict[str, str]
) -> None:
    served, key = shared[transport], new_key()
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "create_ticket", "arguments": {"title": "x", "idempotency_key": key}},
    }
    if transport == "streamable-http":
        refused = [httpx2.post(served.endpoint, json=call, headers={**MCP_ACCEPT, **headers})]
    else:
        refused = [
            httpx2.get(served.endpoint, headers=headers),
            httpx2.post(
                served.base + f"/messages/?session_id={uuid.uuid4().hex}", json=call, headers=headers
            ),
        ]
    refused.append(httpx2.get(served.base + "/metrics", headers=headers))
    for response in refused:
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith('Bearer error="invalid_token"')
    assert httpx2.get(served.base + "/healthz", headers=headers).json() == {
        "status": "ok",
        "ledger": "writable",
    }
    assert demo.count("tickets", idempotency_key=key) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_foreign_host_header_is_refused_on_a_loopback_bind(
    shared: dict[str, Served], transport: str
) -> None:
    served = shared[transport]
    rebound = {"Host": f"attacker.example:{served.port}", **bearer("alice")}
    if transport == "streamable-http":
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        assert httpx2.post(served.endpoint, json=body, headers={**MCP_ACCEPT, **rebound}).status_code == 421
    else:
        assert httpx2.get(served.endpoint, headers=rebound).status_code == 421
    rebound_operator = {**rebound, **bearer("ops")}
    assert httpx2.get(served.base + "/metrics", headers=rebound_operator).status_code == 421
    assert httpx2.get(served.base + "/healthz", headers=rebound).status_code == 421
    origin = {"Origin": "http://attacker.example", **bearer("alice")}
    assert httpx2.get(served.base + "/healthz", headers=origin).status_code == 403


# --- metrics ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_metrics_parse_and_count_a_replay(shared: dict[str, Served]) -> None:
    served, key = shared["streamable-http"], new_key()
    labels = {"tool": "charge_card", "idempotency_class": "key-and-status-check"}
    before = scrape(served)
    async with connect(served, "alice") as client:
        await client.call_tool("charge_card", charge(key))
        await client.call_tool("charge_card", charge(key))
    after = scrape(served)  # an operator's token

    def delta(name: str, **extra: str) -> float:
        return metric(after, name, **extra) - metric(before, name, **extra)

    assert delta("commitgate_replays_total", **labels) == 1
    assert delta("commitgate_calls_total", code="ok", **labels) == 2
    assert delta("commitgate_completions_total", state="SUCCEEDED", **labels) == 1
    assert delta("commitgate_operations", state="SUCCEEDED") == 1
    assert delta("commitgate_ledger_seconds_count", method="claim") == 1  # the replay reads no ledger
    assert metric(after, "commitgate_ledger_up") == 1
    assert demo.count("charges", idempotency_key=key) == 1


# --- limits -------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_oversized_inputs_are_answered_clearly_and_the_server_stays_up(
    shared: dict[str, Served], transport: str
) -> None:
    served, key = shared[transport], new_key()
    async with connect(served, "alice") as client:
        big = await client.call_tool("create_ticket", {"title": "x" * 5000, "idempotency_key": key})
        assert error_code(big) == "invalid_arguments"
        assert "at most 4000 are accepted" in text_of(big)
        long_key = await client.call_tool("create_ticket", {"title": "t", "idempotency_key": "k" * 300})
        assert error_code(long_key) == "invalid_idempotency_key"
        listing = await client.call_tool("list_operations", {"limit": 1000})
        assert error_code(listing) == "invalid_arguments" and "at most 20" in text_of(listing)

        # A body over the transport's cap never reaches MCP: HTTP 413, whatever the session.
        huge = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/list", "pad": "x" * (5 << 20)})
        target = (
            served.endpoint if transport == "streamable-http" else served.base + "/messages/?session_id=00"
        )
        response = httpx2.post(target, content=huge, headers={**MCP_ACCEPT, **bearer("alice")}, timeout=30)
        assert response.status_code == 413 and response.text == "Request body too large"

        fine = await client.call_tool("create_ticket", {"title": "t", "idempotency_key": key})
        assert not fine.is_error
    assert httpx2.get(served.base + "/healthz").status_code == 200
    assert demo.count("tickets", idempotency_key=key) == 1


@pytest.mark.anyio
async def test_calls_beyond_the_per_principal_limit_are_refused_and_nothing_runs(
    shared: dict[str, Served], workdir: Path
) -> None:
    served = shared["streamable-http"]  # max_concurrent_per_principal = 2
    slow = [new_key(), new_key()]
    extra, bobs = new_key(), new_key()
    gate = workdir / f"gate-{slow[0]}"  # the two slow calls stay in flight until it exists
    async with connect(served, "alice") as alice, connect(served, "bob") as bob:
        async with anyio.create_task_group() as tg:
            for key in slow:
                tg.start_soon(
                    alice.call_tool, "gated_task", {"gate": str(gate), "label": key, "idempotency_key": key}
                )
            try:
                for key in slow:
                    await wait_for_state(served, key, "RUNNING")  # meta tools stay available meanwhile
                refused = await alice.call_tool(
                    "slow_task", {"seconds": 0, "label": extra, "idempotency_key": extra}
                )
                other = await bob.call_tool(
                    "slow_task", {"seconds": 0, "label": bobs, "idempotency_key": bobs}
                )
                status = await alice.call_tool("get_operation_status", {"idempotency_key": slow[0]})
                assert (
                    status.structured_content["operation"]["state"] == "RUNNING"
                )  # the limit was really reached
            finally:
                gate.touch()
        assert error_code(refused) == "retries_exhausted"
        assert "max_concurrent_per_principal" in text_of(refused)
        assert refused.structured_content["error"]["operation"] is None
        assert not other.is_error  # one principal's load does not block another
        assert demo.count("tasks", idempotency_key=extra) == 0
        later = await alice.call_tool("slow_task", {"seconds": 0, "label": extra, "idempotency_key": extra})
        assert not later.is_error and operation_of(later)["replayed"] is False
    for key in [*slow, extra, bobs]:
        assert demo.count("tasks", idempotency_key=key) == 1


def _healthz(sock: socket.socket) -> bytes:
    """One whole /healthz exchange on `sock`: its status line (nothing of the answer is left unread)."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(
        next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


@pytest.mark.anyio
async def test_an_idle_connection_is_kept_longer_than_clients_keep_theirs(
    shared: dict[str, Served],
) -> None:
    """httpx drops an idle pooled connection after 5 s: a server closing it at the same moment races a
    client reusing it, which fails the call and ends the MCP session. The client must close first."""
    served = shared["streamable-http"]
    async with connect(served, "alice") as client:
        gate, step = Gate(client, f"run-{new_key()}"), new_key()
        first = await gate.call("charge_card", {"card": "4242", "amount_cents": 700}, step=step)
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
            assert _healthz(sock).startswith(b"HTTP/1.1 200")
            await anyio.sleep(6.0)  # idle past the 5 s of httpx and of uvicorn's default
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):  # nothing to read: neither closed (b"") nor answered
                print("the server sent", sock.recv(1) or b"EOF: it closed the idle connection")
            assert _healthz(sock).startswith(b"HTTP/1.1 200")
        again = await gate.call("charge_card", {"card": "4242", "amount_cents": 700}, step=step)
    assert again.replayed and again.structured == first.structured
    assert demo.count("charges", idempotency_key=step) == 1


# --- replicas, shutdown -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stateless_replicas_sharing_a_ledger_execute_concurrent_duplicates_once(tmp_path: Path) -> None:
    policy = write_policy(tmp_path)
    ledger, store = tmp_path / "ledger.db", tmp_path / "sandbox.db"
    slow_charge = {"COMMITGATE_SANDBOX_FAULTS": "charge_card.latency=0.5s"}  # duplicates overlap the first
    key = new_key()
    replica = {
        "workdir": tmp_path, "policy": policy, "transport": "streamable-http", "ledger": ledger,
        "sandbox": store, "args": ["--stateless"], "env": slow_charge,
    }  # fmt: skip
    with running_together(replica, replica) as (a, b):
        results: list[Any] = []

        async def duplicate(served: Served, mode: str) -> None:
            async with connect(served, "alice", mode) as client:
                results.append(await client.call_tool("charge_card", charge(key)))

        async with anyio.create_task_group() as tg:
            for i, served in enumerate([a, b, a, b, a, b]):
                tg.start_soon(duplicate, served, "legacy" if i >= 4 else "auto")

        balancer = RoundRobin([a.port, b.port])  # a handshake-era client whose requests alternate replicas
        async with connect(a, "alice", "legacy", transport=balancer) as client:
            assert "charge_card" in {tool.name for tool in (await client.list_tools()).tools}
            results.append(await client.call_tool("charge_card", charge(key)))
        assert set(balancer.sent) == {a.port, b.port}

    assert [r.is_error for r in results] == [False] * 7
    assert len({r.structured_content["charge_id"] for r in results}) == 1
    assert len({operation_of(r)["operation_id"] for r in results}) == 1
    assert sum(not operation_of(r)["replayed"] for r in results) == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMITGATE_SANDBOX", str(store))
        assert demo.count("charges", idempotency_key=key) == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("transport", "stop_signal", "client_waits"),
    [
        (
            "streamable-http",
            signal.SIGTERM,
            True,
        ),  # the request in flight is answered within the grace period
        ("streamable-http", signal.SIGTERM, False),  # nobody waits: the drain alone records the outcome
        ("sse", signal.SIGINT, True),  # the SSE stream closes at once: the drain records the outcome
    ],
    ids=["term-answered", "term-abandoned", "int-sse"],
)
async def test_shutdown_lets_an_operation_in_flight_record_its_outcome(
    tmp_path: Path, transport: str, stop_signal: int, client_waits: bool
) -> None:
    policy = write_policy(tmp_path, extra_tools=GATED_TOOL)
    ledger, store = tmp_path / "ledger.db", tmp_path / "sandbox.db"
    served = start_server(tmp_path, policy, transport, ledger=ledger, sandbox=store, env=GATED_ENV)
    key, gate = new_key(), tmp_path / "gate"  # the task runs until the gate exists
    gave_up, left = anyio.CancelScope(), anyio.Event()

    async def call() -> None:
        with gave_up, contextlib.suppress(Exception):  # the connection may close under it
            async with connect(served, "alice") as client:
                await client.call_tool(
                    "gated_task", {"gate": str(gate), "label": key, "idempotency_key": key}
                )
        left.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await wait_for_state(served, key, "RUNNING")
            if not client_waits:
                gave_up.cancel()  # the client disconnects before the signal
                await left.wait()
            served.send(stop_signal)
            with anyio.fail_after(20):  # the effect happens only once the server is shutting down
                while "Shutting down" not in served.stderr():
                    await anyio.sleep(0.02)
            gate.touch()
            code = await anyio.to_thread.run_sync(served.stop)
    finally:
        gate.touch()
        served.stop()
    assert code == 0, served.stderr()[-2000:]
    recorded = await open_ledger(f"sqlite:///{ledger}")
    try:
        op = await recorded.get("alice", "default", key)
    finally:
        await recorded.close()
    assert op is not None and op.state is State.SUCCEEDED
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMITGATE_SANDBOX", str(store))
        assert demo.count("tasks", idempotency_key=key) == 1


@pytest.mark.anyio
async def test_tokens_follow_a_policy_edit_without_a_restart(tmp_path: Path) -> None:
    carol = "carol-token-9d2e4f6a8b0c1e3f"
    policy, store = write_policy(tmp_path), tmp_path / "sandbox.db"
    with running(tmp_path, policy, "streamable-http", ledger=tmp_path / "l.db", sandbox=store) as served:
        as_carol = {"Authorization": f"Bearer {carol}"}
        assert httpx2.get(served.base + "/metrics", headers=as_carol).status_code == 401
        write_policy(tmp_path, extra_tokens={"carol": carol})  # the same file, one more token
        deadline = anyio.current_time() + 20
        while httpx2.get(served.base + "/metrics", headers=as_carol).status_code != 403:  # known: an agent
            assert anyio.current_time() < deadline, "the edit was not applied:\n" + served.stderr()[-3000:]
            await anyio.sleep(0.05)
        key = new_key()
        async with connect(served, headers=as_carol) as client:
            made = await client.call_tool("create_ticket", {"title": "hello", "idempotency_key": key})
        assert not made.is_error
        assert httpx2.get(served.base + "/metrics", headers=bearer("bob")).status_code == 403
        assert httpx2.get(served.base + "/metrics", headers=bearer("ops")).status_code == 200
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMITGATE_SANDBOX", str(store))
        assert demo.count("tickets", idempotency_key=key, principal="carol") == 1


# --- start-up refusals -----------------------------------------------------------------------------------


def serve_cli(
    tmp_path: Path, policy: Path, host: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "commitgate.server.cli", "serve", "--transport", "streamable-http",
        "--host", host, "--port", str(free_port()), "--policy", str(policy),
        "--ledger", f"sqlite:///{tmp_path / 'refused.db'}",
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def test_a_public_bind_without_auth_is_refused(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, auth=False)
    done = serve_cli(tmp_path, policy, "0.0.0.0", server_env(tmp_path / "sandbox.db"))
    assert done.returncode != 0
    assert "refusing to listen on '0.0.0.0' without authentication" in done.stderr
    assert "[[auth.tokens]]" in done.stderr


def test_a_token_variable_that_is_not_set_stops_the_start(tmp_path: Path) -> None:
    env = server_env(tmp_path / "sandbox.db")
    del env[TOKEN_ENV]
    done = serve_cli(tmp_path, write_policy(tmp_path), "127.0.0.1", env)
    assert done.returncode != 0
    assert f"auth.tokens[0].token_env: environment variable {TOKEN_ENV} is not set or empty" in done.stderr


# --- logs -----------------------------------------------------------------------------------------------

SECRET = "SECRET-ARGUMENT-4c1d"


async def exercise_with_secrets(served: Served) -> str:
    key = new_key()
    async with connect(served, "alice") as client:
        ok = await client.call_tool("charge_card", charge(key, description=SECRET))
        await client.call_tool("charge_card", charge(key, description=SECRET))  # a replay
        bad = await client.call_tool(
            "charge_card", {"card": SECRET, "amount_cents": SECRET, "idempotency_key": key}
        )
    assert not ok.is_error and error_code(bad) == "invalid_arguments"
    httpx2.get(served.base + "/metrics", headers={"Authorization": f"Bearer {TOKENS['bob']}-{SECRET}"})
    return str(operation_of(ok)["operation_id"])


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_logs_are_json_lines_without_tokens_or_argument_values(
    shared: dict[str, Served], transport: str
) -> None:
    served = shared[transport]  # at debug level, with what every earlier test of the module sent it
    operation_id = await exercise_with_secrets(served)

    def ours(event: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in records if r.get("event") == event and r.get("operation_id") == operation_id]

    text, records = await logged_until(served, lambda records: len(ours("call", records)) >= 2)
    calls = ours("call", records)
    assert [(c["tool"], c["class"], c["principal"], c["code"], c["replayed"]) for c in calls] == [
        ("charge_card", "key-and-status-check", "alice", "ok", False),
        ("charge_card", "key-and-status-check", "alice", "ok", True),
    ]
    assert all(c["state"] == "SUCCEEDED" and c["seconds"] >= 0 for c in calls)
    assert [r.get("state") for r in ours("completed", records)] == ["SUCCEEDED"]
    for secret in (SECRET, TOKENS["alice"], TOKENS["bob"]):
        assert secret not in text


async def logged_until(
    served: Served, done: Callable[[list[dict[str, Any]]], bool]
) -> tuple[str, list[dict[str, Any]]]:
    """The server's log so far and its records, once `done(records)`: a line is written after the
    answer it logs may have reached the client. Every whole line must be one JSON object."""
    with anyio.fail_after(10):
        while True:
            text = served.stderr()
            text = text[: text.rfind("\n") + 1]  # a line being written is read on the next turn
            records = [json.loads(line) for line in text.splitlines()]
            if done(records):
                return text, records
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_debug_unredacted_is_the_only_way_to_see_argument_values(
    without_auth: dict[str, Served],
) -> None:
    served = without_auth["streamable-http"]  # started with --debug-unredacted
    await exercise_with_secrets(served)
    with anyio.fail_after(10):
        while SECRET not in served.stderr():
            await anyio.sleep(0.02)


# --- a client we did not write ------------------------------------------------------------------------


@functools.cache
def inspector() -> list[str] | str:
    """The MCP Inspector's CLI as a command (installed with the tests' other npm packages, then run
    without npx's few seconds of resolving the package on every call), or why it cannot run here."""
    try:
        command = [*npm_binary(INSPECTOR, "mcp-inspector"), "--cli"]
    except (NodeMissing, subprocess.TimeoutExpired) as exc:
        return f"{INSPECTOR} cannot be installed: {exc}"
    probe = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"{INSPECTOR} does not run: {probe.stderr.strip()[-300:]}"
    return command


@pytest.fixture(scope="module")
def inspector_command() -> list[str]:
    command = inspector()
    if isinstance(command, str):
        pytest.skip(command)
    return command


@pytest.fixture(scope="module")
def without_auth(workdir: Path) -> Iterator[dict[str, Served]]:
    """One server per transport without tokens, for a client that cannot send headers (loopback only);
    they log argument values too (`--debug-unredacted`), which the shared servers never do."""
    policy = write_policy(workdir, auth=False, name="policy-without-auth.toml")
    starts = [
        {
            "workdir": workdir,
            "policy": policy,
            "transport": transport,
            "ledger": workdir / f"ledger-without-auth-{transport}.db",
            "sandbox": workdir / "sandbox.db",
            "log_level": "debug",
            "args": ["--debug-unredacted"],
        }
        for transport in TRANSPORTS
    ]
    with running_together(*starts) as servers:
        yield dict(zip(TRANSPORTS, servers, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_mcp_inspector_cli_lists_and_calls_tools(
    inspector_command: list[str], without_auth: dict[str, Served], transport: str
) -> None:
    command, served = inspector_command, without_auth[transport]
    listed = subprocess.run(
        [*command, served.endpoint, "--method", "tools/list"], capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    names = {tool["name"] for tool in json.loads(listed.stdout)["tools"]}
    assert {"charge_card", "create_ticket", "get_operation_status", "list_operations"} <= names
    key = new_key()
    called = [
        *command, served.endpoint, "--method", "tools/call", "--tool-name", "create_ticket",
        "--tool-arg", "title=inspected", f"idempotency_key={key}",
    ]  # fmt: skip
    for _ in range(2):
        done = subprocess.run(called, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["structuredContent"]["title"] == "inspected"
    assert demo.count("tickets", idempotency_key=key) == 1
