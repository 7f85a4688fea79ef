"""Everything but the guard passes through: resources, prompts, completions, logging, progress and
the upstream's questions to the client, through real `commitgate serve` processes wrapping two real
upstreams (tests/support/relay_upstream.py), with real MCP clients in both protocol eras, over
stdio (both transports) and HTTP (streamable and SSE).

Effects are counted in the upstreams' own record (`effects.jsonl`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.subscriptions import (
    PromptsListChanged,
    ResourcesListChanged,
    ResourceUpdated,
    ToolsListChanged,
)
from mcp.types import (
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    AudioContent,
    BlobResourceContents,
    ElicitResult,
    EmbeddedResource,
    ImageContent,
    ListRootsResult,
    PromptReference,
    ResourceLink,
    ResourceTemplateReference,
    Root,
    TextContent,
    TextResourceContents,
)
from support import http_servers
from support.wrapping import CONSOLE_SCRIPT, TESTS_DIR, base_env, error_code, eventually, operation, text

UPSTREAM = TESTS_DIR / "support" / "relay_upstream.py"
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
ERAS = {"legacy": "2025-11-25", "auto": "2026-07-28"}


def policy(root: Path, sessions: str = "shared", bare: bool = False) -> Path:
    def upstream(name: str, tools: str, sessions: str = "shared") -> str:
        return f"""
[upstreams.{name}]
command = "{sys.executable}"
args = ["{UPSTREAM}"]
env = {{ RELAY_NAME = "{name}", RELAY_DIR = "{root}" }}
tools = "{tools}"
sessions = "{sessions}"
"""

    path = root / "policy.toml"
    path.write_text(
        f"""
[server]
name = "relay-test"
lease = "5s"
respond_within = "20s"

