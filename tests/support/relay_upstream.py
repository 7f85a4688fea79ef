"""An upstream MCP server with everything besides tools, for the passthrough tests (stdio).

    RELAY_NAME=alpha RELAY_DIR=/tmp/x python relay_upstream.py          # stdio
    RELAY_NAME=web RELAY_DIR=/tmp/x python relay_upstream.py http     # streamable HTTP; prints its URL

Resources (static text with `_meta`, binary, a URI every instance lists, a template), prompts (one
every instance offers, one of its own, one with an image and an embedded resource), completions,
`logging/setLevel` (recorded, and it filters the logs), subscriptions, and tools that ask the
client (elicitation, sampling, roots), report progress and log, return every content type, change
the server's lists and wait on files the test creates. Side effects append one JSON line to
`$RELAY_DIR/effects.jsonl`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import mcp.types as types
from mcp.server import ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

NAME = os.environ.get("RELAY_NAME", "alpha")
DIR = Path(os.environ.get("RELAY_DIR", "."))
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
UI = {"ui": {"resourceUri": f"ui://{NAME}/view", "visibility": ["model", "app"]}}
LEVELS = ["debug", "info", "notice", "warning", "error", "critical", "alert", "emergency"]

mcp = MCPServer(f"relay-{NAME}")
state: dict[str, Any] = {"level": "debug", "subscribed": []}


def effect(**fields: Any) -> int:
    with (DIR / "effects.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps({"server": NAME, **fields}) + "\n")
    return len((DIR / "effects.jsonl").read_text(encoding="utf-8").splitlines())


async def gate(name: str) -> None:
    while not (DIR / name).exists():
        await asyncio.sleep(0.02)


async def log(ctx: Context, level: str, text: str) -> None:
    if LEVELS.index(level) >= LEVELS.index(state["level"]):
        await ctx.log(level, text, logger_name="chatter")  # type: ignore[arg-type]


# --- resources ---------------------------------------------------------------------------------------


@mcp.resource(f"test://{NAME}/text", mime_type="text/plain", meta=UI)
def own_text() -> str:
    return f"text of {NAME}"


@mcp.resource(f"test://{NAME}/blob", mime_type="image/png")
def own_blob() -> bytes:
    return PIXEL


@mcp.resource("test://shared/readme", mime_type="text/plain")
def shared_readme() -> str:
    return f"readme of {NAME}"


@mcp.resource(f"test://{NAME}/items/{{item_id}}", mime_type="application/json")
def item(item_id: str) -> str:
    return json.dumps({"server": NAME, "item": item_id})


# --- prompts -----------------------------------------------------------------------------------------


@mcp.prompt()
def greet(name: str) -> str:
    """Greet someone (every instance offers it)."""
    return f"{NAME} greets {name}"


@mcp.prompt(name=f"{NAME}_rich")
def rich_prompt() -> list[Any]:
    """A prompt with an image and an embedded resource (bare content blocks: user messages)."""
    return [
        types.ImageContent(type="image", data=base64.b64encode(PIXEL).decode(), mime_type="image/png"),
        types.EmbeddedResource(
            type="resource",
            resource=types.TextResourceContents(
                uri=f"test://{NAME}/text", text=f"text of {NAME}", mime_type="text/plain"
            ),
        ),
    ]


@mcp.completion()
async def complete(ref: Any, argument: types.CompletionArgument, context: Any) -> types.Completion:
    if isinstance(ref, types.PromptReference):
        names = [n for n in ("Ada", "Alan", "Grace") if n.startswith(argument.value)]
        return types.Completion(values=[f"{n}@{NAME}" for n in names])
    return types.Completion(values=[v for v in ("1", "2", "3") if v.startswith(argument.value)])


# --- tools -------------------------------------------------------------------------------------------

READ_ONLY = types.ToolAnnotations(read_only_hint=True)


class Reply(BaseModel):
    reply: str


@mcp.tool()
async def ask(topic: str, ctx: Context) -> Any:
    """Ask the user about a topic, then record what they said (the effect)."""
    question = f"{topic}: what do you say?"
    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:  # no back-channel: the call's next round
        answered = (ctx.input_responses or {}).get("reply")
        if answered is None:
            request = types.ElicitRequest(
                params=types.ElicitRequestFormParams(
                    message=question, requested_schema=Reply.model_json_schema()
                )
            )
            return types.InputRequiredResult(input_requests={"reply": request}, request_state="ask")
        result = types.ElicitResult.model_validate(answered.model_dump(by_alias=True))
        action, reply = result.action, (result.content or {}).get("reply")
    else:
        answer = await ctx.elicit(question, Reply)
        action, reply = (
            answer.action,
            answer.data.reply if answer.action == "accept" and answer.data else None,
        )
    line = effect(tool="ask", topic=topic, action=action, reply=reply)
    said = {"topic": topic, "action": action, "reply": reply, "line": line}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(said))], structured_content=said
    )


@mcp.tool(annotations=READ_ONLY)
async def sample(prompt: str, ctx: Context) -> str:
    """Ask the client's model."""
    result = await ctx.session.create_message(
        messages=[types.SamplingMessage(role="user", content=types.TextContent(type="text", text=prompt))],
        max_tokens=50,
    )
    content = result.content
    return f"model said: {getattr(content, 'text', content)}"


