"""Who is the caller: the client of each request, and how an upstream's questions reach it.

Every request served is handled with its client in `upstream_relay.CALLER` (`caller_of`), so what
an upstream says while serving it (questions, progress, log messages) reaches that client only.
A handshake-era client is asked on its connection, the question tied to its request. A 2026-07-28
client has no channel for a question mid-call: its tools/call runs in a task of its own
(`Rounds`), an upstream's question becomes the call's `InputRequiredResult`, and the call goes on
when the client calls again with the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mcp.types as types
from mcp import MCPError
from mcp.server import ServerRequestContext
from mcp.shared.exceptions import NoBackChannelError
from mcp.shared.message import ServerMessageMetadata
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, ConfigDict

from commitgate.server.model.facts import SESSION_META
from commitgate.server.serve.auth import principal_of_request
from commitgate.tools.upstream_relay import LOG_LEVEL_META, calling, not_supported

_CAPABILITY = {
    "sampling/createMessage": types.ClientCapabilities(sampling=types.SamplingCapability()),
    "elicitation/create": types.ClientCapabilities(elicitation=types.ElicitationCapability()),
    "roots/list": types.ClientCapabilities(roots=types.RootsCapability()),
}
_REQUESTS: dict[str, type[BaseModel]] = {
    "sampling/createMessage": types.CreateMessageRequest,
    "elicitation/create": types.ElicitRequest,
    "roots/list": types.ListRootsRequest,
}


class _Answer(BaseModel):
    """A client's answer, every field kept: it goes back upstream as the client sent it."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True, slots=True)
class SessionCaller:
    """The client of one request, reached through the SDK's request context."""

    ctx: ServerRequestContext[Any, Any]

    @property
    def _connection(self) -> Any:
        # The SDK keeps the connection behind the per-request session; it has no public accessor.
        return getattr(self.ctx.session, "_connection", None)

    @property
    def _has_session(self) -> bool:
        return self.ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS and self._connection is not None

    @property
    def client(self) -> object:
        if self._has_session:
            return self._connection
        # 2026-07-28: no transport session; the principal and commitgate session stand for it
        session = (self.ctx.meta or {}).get(SESSION_META)
        return ("client", principal_of_request(), session)

    def when_gone(self, close: Callable[[], Awaitable[None]]) -> bool:
        if not self._has_session:
            return False
        self._connection.exit_stack.push_async_callback(close)
        return True

    @property
    def meta(self) -> dict[str, Any]:
        """The client's log level for the call: a 2026-07-28 request's own, else the level a
        handshake-era client set (a 2026-07-28 upstream logs only for requests that carry one)."""
        level = (self.ctx.meta or {}).get(LOG_LEVEL_META)
        if level is None and self._has_session:
            level = self._connection.state.get(LOG_LEVEL_META)
        return {LOG_LEVEL_META: level} if level else {}

    def remember_log_level(self, level: str) -> None:
        if self._has_session:
            self._connection.state[LOG_LEVEL_META] = level

    @property
    def wants_progress(self) -> bool:
        meta: Any = self.ctx.meta or {}  # parsed: the token as `progress_token`
        return meta.get("progress_token", meta.get("progressToken")) is not None

    async def request(
        self, method: str, params: types.RequestParams | None
    ) -> dict[str, Any] | types.ErrorData:
        try:
            declared = self.ctx.session.check_client_capability(_CAPABILITY[method])
        except Exception:
            declared = False
        if not declared:
            return not_supported(method)
        request = _REQUESTS[method].model_validate({"method": method, "params": params})
        related = ServerMessageMetadata(related_request_id=self.ctx.request_id)
        try:
            answer = await self.ctx.session.send_request(request, _Answer, metadata=related)  # type: ignore[arg-type]
        except NoBackChannelError:  # a 2026-07-28 client: it has no channel for a question mid-call
            return not_supported(method)
        except MCPError as exc:
            return exc.error
        return answer.model_dump(by_alias=True, mode="json", exclude_none=True)

    async def log(self, params: types.LoggingMessageNotificationParams) -> None:
        await self.ctx.session.send_log_message(
            params.level, params.data, params.logger, related_request_id=self.ctx.request_id
        )

    async def progress(self, progress: float, total: float | None, message: str | None) -> None:
        await self.ctx.session.report_progress(progress, total, message)


@contextlib.contextmanager
def caller_of(ctx: ServerRequestContext[Any, Any]) -> Any:
    """While a request is served, its client is the caller (the tasks it starts inherit it)."""
    with calling(SessionCaller(ctx)):
        yield


# --- 2026-07-28 clients: an upstream's questions as rounds of the call ---------------------------------

ROUND_PREFIX = "relay:"
KEEP_FINISHED = 300.0  # seconds a finished call waits for its client to come back for the answer