[ledger]
url = "sqlite:///{root / "ledger.db"}"
synchronous = "NORMAL"
{upstream("alpha", "all", sessions)}
{upstream("beta", "listed")}
[tools.beta_chatter]
upstream = "beta"
upstream_tool = "chatter"
class = "safe-retry"
{upstream("gamma", "listed") if bare else ""}
""",
        encoding="utf-8",
    )
    return path


def effects(root: Path, **match: Any) -> list[dict[str, Any]]:
    path = root / "effects.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    found = [json.loads(line) for line in lines]
    return [e for e in found if all(e.get(k) == v for k, v in match.items())]


class Heard:
    """What a client heard from the server besides answers."""

    def __init__(self) -> None:
        self.logs: list[Any] = []
        self.asked: list[str] = []
        self.messages: list[Any] = []

    def options(self, reply: str = "yes") -> dict[str, Any]:
        async def on_log(params: Any) -> None:
            self.logs.append(params)

        async def on_elicit(context: Any, params: Any) -> ElicitResult:
            self.asked.append(params.message)
            return ElicitResult(action="accept", content={"reply": reply})

        async def on_sample(context: Any, params: Any) -> Any:
            from mcp.types import CreateMessageResult

            self.asked.append(params.messages[0].content.text)
            return CreateMessageResult(
                role="assistant", content=TextContent(type="text", text="forty-two"), model="test-model"
            )

        async def on_roots(context: Any) -> ListRootsResult:
            return ListRootsResult(roots=[Root(uri="file:///work/project", name="project")])

        async def on_message(message: Any) -> None:
            self.messages.append(message)

        return {
            "logging_callback": on_log,
            "elicitation_callback": on_elicit,
            "sampling_callback": on_sample,
            "list_roots_callback": on_roots,
            "message_handler": on_message,
        }

    def methods(self) -> list[str]:
        return [getattr(m, "method", type(m).__name__) for m in self.messages]


@contextlib.asynccontextmanager
async def stdio_served(
    root: Path, mode: str, heard: Heard, stdio: str = "fast", bare: bool = False
) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=str(CONSOLE_SCRIPT),
        args=["serve", "--policy", str(policy(root, bare=bare)), "--stdio", stdio],
        env=base_env(),
    )
    with (root / "serve.stderr").open("a", encoding="utf-8") as errlog:
        log_level: Any = "debug" if mode == "auto" else None
        async with Client(
            stdio_client(params, errlog=errlog),
            mode=mode,
            read_timeout_seconds=60,
            log_level=log_level,
            **heard.options(),
        ) as client:
            yield client


async def connected(client: Client) -> None:
    """Both upstreams connected (they start in the background)."""

    async def both() -> bool:
        uris = {r.uri for r in (await client.list_resources()).resources}
        return {"test://alpha/text", "test://beta/text"} <= uris

    await eventually(both, within=30)


async def walk_through(client: Client, root: Path, heard: Heard, mode: str, tag: str = "") -> None:
    """What every transport and era must show (`tag` keeps keys and markers apart on a shared server)."""
    assert client.protocol_version == ERAS[mode]
    capabilities = client.server_capabilities
    assert (
        capabilities.resources and capabilities.prompts and capabilities.completions and capabilities.logging
    )
    await connected(client)

    # resources: one list in policy order, URIs as the upstreams gave them, the first lister serves
    listed = (await client.list_resources()).resources
    assert [r.uri for r in listed] == [
        "test://alpha/text",
        "test://alpha/blob",
        "test://shared/readme",
        "test://beta/text",
        "test://beta/blob",
    ]
    assert listed[0].meta and listed[0].meta["ui"]["resourceUri"] == "ui://alpha/view"
    readme = (await client.read_resource("test://shared/readme")).contents[0]
    assert isinstance(readme, TextResourceContents) and readme.text == "readme of alpha"
    blob = (await client.read_resource("test://beta/blob")).contents[0]
    assert isinstance(blob, BlobResourceContents) and base64.b64decode(blob.blob) == PIXEL
    templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates]
    assert templates == ["test://alpha/items/{item_id}", "test://beta/items/{item_id}"]
    item = (await client.read_resource("test://beta/items/7")).contents[0]
    assert isinstance(item, TextResourceContents) and json.loads(item.text) == {"server": "beta", "item": "7"}

    # prompts: a shared name served as UPSTREAM__NAME for both, routed, content unchanged
    prompts = [p.name for p in (await client.list_prompts()).prompts]
    assert prompts == ["alpha__greet", "alpha_rich", "beta__greet", "beta_rich"]
    greeting = (await client.get_prompt("beta__greet", {"name": "Ada"})).messages[0].content
    assert isinstance(greeting, TextContent) and greeting.text == "beta greets Ada"
    rich_prompt = (await client.get_prompt("alpha_rich")).messages
    assert isinstance(rich_prompt[0].content, ImageContent) and isinstance(
        rich_prompt[1].content, EmbeddedResource
    )

    # completions, routed by prompt and by template
    done = await client.complete(
        PromptReference(type="ref/prompt", name="beta__greet"), {"name": "name", "value": "A"}
    )
    assert done.completion.values == ["Ada@beta", "Alan@beta"]
    template = ResourceTemplateReference(type="ref/resource", uri="test://alpha/items/{item_id}")
    assert (await client.complete(template, {"name": "item_id", "value": "2"})).completion.values == ["2"]

    # tools: the upstream's _meta and outputSchema on the definition, every content type in the result
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert tools["rich"].meta and tools["rich"].meta["ui"]["resourceUri"] == "ui://alpha/view"
    assert tools["rich"].output_schema and "count" in tools["rich"].output_schema["properties"]
    rich = await client.call_tool("rich", {})
    kinds = [type(block) for block in rich.content]
    assert kinds == [TextContent, ImageContent, AudioContent, ResourceLink, EmbeddedResource], rich
    assert rich.content[0].meta == {"note": "kept"}
    assert rich.structured_content == {"count": 5}
    assert rich.meta and rich.meta["ui"]["resourceUri"] == "ui://alpha/view"
    assert rich.meta["example.com/trace"] == "abc" and "commitgate/operation" not in rich.meta

    # logging and progress: the upstream's messages reach the caller, under its own token
    if mode == "legacy":
        await client.set_logging_level("debug")
        await eventually(lambda: len(effects(root, tool="logging/setLevel", level="debug")) >= 2)
    heard_progress: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard_progress.append(message)

    marker = f"m1{tag}"
    said = await client.call_tool("beta_chatter", {"marker": marker}, progress_callback=on_progress)
    assert text(said) == f"{marker} done"
    assert heard_progress == [f"{marker} step 1", f"{marker} step 2"]
    logs = [(entry.logger, entry.data) for entry in heard.logs]
    assert ("beta/chatter", f"{marker} log 1") in logs and ("beta/chatter", f"{marker} log 2") in logs

    # a keyed tool without its key is refused before anything reaches the upstream
    refused = await client.call_tool("ask", {"topic": f"nothing{tag}"})
    assert error_code(refused) == "idempotency_key_required"
    assert effects(root, tool="ask", topic=f"nothing{tag}") == [] and heard.asked == []
    await asked_during_keyed_call(client, root, heard, tag)


async def asked_during_keyed_call(client: Client, root: Path, heard: Heard, tag: str) -> None:
    """The upstream asks the client during a keyed call: the answer reaches the tool, the effect
    happens once, and the replay asks nobody."""
    topic, key = f"colour{tag}", f"ask-1{tag}"
    first = await client.call_tool("ask", {"topic": topic, "idempotency_key": key})
    assert first.structured_content is not None, first
    assert (first.structured_content["action"], first.structured_content["reply"]) == ("accept", "yes")
    assert heard.asked == [f"{topic}: what do you say?"]
    again = await client.call_tool("ask", {"topic": topic, "idempotency_key": key})
    assert operation(again)["replayed"] is True and again.structured_content == first.structured_content
    assert heard.asked == [f"{topic}: what do you say?"]
    assert [e["reply"] for e in effects(root, tool="ask", topic=topic)] == ["yes"]
    # sampling and roots, asked by safe-retry tools
    assert text(await client.call_tool("sample", {"prompt": "meaning of life?"})) == "model said: forty-two"
    assert heard.asked[-1] == "meaning of life?"
    assert (await client.call_tool("roots", {})).structured_content == {"result": ["file:///work/project"]}


@pytest.mark.anyio
@pytest.mark.parametrize(("mode", "stdio"), [("legacy", "fast"), ("auto", "fast"), ("legacy", "sdk")])
async def test_stdio_passes_everything_through(tmp_path: Path, mode: str, stdio: str) -> None:
    heard = Heard()
    async with stdio_served(tmp_path, mode, heard, stdio) as client:
        await walk_through(client, tmp_path, heard, mode)


# --- HTTP: one server per transport for the module, two principals ------------------------------------


@pytest.fixture(scope="module")
def http_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("relay-http")
    path = policy(root)
    path.write_text(path.read_text(encoding="utf-8") + http_servers.auth_section(), encoding="utf-8")
    return root


@pytest.fixture(scope="module", params=["streamable-http", "sse"])
def http_served(request: pytest.FixtureRequest, http_root: Path) -> Any:
    transport = request.param
    with http_servers.running(
        http_root,
        http_root / "policy.toml",
        transport,
        ledger=http_root / f"{transport}.db",
        sandbox=http_root / "sandbox",
    ) as served:
        yield served


@contextlib.asynccontextmanager
async def http_client(served: Any, principal: str, mode: str, heard: Heard) -> AsyncIterator[Client]:
    import httpx2
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client

    headers = http_servers.bearer(principal)
    log_level: Any = "debug" if mode == "auto" else None
    options: dict[str, Any] = {
        "mode": mode,
        "log_level": log_level,
        "read_timeout_seconds": 60,
        **heard.options(),
    }
    if served.transport == "sse":
        async with Client(sse_client(served.endpoint, headers=headers), **options) as client:
            yield client
        return
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http,
        Client(streamable_http_client(served.endpoint, http_client=http), **options) as client,
    ):
        yield client


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_http_passes_everything_through(http_served: Any, http_root: Path, mode: str) -> None:
    if http_served.transport == "sse" and mode == "auto":
        pytest.skip("SSE is a handshake-era transport")
    heard = Heard()
    async with http_client(http_served, "alice", mode, heard) as client:
        await walk_through(client, http_root, heard, mode, tag=f"-{http_served.transport}-{mode}")


@pytest.mark.anyio
async def test_two_clients_never_hear_each_other(http_served: Any, http_root: Path) -> None:
    """Two principals calling at once through one shared upstream session: each hears its own
    progress (mapped by token) and never the other's progress, logs or questions; a question the
    upstream asks while both are in flight reaches no one (it cannot be told whose it is)."""
    tag = http_served.transport
    alice, bob = Heard(), Heard()
    heard: dict[str, list[str | None]] = {"alice": [], "bob": []}

    def on_progress(who: str) -> Any:
        async def record(progress: float, total: float | None, message: str | None) -> None:
            heard[who].append(message)

        return record

    release = http_root / "release"
    async with (
        http_client(http_served, "alice", "legacy", alice) as a,
        http_client(http_served, "bob", "legacy", bob) as b,
    ):
        await connected(a)
        for client in (a, b):
            await client.set_logging_level("debug")
        results: dict[str, Any] = {}

        async def chatter(who: str, client: Client, marker: str) -> None:
            results[who] = await client.call_tool(
                "chatter", {"marker": marker, "hold": True}, progress_callback=on_progress(who)
            )

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(chatter, "alice", a, f"A-{tag}")
                group.start_soon(chatter, "bob", b, f"B-{tag}")
                await eventually(lambda: len(effects(http_root, tool="chatter", phase="started")) >= 2)
                # both in flight on the upstream: a question now cannot be told whose it is
                asked = await b.call_tool("ask", {"topic": f"both-{tag}", "idempotency_key": f"both-{tag}"})
                assert asked.is_error, asked
                release.touch()
        finally:
            release.unlink(missing_ok=True)
        assert heard["alice"] == [f"A-{tag} step 1", f"A-{tag} step 2"]
        assert heard["bob"] == [f"B-{tag} step 1", f"B-{tag} step 2"]
        assert all(str(entry.data).startswith(f"A-{tag}") for entry in alice.logs), alice.logs
        assert all(str(entry.data).startswith(f"B-{tag}") for entry in bob.logs), bob.logs
        assert alice.asked == [] and bob.asked == []
        assert effects(http_root, tool="ask", topic=f"both-{tag}") == []
        # alone on the upstream, bob's question reaches bob, and only bob
        alone = await b.call_tool("ask", {"topic": f"alone-{tag}", "idempotency_key": f"alone-{tag}"})
        assert alone.structured_content and alone.structured_content["reply"] == "yes", alone
        assert bob.asked == [f"alone-{tag}: what do you say?"] and alice.asked == []
        assert len(effects(http_root, tool="ask", topic=f"alone-{tag}")) == 1


# --- what changes while serving, and cancellation (stdio, handshake era) ------------------------------


@pytest.mark.anyio
async def test_changes(tmp_path: Path) -> None:
    heard = Heard()
    async with stdio_served(tmp_path, "legacy", heard, bare=True) as client:
        await connected(client)
        # an upstream with no tool entry is connected all the same: its resources and prompts are
        # served, its tools are not
        await eventually(
            lambda: _has(client.list_resources(), "resources", "uri", "test://gamma/text"), within=30
        )
        assert {p.name for p in (await client.list_prompts()).prompts} >= {"gamma__greet", "gamma_rich"}
        assert "gamma__chatter" not in {t.name for t in (await client.list_tools()).tools}

        # a subscription is forwarded, and the upstream's updates reach the subscriber
        await client.subscribe_resource("test://alpha/text")
        assert effects(tmp_path, tool="resources/subscribe") == [
            {"server": "alpha", "tool": "resources/subscribe", "uri": "test://alpha/text"}
        ]
        await client.call_tool("touch", {"uri": "test://alpha/text"})

        def said(method: str) -> list[Any]:
            return [m for m in heard.messages if getattr(m, "method", None) == method]

        updated = await eventually(lambda: said("notifications/resources/updated"))
        assert [m.params.uri for m in updated] == ["test://alpha/text"]
        await eventually(lambda: said("notifications/resources/list_changed"))
        await eventually(lambda: said("notifications/prompts/list_changed"))
        await client.unsubscribe_resource("test://alpha/text")
        await eventually(lambda: effects(tmp_path, tool="resources/unsubscribe"))

        # the upstream's own tools/list_changed: its new tool is served at once (tools = "all")
        announced = len(said("notifications/tools/list_changed"))
        await client.call_tool("grow", {"name": "sprout"})
        await eventually(lambda: _has(client.list_tools(), "tools", "name", "sprout"))
        await eventually(lambda: len(said("notifications/tools/list_changed")) > announced)
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["sprout"].description and tools["sprout"].description.startswith("The sprout tool.")
        assert text(await client.call_tool("sprout", {"text": "hi"})) == "sprout says hi"
        await cancellations(client, tmp_path)


@pytest.mark.anyio
async def test_changes_reach_a_listening_client(tmp_path: Path) -> None:
    """2026-07-28: the same changes arrive on the client's `subscriptions/listen` stream, and the
    resources it names there are subscribed upstream while it listens."""
    heard = Heard()
    async with stdio_served(tmp_path, "auto", heard) as client:
        await connected(client)
        uri = "test://alpha/text"
        async with client.listen(
            tools_list_changed=True,
            prompts_list_changed=True,
            resources_list_changed=True,
            resource_subscriptions=[uri],
        ) as changes:
            await eventually(lambda: effects(tmp_path, tool="resources/subscribe", uri=uri))
            await client.call_tool("touch", {"uri": uri})
            await client.call_tool("grow", {"name": "sprout"})
            wanted = {
                ResourceUpdated(uri=uri),
                ResourcesListChanged(),
                PromptsListChanged(),
                ToolsListChanged(),
            }
            seen: set[Any] = set()
            with anyio.fail_after(30):
                async for event in changes:
                    seen.add(event)
                    if wanted <= seen:
                        break
        await eventually(lambda: effects(tmp_path, tool="resources/unsubscribe", uri=uri))
        assert text(await client.call_tool("sprout", {"text": "hi"})) == "sprout says hi"
        await cancellations(client, tmp_path)


async def cancellations(client: Client, root: Path) -> None:
    """A safe-retry call the client cancels is cancelled upstream too; a keyed one runs to its
    recorded outcome, once."""
    async with anyio.create_task_group() as group:
        group.start_soon(client.call_tool, "slow", {"marker": "s1"})
        await eventually(lambda: effects(root, tool="slow", phase="started"))
        group.cancel_scope.cancel()
    await eventually(lambda: effects(root, tool="slow", phase="cancelled"))

    # a keyed call the client cancels runs to its recorded outcome, once
    async with anyio.create_task_group() as group:
        group.start_soon(client.call_tool, "hold_record", {"note": "n1", "idempotency_key": "hold-1"})
        await eventually(lambda: effects(root, tool="hold_record", phase="started"))
        group.cancel_scope.cancel()
    (root / "release-hold").touch()
    await eventually(lambda: effects(root, tool="hold_record", phase="done"))

    async def succeeded() -> bool:
        status = await client.call_tool("get_operation_status", {"idempotency_key": "hold-1"})
        return (
            bool(status.structured_content) and status.structured_content["operation"]["state"] == "SUCCEEDED"
        )

    await eventually(succeeded)
    assert [e["phase"] for e in effects(root, tool="hold_record")] == ["started", "done"]


# --- sessions = "per-client" --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_per_client_sessions(tmp_path: Path) -> None:
    """Each client session calls through an upstream session of its own, closed with it: a question
    asked while another client's call is in flight reaches its own client."""
    path = policy(tmp_path, sessions="per-client")
    path.write_text(path.read_text(encoding="utf-8") + http_servers.auth_section(), encoding="utf-8")
    alice, bob = Heard(), Heard()
    release = tmp_path / "release"
    with http_servers.running(
        tmp_path, path, "streamable-http", ledger=tmp_path / "ledger-http.db", sandbox=tmp_path / "sandbox"
    ) as served:
        async with http_client(served, "bob", "legacy", bob) as b:
            async with http_client(served, "alice", "legacy", alice) as a:
                await connected(a)
                pid_a = (await a.call_tool("whoami", {})).structured_content
                pid_b = (await b.call_tool("whoami", {})).structured_content
                assert pid_a and pid_b and pid_a != pid_b
                assert (await a.call_tool("whoami", {})).structured_content == pid_a
                async with anyio.create_task_group() as group:
                    group.start_soon(a.call_tool, "chatter", {"marker": "A", "hold": True})
                    await eventually(lambda: effects(tmp_path, tool="chatter", phase="started"))
                    asked = await b.call_tool("ask", {"topic": "mine", "idempotency_key": "mine-1"})
                    release.touch()
                assert asked.structured_content and asked.structured_content["reply"] == "yes", asked
                assert bob.asked == ["mine: what do you say?"] and alice.asked == []
                assert len(effects(tmp_path, tool="ask", topic="mine")) == 1
            # alice's session ended: so did her upstream session; bob's lives on
            await eventually(lambda: not _alive(pid_a["result"]))
            assert _alive(pid_b["result"])
            assert (await b.call_tool("whoami", {})).structured_content == pid_b