@mcp.tool(annotations=READ_ONLY)
async def roots(ctx: Context) -> list[str]:
    """The client's roots."""
    listed = await ctx.session.list_roots()
    return [str(root.uri) for root in listed.roots]


@mcp.tool(annotations=READ_ONLY)
async def chatter(marker: str, ctx: Context, hold: bool = False) -> str:
    """Report progress and log, tagged with `marker`; with `hold`, wait for the file `release`
    between the first and the second round."""
    effect(tool="chatter", marker=marker, phase="started")
    await ctx.report_progress(1, 2, f"{marker} step 1")
    await log(ctx, "info", f"{marker} log 1")
    if hold:
        await gate("release")
    await ctx.report_progress(2, 2, f"{marker} step 2")
    await log(ctx, "debug", f"{marker} log 2")
    return f"{marker} done"


class Rich(BaseModel):
    count: int


@mcp.tool(annotations=READ_ONLY, meta=UI)
def rich() -> Annotated[types.CallToolResult, Rich]:
    """Every content type, structured content and the result's own `_meta`."""
    return types.CallToolResult(
        content=[
            types.TextContent(type="text", text="hello", _meta={"note": "kept"}),
            types.ImageContent(type="image", data=base64.b64encode(PIXEL).decode(), mime_type="image/png"),
            types.AudioContent(type="audio", data=base64.b64encode(b"RIFF").decode(), mime_type="audio/wav"),
            types.ResourceLink(type="resource_link", uri=f"test://{NAME}/text", name="text"),
            types.EmbeddedResource(
                type="resource",
                resource=types.BlobResourceContents(
                    uri=f"test://{NAME}/blob", blob=base64.b64encode(PIXEL).decode(), mime_type="image/png"
                ),
            ),
        ],
        structured_content={"count": 5},
        _meta={**UI, "example.com/trace": "abc"},
    )


@mcp.tool(annotations=READ_ONLY)
async def grow(name: str, ctx: Context) -> str:
    """Offer a new tool, and say the tool list changed."""

    def extra(text: str) -> str:
        return f"{name} says {text}"

    mcp.add_tool(extra, name=name, description=f"The {name} tool.", annotations=READ_ONLY)
    await changed(ctx.session.send_tool_list_changed(), ctx.notify_tools_changed())
    return name


@mcp.tool(annotations=READ_ONLY)
async def touch(uri: str, ctx: Context) -> str:
    """Say `uri` was updated, and that the resource and prompt lists changed."""
    await changed(ctx.session.send_resource_updated(uri), ctx.notify_resource_updated(uri))
    await changed(ctx.session.send_resource_list_changed(), ctx.notify_resources_changed())
    await changed(ctx.session.send_prompt_list_changed(), ctx.notify_prompts_changed())
    return uri


async def changed(handshake: Any, listen: Any) -> None:
    """Say it both ways: on the connection (handshake era) and on listen streams (2026-07-28)."""
    for saying in (handshake, listen):
        with contextlib.suppress(Exception):
            await saying


@mcp.tool(annotations=READ_ONLY)
def whoami() -> int:
    """This server's process id (one process per upstream session)."""
    return os.getpid()


@mcp.tool(annotations=READ_ONLY)
async def slow(marker: str) -> str:
    """Wait for the file `release`; say so when cancelled first."""
    effect(tool="slow", marker=marker, phase="started")
    try:
        await gate("release-slow")
    except asyncio.CancelledError:
        effect(tool="slow", marker=marker, phase="cancelled")
        raise
    return "released"


@mcp.tool()
async def hold_record(note: str) -> dict[str, Any]:
    """Start an effect, wait for the file `release-hold`, then finish it."""
    effect(tool="hold_record", note=note, phase="started")
    try:
        await gate("release-hold")
    except asyncio.CancelledError:
        effect(tool="hold_record", note=note, phase="cancelled")
        raise
    return {"note": note, "line": effect(tool="hold_record", note=note, phase="done")}


# --- the requests MCPServer leaves to the low-level server ------------------------------------------


async def set_level(
    ctx: ServerRequestContext[Any, Any], params: types.SetLevelRequestParams
) -> types.EmptyResult:
    state["level"] = params.level
    effect(tool="logging/setLevel", level=params.level)
    return types.EmptyResult()


async def subscribe(
    ctx: ServerRequestContext[Any, Any], params: types.SubscribeRequestParams
) -> types.EmptyResult:
    effect(tool="resources/subscribe", uri=params.uri)
    return types.EmptyResult()


async def unsubscribe(
    ctx: ServerRequestContext[Any, Any], params: types.UnsubscribeRequestParams
) -> types.EmptyResult:
    effect(tool="resources/unsubscribe", uri=params.uri)
    return types.EmptyResult()


low = mcp._lowlevel_server
low.add_request_handler("logging/setLevel", types.SetLevelRequestParams, set_level)
low.add_request_handler("resources/subscribe", types.SubscribeRequestParams, subscribe)
low.add_request_handler("resources/unsubscribe", types.UnsubscribeRequestParams, unsubscribe)


def serve_http() -> None:
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    app = mcp.streamable_http_app(streamable_http_path="/mcp")
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        serve_http()
    else:
        mcp.run()
