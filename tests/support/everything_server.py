"""An MCP server offering everything the official conformance suite's server scenarios call for.

Built on the MCP SDK's low-level server, so each definition goes on the wire exactly as written
here (the JSON Schema 2020-12 tool keeps its `$schema` and `$defs`). It stands directly in front of
the suite, and upstream of commitgate to show that a wrapped server loses nothing
(tests/test_conformance.py).

    python everything_server.py [PORT]       # streamable HTTP on 127.0.0.1; prints its URL

Every tool call appends one line (the tool's name) to the file `$EVERYTHING_CALLS` when it is set:
what the keyed run counts to show that nothing reached the server.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import mcp.types as types
import uvicorn
from mcp import MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp.shared.message import ServerMessageMetadata
from mcp.types import JSONRPCMessage

NAME = "commitgate-everything"
# A 1x1 PNG and a silent WAV, as the suite's image and audio scenarios ask.
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c63f8cfc0f01f0005050200"
        "5fc8f1d20000000049454e44ae426082"
    )
).decode()
WAV = base64.b64encode(
    b"RIFF&\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00@\x1f\x00\x00\x80>\x00\x00"
    b"\x02\x00\x10\x00data\x02\x00\x00\x00\x00\x00"
).decode()
WATCHED = "test://watched-resource"

Answer = types.CallToolResult | types.InputRequiredResult
Handler = Callable[[ServerRequestContext[Any], dict[str, Any]], Awaitable[Answer]]


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _result(*blocks: Any) -> types.CallToolResult:
    return types.CallToolResult(content=list(blocks))


@dataclass(frozen=True)
class EverythingTool:
    definition: types.Tool
    run: Handler


TOOLS: dict[str, EverythingTool] = {}


def tool(name: str, description: str, schema: dict[str, Any] | None = None) -> Callable[[Handler], Handler]:
    def register(run: Handler) -> Handler:
        definition = types.Tool(
            name=name, description=description, input_schema=schema or {"type": "object", "properties": {}}
        )
        TOOLS[name] = EverythingTool(definition, run)
        return run

    return register


def _string_argument(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


@tool("test_simple_text", "Answers with one text block.")
async def _simple_text(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    return _result(_text("This is a simple text response for testing."))


@tool("test_image_content", "Answers with a PNG image block.")
async def _image(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    return _result(types.ImageContent(type="image", data=PNG, mime_type="image/png"))


@tool("test_audio_content", "Answers with a WAV audio block.")
async def _audio(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    return _result(types.AudioContent(type="audio", data=WAV, mime_type="audio/wav"))


def _embedded(uri: str, mime: str, text: str) -> types.EmbeddedResource:
    contents = types.TextResourceContents(uri=uri, mime_type=mime, text=text)
    return types.EmbeddedResource(type="resource", resource=contents)


@tool("test_embedded_resource", "Answers with an embedded text resource.")
async def _embedded_resource(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    return _result(_embedded("test://embedded-resource", "text/plain", "An embedded resource's text."))


@tool("test_multiple_content_types", "Answers with text, an image and an embedded resource.")
async def _mixed(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    data = json.dumps({"test": "data", "value": 123})
    return _result(
        _text("Multiple content types test:"),
        types.ImageContent(type="image", data=PNG, mime_type="image/png"),
        _embedded("test://mixed-content-resource", "application/json", data),
    )


@tool("test_tool_with_logging", "Sends three log messages while it runs.")
async def _logging(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    for step, words in enumerate(
        ("Tool execution started", "Tool processing data", "Tool execution completed")
    ):
        if step:
            await asyncio.sleep(0.05)
        params = types.LoggingMessageNotificationParams(level="info", data=words, logger=NAME)
        await ctx.session.send_notification(
            types.LoggingMessageNotification(params=params), related_request_id=ctx.request_id
        )
    return _result(_text("Tool with logging executed successfully"))


@tool("test_tool_with_progress", "Reports progress three times under the caller's progressToken.")
async def _progress(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    token = (ctx.meta or {}).get("progressToken")
    for step, done in enumerate((0, 50, 100)):
        if step:
            await asyncio.sleep(0.05)
        await ctx.session.report_progress(done, 100, f"step {done} of 100")
    return _result(_text(str(token)))


@tool("test_error_handling", "Always fails.")
async def _error(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    failed = _result(_text("This tool intentionally returns an error for testing"))
    failed.is_error = True
    return failed


@tool(
    "test_reconnection",
    "Closes the call's SSE stream before answering: the client resumes to read the answer.",
)
async def _reconnection(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    if ctx.close_sse_stream is not None:
        await ctx.close_sse_stream()
    await asyncio.sleep(0.1)
    return _result(_text("Reconnection test completed: the answer arrived after the stream was resumed."))


ASKED = "ask"  # the key of the one question a 2026-07-28 round carries


async def ask(ctx: ServerRequestContext[Any], question: Any, answer_type: Any) -> Any:
    """The client's answer to `question` (a sampling or elicitation request), in the era it speaks:
    a request on the back-channel through 2025-11-25; on 2026-07-28, which has none, the call answers
    an `InputRequiredResult` and the client calls again with the answer."""
    if ctx.session.can_send_request:
        related = ServerMessageMetadata(related_request_id=ctx.request_id)  # on the call's own stream
        return await ctx.session.send_request(question, answer_type, metadata=related)
    answers = (ctx.params or {}).get("inputResponses") or {}
    if ASKED in answers:
        return answer_type.model_validate(answers[ASKED])
    return types.InputRequiredResult(input_requests={ASKED: question})


@tool(
    "test_sampling", "Asks the client's model to answer a prompt.", _string_argument("prompt", "What to ask")
)
async def _sampling(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> Answer:
    message = types.SamplingMessage(role="user", content=_text(args.get("prompt", "")))
    question = types.CreateMessageRequest(
        params=types.CreateMessageRequestParams(messages=[message], max_tokens=100)
    )
    try:
        answer = await ask(ctx, question, types.CreateMessageResult)
    except Exception as exc:  # the suite checks that the request was made; say what came back
        return _result(_text(f"Sampling failed: {exc}"))
    if isinstance(answer, types.InputRequiredResult):
        return answer
    content = answer.content
    said = (
        content.text if isinstance(content, types.TextContent) else json.dumps(answer.model_dump(mode="json"))
    )
    return _result(_text(f"LLM response: {said}"))


async def _elicit(ctx: ServerRequestContext[Any], message: str, schema: dict[str, Any], lead: str) -> Answer:
    form = types.ElicitRequestFormParams(message=message, requested_schema=schema)
    try:
        answer = await ask(ctx, types.ElicitRequest(params=form), types.ElicitResult)
    except Exception as exc:
        return _result(_text(f"Elicitation failed: {exc}"))
    if isinstance(answer, types.InputRequiredResult):
        return answer
    return _result(_text(f"{lead}: action={answer.action}, content={json.dumps(answer.content or {})}"))


@tool("test_elicitation", "Asks the user for a response.", _string_argument("message", "What to ask"))
async def _elicitation(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> Answer:
    schema = {
        "type": "object",
        "properties": {"response": {"type": "string", "description": "The user's response"}},
        "required": ["response"],
    }
    return await _elicit(ctx, args.get("message", ""), schema, "User response")


DEFAULTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "User name", "default": "John Doe"},
        "age": {"type": "integer", "description": "User age", "default": 30},
        "score": {"type": "number", "description": "User score", "default": 95.5},
        "status": {
            "type": "string",
            "description": "User status",
            "enum": ["active", "inactive", "pending"],
            "default": "active",
        },
        "verified": {"type": "boolean", "description": "Verification status", "default": True},
    },
    "required": [],
}


@tool("test_elicitation_sep1034_defaults", "Asks for a form whose fields have defaults.")
async def _defaults(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> Answer:
    message = "Please review and update the form fields with defaults"
    return await _elicit(ctx, message, DEFAULTS_SCHEMA, "Elicitation completed")


def _choices(prefix: str, title: str) -> list[dict[str, str]]:
    names = ("First", "Second", "Third")
    return [{"const": f"{prefix}{i}", "title": f"{n} {title}"} for i, n in zip(itertools.count(1), names)]


ENUMS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "untitledSingle": {
            "type": "string",
            "description": "Select one option",
            "enum": ["option1", "option2", "option3"],
        },
        "titledSingle": {
            "type": "string",
            "description": "Select one option with titles",
            "oneOf": _choices("value", "Option"),
        },
        "legacyEnum": {
            "type": "string",
            "description": "Select one option (legacy)",
            "enum": ["opt1", "opt2", "opt3"],
            "enumNames": ["Option One", "Option Two", "Option Three"],
        },
        "untitledMulti": {
            "type": "array",
            "description": "Select multiple options",
            "minItems": 1,
            "maxItems": 3,
            "items": {"type": "string", "enum": ["option1", "option2", "option3"]},
        },
        "titledMulti": {
            "type": "array",
            "description": "Select multiple options with titles",
            "minItems": 1,
            "maxItems": 3,
            "items": {"anyOf": _choices("value", "Choice")},
        },
    },
    "required": [],
}


@tool("test_elicitation_sep1330_enums", "Asks for a form with every kind of enum field.")
async def _enums(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> Answer:
    message = "Please select options from the enum fields"
    return await _elicit(ctx, message, ENUMS_SCHEMA, "Elicitation completed")


SCHEMA_2020_12: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
    "additionalProperties": False,
}


@tool("json_schema_2020_12_tool", "Takes arguments described with JSON Schema 2020-12.", SCHEMA_2020_12)
async def _schema_2020_12(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    return _result(_text(f"Called with: {json.dumps(args, sort_keys=True)}"))


# --- resources, prompts, completions, logging --------------------------------------------------------

RESOURCES = [
    types.Resource(
        name="static-text",
        uri="test://static-text",
        title="Static text",
        description="A text resource",
        mime_type="text/plain",
    ),
    types.Resource(
        name="static-binary",
        uri="test://static-binary",
        title="Static binary",
        description="A binary resource (a PNG image)",
        mime_type="image/png",
    ),
    types.Resource(
        name="watched-resource",
        uri=WATCHED,
        title="Watched",
        description="A resource to subscribe to",
        mime_type="text/plain",
    ),
]
TEMPLATE = types.ResourceTemplate(
    name="template",
    uri_template="test://template/{id}/data",
    title="Template",
    description="Data for an id",
    mime_type="application/json",
)


def _contents(uri: str) -> types.TextResourceContents | types.BlobResourceContents:
    if uri == "test://static-text":
        return types.TextResourceContents(
            uri=uri, mime_type="text/plain", text="A static text resource's content."
        )
    if uri == "test://static-binary":
        return types.BlobResourceContents(uri=uri, mime_type="image/png", blob=PNG)
    if uri == WATCHED:
        return types.TextResourceContents(uri=uri, mime_type="text/plain", text="Watched resource content")
    prefix, suffix = "test://template/", "/data"
    if uri.startswith(prefix) and uri.endswith(suffix) and len(uri) > len(prefix) + len(suffix):
        key = uri[len(prefix) : -len(suffix)]
        data = {"id": key, "templateTest": True, "data": f"Data for ID: {key}"}
        return types.TextResourceContents(uri=uri, mime_type="application/json", text=json.dumps(data))
    raise MCPError(types.INVALID_PARAMS, f"no resource {uri}")


PROMPTS = [
    types.Prompt(name="test_simple_prompt", title="Simple prompt", description="A prompt without arguments"),
    types.Prompt(
        name="test_prompt_with_arguments",
        title="Prompt with arguments",
        description="A prompt with two required arguments",
        arguments=[
            types.PromptArgument(name="arg1", description="First argument", required=True),
            types.PromptArgument(name="arg2", description="Second argument", required=True),
        ],
    ),
    types.Prompt(
        name="test_prompt_with_embedded_resource",
        title="Prompt with an embedded resource",
        description="A prompt that embeds a resource",
        arguments=[types.PromptArgument(name="resourceUri", description="The resource's URI", required=True)],
    ),
    types.Prompt(
        name="test_prompt_with_image", title="Prompt with an image", description="A prompt with an image"
    ),
]


def _user(content: Any) -> types.PromptMessage:
    return types.PromptMessage(role="user", content=content)


def _messages(name: str, args: dict[str, str]) -> list[types.PromptMessage]:
    if name == "test_simple_prompt":
        return [_user(_text("This is a simple prompt for testing."))]
    if name == "test_prompt_with_arguments":
        return [_user(_text(f"Prompt with arguments: arg1='{args.get('arg1')}', arg2='{args.get('arg2')}'"))]
    if name == "test_prompt_with_embedded_resource":
        uri = args.get("resourceUri", "test://example-resource")
        return [
            _user(_embedded(uri, "text/plain", "Embedded resource content for testing.")),
            _user(_text("Please process the embedded resource above.")),
        ]
    if name == "test_prompt_with_image":
        image = types.ImageContent(type="image", data=PNG, mime_type="image/png")
        return [_user(image), _user(_text("Please analyze the image above."))]
    raise MCPError(types.INVALID_PARAMS, f"no prompt {name}")


def _record_call(name: str) -> None:
    where = os.environ.get("EVERYTHING_CALLS")
    if where:
        with open(where, "a", encoding="utf-8") as calls:
            calls.write(name + "\n")


async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[t.definition for t in TOOLS.values()])


async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> Answer:
    _record_call(params.name)
    found = TOOLS.get(params.name)
    if found is None:
        raise MCPError(types.INVALID_PARAMS, f"no tool {params.name}")
    return await found.run(ctx, dict(params.arguments or {}))


async def list_resources(ctx: ServerRequestContext[Any], params: Any) -> types.ListResourcesResult:
    return types.ListResourcesResult(resources=RESOURCES)


async def list_templates(ctx: ServerRequestContext[Any], params: Any) -> types.ListResourceTemplatesResult:
    return types.ListResourceTemplatesResult(resource_templates=[TEMPLATE])


async def read_resource(
    ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
) -> types.ReadResourceResult:
    return types.ReadResourceResult(contents=[_contents(str(params.uri))])


async def subscribe(
    ctx: ServerRequestContext[Any], params: types.SubscribeRequestParams
) -> types.EmptyResult:
    return types.EmptyResult()


async def unsubscribe(
    ctx: ServerRequestContext[Any], params: types.UnsubscribeRequestParams
) -> types.EmptyResult:
    return types.EmptyResult()


async def list_prompts(ctx: ServerRequestContext[Any], params: Any) -> types.ListPromptsResult:
    return types.ListPromptsResult(prompts=PROMPTS)


async def get_prompt(
    ctx: ServerRequestContext[Any], params: types.GetPromptRequestParams
) -> types.GetPromptResult:
    return types.GetPromptResult(messages=_messages(params.name, dict(params.arguments or {})))


async def complete(
    ctx: ServerRequestContext[Any], params: types.CompleteRequestParams
) -> types.CompleteResult:
    """Values of the prompt's argument that start with what was typed (the suite asks for arg1)."""
    known = ["paris", "park", "party", "test-value"]
    typed = params.argument.value
    values = [v for v in known if v.startswith(typed)]
    return types.CompleteResult(completion=types.Completion(values=values, total=len(values), has_more=False))