async def _has(listing: Any, items: str, key: str, value: str) -> bool:
    return any(getattr(item, key) == value for item in getattr(await listing, items))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- nobody to serve it ---------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("upstream", [True, False])
async def test_nobody_to_serve_it_answers_as_a_server_without_it(tmp_path: Path, upstream: bool) -> None:
    """With an upstream that is not connected, the capabilities are advertised and answered as a
    server with nothing to offer; with no upstream at all, not advertised (method not found)."""
    declared = f"""
[upstreams.down]
command = "{sys.executable}"
args = ["-c", "raise SystemExit(3)"]
tools = "all"
"""
    path = tmp_path / "policy.toml"
    path.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n' + (declared if upstream else ""),
        encoding="utf-8",
    )
    params = StdioServerParameters(
        command=str(CONSOLE_SCRIPT), args=["serve", "--policy", str(path)], env=base_env()
    )
    with (tmp_path / "serve.stderr").open("a", encoding="utf-8") as errlog:
        async with Client(
            stdio_client(params, errlog=errlog), mode="legacy", read_timeout_seconds=60
        ) as client:
            capabilities = client.server_capabilities
            if not upstream:
                assert capabilities.resources is None and capabilities.prompts is None
                with pytest.raises(MCPError) as unknown:
                    await client.list_resources()
                assert unknown.value.error.code == METHOD_NOT_FOUND
                return
            assert capabilities.resources and capabilities.resources.subscribe and capabilities.prompts
            assert (await client.list_resources()).resources == []
            assert (await client.list_resource_templates()).resource_templates == []
            assert (await client.list_prompts()).prompts == []
            with pytest.raises(MCPError) as missing:
                await client.read_resource("test://nowhere")
            assert missing.value.error.code == -32002
            with pytest.raises(MCPError) as no_prompt:
                await client.get_prompt("nothing")
            assert no_prompt.value.error.code == INVALID_PARAMS
            done = await client.complete(
                PromptReference(type="ref/prompt", name="nothing"), {"name": "a", "value": ""}
            )
            assert done.completion.values == []
            await client.set_logging_level("info")