@dataclass(frozen=True, slots=True)
class _Question:
    key: str
    request: Any  # ElicitRequest | CreateMessageRequest | ListRootsRequest
    answer: asyncio.Future[dict[str, Any] | types.ErrorData]


class _Paused:
    """A call of a 2026-07-28 client, running on while its client answers the upstream's questions."""

    def __init__(self, ident: str, task: asyncio.Task[Any]) -> None:
        self.ident, self.task = ident, task
        self.questions: asyncio.Queue[_Question] = asyncio.Queue()
        self.open: dict[str, _Question] = {}
        self.asked = 0

    async def next_round(self) -> Any:
        """The call's answer once it has one, or the next question for its client."""
        asking = asyncio.ensure_future(self.questions.get())
        try:
            await asyncio.wait({self.task, asking}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            asking.cancel()
        if asking.done() and not asking.cancelled():
            first = asking.result()
            found = {first.key: first}
            while not self.questions.empty():  # questions asked at once go in one round
                more = self.questions.get_nowait()
                found[more.key] = more
            self.open.update(found)
            requests = {key: question.request for key, question in found.items()}
            return types.InputRequiredResult(input_requests=requests, request_state=ROUND_PREFIX + self.ident)
        return self.task.result()

    def answer(self, responses: Mapping[str, Any]) -> None:
        for key, response in responses.items():
            question = self.open.pop(key, None)
            if question is None or question.answer.done():
                continue
            dumped = response.model_dump(by_alias=True, mode="json", exclude_none=True)
            question.answer.set_result(
                dumped if "code" not in dumped else types.ErrorData.model_validate(dumped)
            )


@dataclass(frozen=True, slots=True)
class RoundsCaller(SessionCaller):
    """A 2026-07-28 client's call: its upstream's questions become the call's next round."""

    paused: _Paused | None = None

    async def request(
        self, method: str, params: types.RequestParams | None
    ) -> dict[str, Any] | types.ErrorData:
        if self.paused is None or not self.ctx.session.check_client_capability(_CAPABILITY[method]):
            return not_supported(method)
        self.paused.asked += 1
        question = _Question(
            f"{method}#{self.paused.asked}",
            _REQUESTS[method].model_validate({"method": method, "params": params}),
            asyncio.get_running_loop().create_future(),
        )
        await self.paused.questions.put(question)
        return await question.answer


class Rounds:
    """tools/call of 2026-07-28 clients that can be asked: the call runs in a task of its own, so an
    upstream's question (elicitation, sampling, roots) can be answered as an `InputRequiredResult`
    and the call go on when the client comes back with the answer (the sealed request state names
    the paused call; the SDK's boundary binds it to the principal)."""

    def __init__(self) -> None:
        self._paused: dict[str, _Paused] = {}

    @staticmethod
    def applies(ctx: ServerRequestContext[Any, Any]) -> bool:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return False
        with contextlib.suppress(Exception):
            return any(ctx.session.check_client_capability(c) for c in _CAPABILITY.values())
        return False

    async def call(
        self,
        ctx: ServerRequestContext[Any, Any],
        params: types.CallToolRequestParams,
        run: Callable[[], Awaitable[Any]],
    ) -> Any:
        state = params.request_state or ""
        if state.startswith(ROUND_PREFIX):
            paused = self._paused.get(state.removeprefix(ROUND_PREFIX))
            if paused is None:
                raise MCPError(types.INVALID_PARAMS, "this call's earlier round is over; call the tool again")
            paused.answer(params.input_responses or {})
            return await self._round(paused)
        ident = uuid.uuid4().hex
        holder: list[_Paused] = []

        async def running() -> Any:
            with calling(RoundsCaller(ctx, holder[0])):
                return await run()

        task = asyncio.get_running_loop().create_task(running(), name=f"commitgate-rounds:{ident}")
        paused = _Paused(ident, task)
        holder.append(paused)
        self._paused[ident] = paused
        task.add_done_callback(
            lambda _: asyncio.get_running_loop().call_later(KEEP_FINISHED, self._paused.pop, ident, None)
        )
        return await self._round(paused)

    async def _round(self, paused: _Paused) -> Any:
        try:
            answer = await paused.next_round()
        except asyncio.CancelledError:  # the client cancelled its call: so is the call (a keyed
            paused.task.cancel()  # operation runs on in the commit boundary's own task)
            raise
        if not isinstance(answer, types.InputRequiredResult):
            self._paused.pop(paused.ident, None)
        return answer


async def relayed_call(
    ctx: ServerRequestContext[Any, Any],
    params: types.CallToolRequestParams,
    run: Callable[[], Awaitable[Any]],
    rounds: Rounds | None,
) -> Any:
    """Serve a tools/call with its client as the caller of everything the call causes upstream."""
    if rounds is not None and rounds.applies(ctx):
        return await rounds.call(ctx, params, run)
    with caller_of(ctx):
        return await run()