async def set_level(ctx: ServerRequestContext[Any], params: types.SetLevelRequestParams) -> types.EmptyResult:
    return types.EmptyResult()


class MemoryEventStore(EventStore):
    """Every event of this process, so a client whose stream was closed resumes from its last event."""

    def __init__(self) -> None:
        self._events: list[tuple[EventId, StreamId, JSONRPCMessage | None]] = []

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = f"{stream_id}:{len(self._events)}"
        self._events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        position = next((i for i, (e, _, _) in enumerate(self._events) if e == last_event_id), None)
        if position is None:
            return None
        stream = self._events[position][1]
        for event_id, stream_id, message in self._events[position + 1 :]:
            if stream_id == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream


def build_server() -> Server[Any]:
    import warnings

    with warnings.catch_warnings():  # the logging capability is deprecated in the newest era, not gone
        warnings.simplefilter("ignore")
        return Server(
            NAME,
            version="1.0.0",
            on_list_tools=list_tools,
            on_call_tool=call_tool,
            on_list_resources=list_resources,
            on_list_resource_templates=list_templates,
            on_read_resource=read_resource,
            on_subscribe_resource=subscribe,
            on_unsubscribe_resource=unsubscribe,
            on_list_prompts=list_prompts,
            on_get_prompt=get_prompt,
            on_completion=complete,
            on_set_logging_level=set_level,
        )


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen(128)  # connections made before the server runs wait in the backlog
    print(f"http://127.0.0.1:{listener.getsockname()[1]}/mcp", flush=True)
    app = build_server().streamable_http_app(event_store=MemoryEventStore(), retry_interval=1000)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
