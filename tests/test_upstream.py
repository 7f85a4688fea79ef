"""The upstream source: other MCP servers wrapped by editing the policy alone.

The third-party server is `@modelcontextprotocol/server-memory` from npm (the reference knowledge-graph
server; nobody here wrote it), installed once into a cache directory by the test setup. What is
counted is its own store: the entities in its JSONL file (`MEMORY_FILE_PATH`). A small stub server of
ours (tests/support/upstream_server.py) covers what the memory server cannot show: a process dying in
the middle of a call, error results, `_meta` propagation, streamable HTTP; and a second commitgate
server stands upstream to show that a chain dedups end to end.

Tests that only call tools share one server per upstream (module scope), each with keys and sessions
of its own; those that kill, hold down or rewrite an upstream have their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError
from mcp.shared.subscriptions import ToolsListChanged
from support.e2e import run_together, together
from support.wrapping import (
    CONSOLE_SCRIPT,
    TESTS_DIR,
    call,
    error_code,
    eventually,
    memory_entities,
    memory_server,
    operation,
    serve,
    text,
    upstream_listed,
)

from commitgate.server.demo import tools as demo
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.gateway import Gateway
from commitgate.tools.upstream import UpstreamTool, inventory

FAST_RETRY = 'retry = { attempts = 3, initial = "1ms", max = "10ms" }'
SERVER = """
[server]
lease = "5s"
respond_within = "20s"

[ledger]
url = "sqlite:///{ledger}"
"""


# --- the third-party server: @modelcontextprotocol/server-memory --------------------------------------


class Memory:
    """A policy wrapping server-memory through `sh`, which leaves its pid in a file and refuses to
    start while a flag file exists (so a test can kill it and hold it down)."""

    def __init__(self, root: Path, index: Path) -> None:
        self.root, self.store = root, root / "memory.jsonl"
        self.pidfile, self.downflag = root / "memory.pid", root / "memory.down"
        self.policy = root / "policy.toml"
        self.policy.write_text(self.toml(index), encoding="utf-8")

    def toml(self, index: Path) -> str:
        launcher = 'echo $$ > "$PIDFILE"; if [ -e "$DOWNFLAG" ]; then exit 1; fi; exec node "$INDEX"'
        return (
            SERVER.format(ledger=self.root / "ledger.db")
            + f"""
[upstreams.memory]
command = "sh"
args = ["-c", '{launcher}']
env = {{ MEMORY_FILE_PATH = "{self.store}", PIDFILE = "{self.pidfile}", DOWNFLAG = "{self.downflag}", INDEX = "{index}" }}

[tools.create_entities]
upstream = "memory"
class = "key-required"
{FAST_RETRY}

[tools.forget_entities]
upstream = "memory"
upstream_tool = "delete_entities"
class = "key-required"
description = "Delete entities (and their relations) from the knowledge graph."
{FAST_RETRY}