def test_policy_show_warns_of_a_uri_two_upstreams_list(tmp_path: Path) -> None:
    import subprocess

    command = [str(CONSOLE_SCRIPT), "policy", "show", "--upstreams", "--json", str(policy(tmp_path))]
    shown = json.loads(
        subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    )
    warnings = {item["name"]: item["warnings"] for item in shown["upstream_inventory"]}
    assert warnings["alpha"] == []
    assert len(warnings["beta"]) == 1 and "test://shared/readme" in warnings["beta"][0]
    assert "upstream alpha, which serves it" in warnings["beta"][0]


# --- a 2026-07-28 upstream over streamable HTTP --------------------------------------------------------


@pytest.mark.anyio
async def test_an_http_upstream_of_the_other_era(tmp_path: Path) -> None:
    """An HTTP upstream speaks 2026-07-28 to commitgate while the client speaks the handshake era:
    its questions (asked as rounds of the call), progress, logs and change notifications still
    reach the client."""
    import subprocess

    env = {**base_env(RELAY_NAME="web", RELAY_DIR=str(tmp_path))}
    upstream = subprocess.Popen(
        [sys.executable, str(UPSTREAM), "http"], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert upstream.stdout is not None
        url = upstream.stdout.readline().strip()
        path = tmp_path / "policy.toml"
        path.write_text(
            f'[server]\nrespond_within = "20s"\n[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
            f'[upstreams.web]\nurl = "{url}"\ntools = "all"\n',
            encoding="utf-8",
        )
        heard = Heard()
        params = StdioServerParameters(
            command=str(CONSOLE_SCRIPT), args=["serve", "--policy", str(path)], env=base_env()
        )
        with (tmp_path / "serve.stderr").open("a", encoding="utf-8") as errlog:
            async with Client(
                stdio_client(params, errlog=errlog), mode="legacy", read_timeout_seconds=60, **heard.options()
            ) as client:

                async def listed() -> bool:
                    return "test://web/text" in {r.uri for r in (await client.list_resources()).resources}

                await eventually(listed, within=30)
                blob = (await client.read_resource("test://web/blob")).contents[0]
                assert isinstance(blob, BlobResourceContents) and base64.b64decode(blob.blob) == PIXEL
                greeting = (await client.get_prompt("greet", {"name": "Ada"})).messages[0].content
                assert isinstance(greeting, TextContent) and greeting.text == "web greets Ada"

                await client.set_logging_level("debug")
                heard_progress: list[str | None] = []

                async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                    heard_progress.append(message)

                said = await client.call_tool("chatter", {"marker": "w"}, progress_callback=on_progress)
                assert text(said) == "w done" and heard_progress == ["w step 1", "w step 2"]
                assert [(e.logger, e.data) for e in heard.logs] == [
                    ("web/chatter", "w log 1"),
                    ("web/chatter", "w log 2"),
                ]

                first = await client.call_tool("ask", {"topic": "web", "idempotency_key": "web-1"})
                assert json.loads(first.content[0].text)["reply"] == "yes", first  # type: ignore[union-attr]
                assert first.meta is not None and not any(
                    k.startswith("io.modelcontextprotocol/") for k in first.meta
                )
                again = await client.call_tool("ask", {"topic": "web", "idempotency_key": "web-1"})
                assert operation(again)["replayed"] is True
                assert heard.asked == ["web: what do you say?"]
                assert len(effects(tmp_path, tool="ask", topic="web")) == 1

                def said_to(method: str) -> bool:
                    return any(getattr(m, "method", None) == method for m in heard.messages)

                await client.call_tool("touch", {"uri": "test://web/text"})
                await eventually(lambda: said_to("notifications/resources/list_changed"))
                await eventually(lambda: said_to("notifications/prompts/list_changed"))
                await client.call_tool("grow", {"name": "sprout"})
                await eventually(lambda: said_to("notifications/tools/list_changed"))
                assert text(await client.call_tool("sprout", {"text": "hi"})) == "sprout says hi"
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
