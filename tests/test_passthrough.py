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
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import (
    AudioContent,
    BlobResourceContents,
    CompletionArgument,
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


def policy(root: Path) -> Path:
    def upstream(name: str, tools: str) -> str:
        return f"""
[upstreams.{name}]
command = "{sys.executable}"
args = ["{UPSTREAM}"]
env = {{ RELAY_NAME = "{name}", RELAY_DIR = "{root}" }}
tools = "{tools}"
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
{upstream("alpha", "all")}
{upstream("beta", "listed")}
[tools.beta_chatter]
upstream = "beta"
upstream_tool = "chatter"
class = "safe-retry"
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
async def stdio_served(root: Path, mode: str, heard: Heard, stdio: str = "fast") -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=str(CONSOLE_SCRIPT),
        args=["serve", "--policy", str(policy(root)), "--stdio", stdio],
        env=base_env(),
    )
    with (root / "serve.stderr").open("a", encoding="utf-8") as errlog:
        log_level = "debug" if mode == "auto" else None
        async with Client(
            stdio_client(params, errlog=errlog), mode=mode, read_timeout_seconds=60, log_level=log_level, **heard.options()
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
    assert capabilities.resources and capabilities.prompts and capabilities.completions and capabilities.logging
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
    assert isinstance(rich_prompt[0].content, ImageContent) and isinstance(rich_prompt[1].content, EmbeddedResource)

    # completions, routed by prompt and by template
    done = await client.complete(PromptReference(type="ref/prompt", name="beta__greet"), {"name": "name", "value": "A"})
    assert done.completion.values == ["Ada@beta", "Alan@beta"]
    template = ResourceTemplateReference(type="ref/resource", uri="test://alpha/items/{item_id}")
    assert (await client.complete(template, {"name": "item_id", "value": "2"})).completion.values == ["2"]
    assert CompletionArgument  # the wire names above are the SDK's

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
    progress: list[str | None] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message)

    marker = f"m1{tag}"
    said = await client.call_tool("beta_chatter", {"marker": marker}, progress_callback=on_progress)
    assert text(said) == f"{marker} done"
    assert progress == [f"{marker} step 1", f"{marker} step 2"]
    logs = [(entry.logger, entry.data) for entry in heard.logs]
    assert ("beta/chatter", f"{marker} log 1") in logs and ("beta/chatter", f"{marker} log 2") in logs

    # a keyed tool without its key is refused before anything reaches the upstream
    refused = await client.call_tool("ask", {"topic": f"nothing{tag}"})
    assert error_code(refused) == "idempotency_key_required"
    assert effects(root, tool="ask", topic=f"nothing{tag}") == [] and heard.asked == []
    if mode == "legacy":
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
    log_level = "debug" if mode == "auto" else None
    options = {"mode": mode, "log_level": log_level, "read_timeout_seconds": 60, **heard.options()}
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