[tools.read_graph]
upstream = "memory"
class = "safe-retry"
{FAST_RETRY}
"""
        )

    def pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    def entities(self, name: str) -> int:
        return len(memory_entities(self.store, name))


def entity(name: str, *observations: str) -> dict[str, Any]:
    return {"name": name, "entityType": "person", "observations": list(observations)}


@pytest.fixture(scope="module")
def memory_index() -> Path:
    return memory_server()


@pytest.fixture
def memory(tmp_path: Path, memory_index: Path) -> Memory:
    return Memory(tmp_path, memory_index)


@pytest.fixture(scope="module")
def shared_memory(tmp_path_factory: pytest.TempPathFactory, memory_index: Path) -> Memory:
    return Memory(tmp_path_factory.mktemp("memory"), memory_index)


@pytest.fixture(scope="module")
async def memory_client(shared_memory: Memory, anyio_backend: str) -> AsyncIterator[Client]:
    """One server wrapping server-memory, for the tests that leave the upstream running as it is."""
    async with serve(shared_memory.policy, shared_memory.root / "stderr.log") as client:
        yield client


@pytest.mark.anyio
async def test_only_declared_tools_are_served_with_their_imported_schemas(
    shared_memory: Memory, memory_client: Client
) -> None:
    memory, client = shared_memory, memory_client
    tools = await upstream_listed(client, "create_entities")
    with pytest.raises(MCPError, match="Unknown tool"):
        await client.call_tool("search_nodes", {"query": "x"})  # offered upstream, not declared
    wrapped = {"create_entities", "forget_entities", "read_graph"}
    assert wrapped <= set(tools) and not {"search_nodes", "delete_entities", "add_observations"} & set(tools)
    create = tools["create_entities"]
    assert set(create.input_schema["properties"]) == {"entities", "idempotency_key", "confirm_duplicate"}
    assert set(create.input_schema["required"]) == {"entities", "idempotency_key"}
    assert create.output_schema is not None and "entities" in create.output_schema["properties"]
    assert (create.description or "").startswith("Create multiple new entities in the knowledge graph")
    assert create.annotations is not None and create.annotations.read_only_hint is False
    assert tools["read_graph"].annotations is not None and tools["read_graph"].annotations.read_only_hint
    assert "entityNames" in tools["forget_entities"].input_schema["properties"]
    report = {item.name: item for item in await inventory(load_policy(memory.policy))}
    assert report["memory"].connected and report["memory"].missing == []
    assert report["memory"].exposed == ["create_entities", "delete_entities", "read_graph"]
    assert {"search_nodes", "add_observations", "open_nodes"} <= set(report["memory"].not_exposed)


@pytest.mark.anyio
async def test_a_replayed_create_has_no_second_effect_in_the_memory_store(
    shared_memory: Memory, memory_client: Client
) -> None:
    memory, client = shared_memory, memory_client
    create = {"entities": [entity("alice", "likes tea")], "idempotency_key": "create-alice"}
    first = await call(client, "create_entities", create)
    assert not first.is_error, text(first)
    assert memory.entities("alice") == 1
    forget = await call(
        client, "forget_entities", {"entityNames": ["alice"], "idempotency_key": "forget-alice"}
    )
    assert not forget.is_error and memory.entities("alice") == 0
    # Run again, the create would bring alice back; replayed, the store stays as it is.
    replay = await call(client, "create_entities", create)
    reused = await call(client, "create_entities", {**create, "entities": [entity("bob")]})
    assert not replay.is_error and operation(replay)["replayed"] is True
    assert replay.structured_content == first.structured_content
    assert error_code(reused) == "idempotency_key_reused"
    assert memory.entities("alice") == 0 and memory.entities("bob") == 0


@pytest.mark.anyio
async def test_a_killed_upstream_fails_safely_and_is_reconnected(memory: Memory) -> None:
    async with serve(memory.policy, memory.root / "stderr.log") as client:
        carol = await call(
            client, "create_entities", {"entities": [entity("carol")], "idempotency_key": "c-1"}
        )
        assert not carol.is_error and memory.entities("carol") == 1
        first_pid = memory.pid()
        assert first_pid is not None
        memory.downflag.touch()
        os.kill(first_pid, signal.SIGKILL)
        await eventually(lambda: memory.pid() not in (None, first_pid))  # noticed; respawn refused

        dave = {"entities": [entity("dave")], "idempotency_key": "d-1"}
        down = await call(client, "create_entities", dave)
        assert error_code(down) == "retries_exhausted"  # certainly not sent
        status = await call(client, "get_operation_status", {"idempotency_key": "d-1"})
        assert status.structured_content is not None
        assert status.structured_content["operation"]["retry_advice"] == "safe_to_retry_same_key"
        assert memory.entities("dave") == 0

        # Each refused start (the one after the kill, one per attempt of the call above) doubles the
        # backoff: past the next one, the wait before another is seconds long.
        await _next_attempt(memory)
        memory.downflag.unlink()
        # Back up, in the middle of a backoff: the call starts the next attempt at once and waits for it.
        again = await call(client, "create_entities", dave)
    assert not again.is_error, text(again)
    assert operation(again)["state"] == "SUCCEEDED" and operation(again)["replayed"] is False
    assert memory.entities("dave") == 1 and memory.entities("carol") == 1


def test_policy_check_validates_upstream_tools_without_starting_them(memory: Memory) -> None:
    broken = memory.root / "broken.toml"
    broken.write_text(
        memory.policy.read_text().replace(
            'upstream = "memory"\nclass = "safe-retry"', 'upstream = "memroy"\nclass = "safe-retry"'
        )
    )
    check = [str(CONSOLE_SCRIPT), "policy", "check"]
    good, bad = run_together([*check, str(memory.policy)], [*check, str(broken)])
    assert good.returncode == 0, good.stdout + good.stderr
    assert not memory.pidfile.exists()  # nothing was started
    assert bad.returncode == 1 and "tools.read_graph.upstream" in bad.stdout + bad.stderr


@pytest.mark.anyio
async def test_a_tool_the_upstream_does_not_offer_is_reported_once_it_connects(
    memory: Memory, caplog: pytest.LogCaptureFixture
) -> None:
    from commitgate.server.serve.reload import refresh_upstream_tools

    memory.policy.write_text(memory.policy.read_text().replace('"delete_entities"', '"delete_entity"'))
    gateway = await Gateway.open(load_policy(memory.policy), memory.policy)  # never waits for upstreams
    try:
        connection = gateway.upstreams.lookup(gateway.policy)("memory")
        assert connection is not None and await connection.ready(60) is not None

        async def announce() -> None:
            raise AssertionError("nothing changed that clients could use")

        assert await refresh_upstream_tools(gateway, announce) is False
    finally:
        await gateway.close()
    (problem,) = [r.getMessage() for r in caplog.records if "do not fit the policy" in r.getMessage()]
    assert "tools.forget_entities.upstream_tool" in problem
    assert "no tool 'delete_entity'" in problem and "delete_entities" in problem


# --- our stub upstream: in-flight death, error results, _meta, streamable HTTP ---------------------------


def stub_tools(*, extra: str = "") -> str:
    keyed = "\n".join(
        f'[tools.{name}]\nupstream = "stub"\nclass = "key-required"\n{FAST_RETRY}\n'
        for name in ("record", "record_keyed", "die_after_recording", "rate_limited", "refuse")
    )
    return keyed + f'\n[tools.ping]\nupstream = "stub"\nclass = "safe-retry"\n{FAST_RETRY}\n{extra}'


def stub_log(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stub_policy(root: Path) -> Path:
    """A policy wrapping our stub over stdio, which logs to `root / "stub.jsonl"`."""
    log = root / "stub.jsonl"
    policy = root / "policy.toml"
    server = TESTS_DIR / "support" / "upstream_server.py"
    policy.write_text(
        SERVER.format(ledger=root / "ledger.db")
        + f'\n[upstreams.stub]\ncommand = "{sys.executable}"\nargs = ["{server}"]\n'
        + f'env = {{ STUB_LOG = "{log}" }}\n\n'
        + stub_tools()
    )
    return policy


@pytest.fixture
def stub(tmp_path: Path) -> Path:
    return stub_policy(tmp_path)


@pytest.fixture(scope="module")
def shared_stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stub_policy(tmp_path_factory.mktemp("stub"))


@pytest.fixture(scope="module")
async def stub_client(shared_stub: Path, anyio_backend: str) -> AsyncIterator[Client]:
    """One server wrapping the stub, shared by the tests that call it (the stub restarts when it dies)."""
    async with serve(shared_stub, shared_stub.parent / "stderr.log") as client:
        yield client


@pytest.mark.anyio
async def test_session_and_step_travel_upstream(shared_stub: Path, stub_client: Client) -> None:
    log, client = shared_stub.parent / "stub.jsonl", stub_client
    tools = {t.name: t for t in (await client.list_tools()).tools}
    one = await call(client, "record", {"note": "n1", "idempotency_key": "step-1"}, session="run-7")
    two = await call(client, "record_keyed", {"note": "n2", "idempotency_key": "step-2"}, session="run-7")
    assert not one.is_error and not two.is_error, (text(one), text(two))
    assert tools["record_keyed"].input_schema["required"].count("idempotency_key") == 1
    first, second = [entry for entry in stub_log(log) if entry["session"] == "run-7"]
    assert (first["session"], first["step"]) == ("run-7", "step-1")
    assert (second["session"], second["step"], second["key"]) == ("run-7", "step-2", "step-2")


@pytest.mark.anyio
async def test_an_upstream_dying_mid_call_is_ambiguous_and_never_rerun(
    shared_stub: Path, stub_client: Client
) -> None:
    log, client = shared_stub.parent / "stub.jsonl", stub_client
    first = await call(client, "die_after_recording", {"note": "x", "idempotency_key": "die-1"})
    await eventually(lambda: _succeeds(client, "ping"))  # the stub was restarted
    again = await call(client, "die_after_recording", {"note": "x", "idempotency_key": "die-1"})
    assert error_code(first) == error_code(again) == "operation_outcome_unknown"
    assert operation(again)["state"] == "UNKNOWN"
    assert [entry["tool"] for entry in stub_log(log)].count("die_after_recording") == 1


@pytest.mark.anyio
async def test_upstream_error_results_become_outcomes(stub_client: Client) -> None:
    client = stub_client
    limited = await call(client, "rate_limited", {"note": "x", "idempotency_key": "rl-1"})
    refused = await call(client, "refuse", {"note": "acme", "idempotency_key": "rf-1"})
    # a keyed tool's isError is final whatever its words: the upstream ran it
    assert error_code(limited) == "operation_failed" and operation(limited)["attempts"] == 1
    assert operation(limited)["state"] == "FAILED_FINAL"
    assert error_code(refused) == "operation_failed" and operation(refused)["state"] == "FAILED_FINAL"
    assert "account for 'acme' is closed" in text(refused)


@pytest.fixture
def http_stub(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "stub-http.jsonl"
    env = {**os.environ, "STUB_LOG": str(log), "STUB_TOKEN": "up-secret-5e1f"}
    process = subprocess.Popen(
        [sys.executable, str(TESTS_DIR / "support" / "upstream_server.py"), "http"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip(), log
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.anyio
async def test_a_streamable_http_upstream_gets_its_secret_header(
    tmp_path: Path, http_stub: tuple[str, Path]
) -> None:
    url, log = http_stub
    policy = tmp_path / "http.toml"
    policy.write_text(
        SERVER.format(ledger=tmp_path / "ledger.db")
        + f'\n[upstreams.stub]\nurl = "{url}"\ntransport = "streamable-http"\n'
        + 'headers = { Authorization = "Bearer ${STUB_TOKEN}" }\n\n'
        + stub_tools()
    )
    stderr = tmp_path / "stderr.log"
    async with serve(policy, stderr, {"STUB_TOKEN": "up-secret-5e1f"}) as client:
        result = await call(client, "record", {"note": "over http", "idempotency_key": "h-1"}, session="web")
        replay = await call(client, "record", {"note": "over http", "idempotency_key": "h-1"}, session="web")
    assert not result.is_error, text(result)
    assert operation(replay)["replayed"] is True
    (entry,) = stub_log(log)
    assert entry["authorized"] is True and (entry["session"], entry["step"]) == ("web", "h-1")
    assert "up-secret-5e1f" not in stderr.read_text()


async def _next_attempt(memory: Memory) -> None:
    """Wait for the next (refused) start of the memory server: a new pid in its file."""
    pid = memory.pid()
    await eventually(lambda: memory.pid() not in (None, pid), within=30)


@pytest.mark.anyio
async def test_an_upstream_that_comes_up_later_is_served_with_its_own_tools(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "stub-late.jsonl"
    policy = tmp_path / "late.toml"
    policy.write_text(
        SERVER.format(ledger=tmp_path / "ledger.db")
        + f'\n[upstreams.stub]\nurl = "http://127.0.0.1:{port}/mcp"\ntransport = "streamable-http"\n'
        + f'\n[tools.record_keyed]\nupstream = "stub"\nclass = "key-required"\n{FAST_RETRY}\n'
    )
    note = {"note": "late", "idempotency_key": "late-1"}
    gate = tmp_path / "up"
    upstream = subprocess.Popen(  # started now, so it is ready to listen the moment the gate opens
        [sys.executable, str(TESTS_DIR / "support" / "upstream_server.py"), "http", str(port)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "STUB_LOG": str(log), "STUB_GATE": str(gate)},
    )
    try:
        async with serve(policy, tmp_path / "stderr.log") as client:

            async def schema() -> dict[str, Any]:
                tools = {t.name: t for t in (await client.list_tools()).tools}
                return dict(tools["record_keyed"].input_schema)

            # nothing known but the policy
            assert set((await schema())["properties"]) == {"idempotency_key", "confirm_duplicate"}
            assert error_code(await call(client, "record_keyed", note, session="s")) == "retries_exhausted"
            async with client.listen(tools_list_changed=True) as changes:
                gate.touch()  # the upstream comes up
                with anyio.fail_after(40):  # the reconnect backoff, then the announcement
                    assert isinstance(await changes.__anext__(), ToolsListChanged)
                assert {"note", "idempotency_key"} <= set((await schema())["properties"])
                first = await call(client, "record_keyed", note, session="s")
                again = await call(client, "record_keyed", note, session="s")
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    assert not first.is_error, text(first)
    assert operation(first)["replayed"] is False and operation(again)["replayed"] is True
    (entry,) = stub_log(log)  # one effect, and the key reached the tool's own argument
    assert (entry["key"], entry["step"], entry["session"]) == ("late-1", "late-1", "s")


# --- a chain: commitgate in front of commitgate -------------------------------------------------------


@pytest.mark.anyio
async def test_a_chain_of_commitgate_servers_dedups_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox = tmp_path / "sandbox.db"
    inner = tmp_path / "inner.toml"
    inner.write_text(
        SERVER.format(ledger=tmp_path / "inner-ledger.db")
        + '\n[tools.send_email]\nclass = "key-required"\npython = "commitgate.server.demo.tools:send_email"\n'
    )
    upstream = (
        f'\n[upstreams.inner]\ncommand = "{CONSOLE_SCRIPT}"\nargs = ["serve", "--policy", "{inner}"]\n'
        f'env = {{ COMMITGATE_SANDBOX = "{sandbox}" }}\n'
        '\n[tools.send_email]\nupstream = "inner"\nclass = "key-required"\n'
    )
    mail = {"to": "bob@example.com", "subject": "Hi", "body": "Hello", "idempotency_key": "mail-1"}
    outers = []
    for outer_ledger in ("outer-1.db", "outer-2.db"):  # the second outer remembers nothing
        outer = tmp_path / f"{outer_ledger}.toml"
        outer.write_text(SERVER.format(ledger=tmp_path / outer_ledger) + upstream)
        outers.append(serve(outer, tmp_path / f"{outer_ledger}.stderr.log"))
    async with together(*outers) as (one, two):  # started side by side, called one after the other
        first = await call(one, "send_email", mail, session="chain-1")
        second = await call(two, "send_email", mail, session="chain-1")
    assert not first.is_error and not second.is_error, (text(first), text(second))
    assert operation(first)["replayed"] is False and operation(second)["replayed"] is False  # outer view
    assert second.structured_content == first.structured_content  # the inner server replayed its answer
    monkeypatch.setenv(demo.ENV_PATH, str(sandbox))
    assert demo.count("emails") == 1


# --- helpers -----------------------------------------------------------------------------------------


async def _succeeds(client: Client, tool: str) -> bool:
    return not (await call(client, tool, {})).is_error


# --- the manager, in process ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_upstream_down_at_start_leaves_the_server_up(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        SERVER.format(ledger=tmp_path / "ledger.db")
        + '\n[upstreams.gone]\ncommand = "false"\n\n[tools.act]\nupstream = "gone"\nclass = "key-required"\n'
        + FAST_RETRY
        + '\ninput_schema = { type = "object", properties = { n = { type = "integer" } } }\n'
    )
    gateway = await Gateway.open(load_policy(policy), policy)
    try:
        (act,) = [t for t in gateway.list_tools() if t.name == "act"]
        # the declared fallback schema
        assert set(act.input_schema["properties"]) == {"n", "idempotency_key", "confirm_duplicate"}
        result = await gateway.call_tool("act", {"n": 1, "idempotency_key": "a-1"}, None, None)
        assert result.structured_content is not None
        assert result.structured_content["error"]["code"] == "retries_exhausted"
        assert "not connected" in result.structured_content["error"]["message"]
    finally:
        await gateway.close()


@pytest.mark.anyio
async def test_a_reload_connects_the_new_declaration_before_retiring_the_old(stub: Path) -> None:
    from commitgate.tools.upstream import UpstreamManager

    old = load_policy(stub)
    new = load_policy(stub).model_copy(deep=True)
    new.upstreams["stub"].env["STUB_EXTRA"] = "1"  # another declaration of the same upstream
    manager = UpstreamManager()
    try:
        await manager.update(old)
        before = manager.lookup(old)("stub")
        await manager.update(new, retire=False)
        after = manager.lookup(new)("stub")
        assert before is not after
        assert before is not None and before.connected  # still serving the old policy
        await manager.retire(new)
        assert not before.connected
        assert after is not None and after.connected
    finally:
        await manager.aclose()


@pytest.mark.anyio
async def test_an_upstream_that_drops_a_declared_tool_leaves_the_served_tools_as_they_are(stub: Path) -> None:
    from commitgate.server.serve.reload import refresh_upstream_tools

    gateway = await Gateway.open(load_policy(stub), stub)
    announced: list[bool] = []

    async def announce() -> None:
        announced.append(True)

    try:
        assert gateway.upstreams is not None
        source = gateway.served["record"].guard.source
        assert isinstance(source, UpstreamTool)
        connection = source.connection
        assert connection is not None and await connection.ready(30) is not None
        await refresh_upstream_tools(gateway, announce)  # what serving does once it connected
        before, announced[:] = gateway.list_tools(), []
        assert await refresh_upstream_tools(gateway, announce) is False  # same tools: nothing to tell
        del connection.tools["record"]  # as if it came back without `record`
        assert await refresh_upstream_tools(gateway, announce) is False
        assert gateway.list_tools() == before and announced == []
        result = await gateway.call_tool("ping", {}, None, None)
        assert not result.is_error
    finally:
        await gateway.close()
