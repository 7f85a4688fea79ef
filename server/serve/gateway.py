"""The gateway: one policy, one ledger, one commit boundary, and the MCP calls that reach them.

This is what the MCP surface talks to. It turns a `tools/call` into a guarded
call (session, step, key and argument checks), answers the meta tools, and
renders every answer as docs/contract.md#results says. It knows nothing of transports.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import httpx2
import mcp.types as types
from pydantic import BaseModel, ValidationError

from commitgate.server.core import approvals, budgets, duplicates, errors, expiry
from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.errors import GateError
from commitgate.server.core.requests import (
    Answer,
    CallRequest,
    check_key,
    check_session,
    error_for_state,
    fingerprint,
)
from commitgate.server.core.saga import Saga
from commitgate.server.core.views import operation_meta, status_view
from commitgate.server.ledger import (
    Ledger,
    LedgerUnavailable,
    OperationFilter,
    default_ledger_url,
    open_ledger,
)
from commitgate.server.ledger.evidence import Evidence
from commitgate.server.model.canonical import canonical_json
from commitgate.server.model.events import INPUT_REQUIRED, OK, CallAnswered, CallObserver, Observer
from commitgate.server.model.facts import (
    OPERATION_META,
    SESSION_META,
    STEP_META,
    ErrorCode,
    State,
)
from commitgate.server.model.records import Operation, iso
from commitgate.server.model.validation import describe
from commitgate.server.policy.models import Policy
from commitgate.server.serve import asking, tracing
from commitgate.server.serve.asking import ClientChannel
from commitgate.server.serve.envelope import Call, Generation, Reply, ReplyTo
from commitgate.server.serve.evidence import attach, evidence_for, follow
from commitgate.server.serve.faults import CONTROL_TOOL, FaultPlan
from commitgate.server.serve.logs import log_call
from commitgate.server.serve.meta_tools import CompensateArgs as _CompensateArgs
from commitgate.server.serve.meta_tools import ListArgs as _ListArgs
from commitgate.server.serve.meta_tools import StatusArgs as _StatusArgs
from commitgate.server.serve.registry import ServedTool, build_tools
from commitgate.tools.base import Collaborators

if TYPE_CHECKING:
    from commitgate.tools.upstream import UpstreamManager

log = logging.getLogger("commitgate.gateway")
M = TypeVar("M", bound=BaseModel)


def local_principal() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers): still one stable local identity
        return "local"


@dataclass
class Gateway:
    """The MCP calls over one commit boundary. The boundary owns the ledger, the settings and the
    guarded tools; the gateway owns what sources borrow (the pooled HTTP client, the upstream
    connections) and closes it."""

    generation: Generation
    boundary: CommitBoundary
    http: httpx2.AsyncClient
    upstreams: UpstreamManager
    policy_path: Path | None = None
    default_principal: str = field(default_factory=local_principal)
    # Held while a new set of tools is built and applied (a policy reload, an upstream's new tools).
    rebuilding: asyncio.Lock = field(default_factory=asyncio.Lock)
    faults: FaultPlan | None = None  # only under `commitgate verify` and the pytest plugin
    evidence: Evidence | None = None  # what the ledger writes with each change (serve/evidence.py)
    # Told of every tools/call once it is answered (metrics add theirs when attached).
    call_observers: list[CallObserver] = field(default_factory=lambda: [log_call, tracing.annotate])
    answering: int = 0  # tools/calls being answered now, on every transport

    @classmethod
    async def open(
        cls,
        policy: Policy,
        policy_path: Path | None = None,
        *,
        ledger: Ledger | None = None,
        observers: Sequence[Observer] = (),
    ) -> Gateway:
        from commitgate.tools.http import pooled_client
        from commitgate.tools.upstream import UpstreamManager
        from commitgate.tools.upstream_definitions import remembered

        faults = FaultPlan.from_env()  # read (and removed) before any child process starts
        evidence = evidence_for(policy, policy_path)  # an unusable receipts key stops the start here
        upstreams, http = UpstreamManager(), pooled_client()
        given = ledger
        try:
            # Connects the upstream MCP servers the policy uses in the background: clients are answered
            # at once, and a call waits for its upstream (docs/policy.md#upstreams).
            await upstreams.update(policy, wait=False)
            ledger = ledger or await open_ledger(
                policy.ledger.url or default_ledger_url(policy_path),
                synchronous=policy.ledger.synchronous,
                auto_migrate=policy.ledger.auto_migrate,
                durability=policy.ledger.durability,
                outcome_sync_within=policy.ledger.outcome_sync_within,
            )
            attach(ledger, evidence)
            await remembered(upstreams, policy, ledger)  # their tools as last listed, until they list
            using = Collaborators(http=http, upstream=upstreams.lookup(policy))
            served = build_tools(policy, policy_path.parent if policy_path else None, using)
        except BaseException:
            await upstreams.aclose()
            await http.aclose()
            if ledger is not None and given is None:
                await ledger.close()
            raise
        served = faults.wrap(served) if faults is not None else served
        tools = {name: s.guard for name, s in served.items()}
        boundary = CommitBoundary(ledger, policy.server, tools, observers=list(observers))
        principal = policy.server.principal or local_principal()
        generation = Generation.of(policy, served)
        return cls(
            generation, boundary, http, upstreams, policy_path, principal, faults=faults, evidence=evidence
        )

    @property
    def ledger(self) -> Ledger:
        return self.boundary.ledger

    @property
    def policy(self) -> Policy:
        return self.generation.policy

    @property
    def served(self) -> Mapping[str, ServedTool]:
        return self.generation.served

    def collaborators(self, policy: Policy) -> Collaborators:
        """What the sources of `policy` borrow from this gateway."""
        return Collaborators(http=self.http, upstream=self.upstreams.lookup(policy))

    async def close(self) -> None:
        await self.upstreams.aclose()
        await self.http.aclose()
        await self.ledger.close()

    def apply(self, policy: Policy, served: dict[str, ServedTool]) -> None:
        """Serve a new policy for new calls; calls in flight keep the tool they started with."""
        if self.faults is not None:
            served = self.faults.wrap(served)
        self.generation = Generation.of(policy, served)
        # The boundary's current settings and tools serve polls and its duties, which no call carries;
        # a call keeps its generation's (`Call.generation`, `CallRequest.settings`) whatever this changes.
        self.boundary.settings = policy.server
        if self.evidence is not None:  # new [[notify]] entries hear the changes from now on
            follow(self.evidence, policy)
        self.boundary.tools = {name: s.guard for name, s in served.items()}

    # --- MCP requests -------------------------------------------------------------------------

    def list_tools(self) -> list[types.Tool]:
        return list(self.generation.listed)

    def has_tool(self, name: str, generation: Generation | None = None) -> bool:
        """Offered by `generation` (the current one by default), or the fault plan's control tool."""
        offered = (generation or self.generation).offers(name)
        return offered or (self.faults is not None and name == CONTROL_TOOL)

    def handler(self) -> ReplyTo:
        """What answers tools/call: `reply`, seen through the fault plan on a test server.

        Chosen once per MCP server, so a normal server pays nothing per call for the plan."""
        return self.faults.around(self.reply) if self.faults is not None else self.reply

    def answered(self, event: CallAnswered) -> None:
        """Tell every call observer (logs, metrics, the call's span) how a call ended."""
        for observer in self.call_observers:
            observer(event)

    def envelope(
        self,
        name: str,
        arguments: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None,
        principal: str | None,
        channel: ClientChannel | None = None,
    ) -> Call:
        return Call(
            name, arguments, meta or {}, principal or self.default_principal, self.generation, channel
        )

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None,
        principal: str | None,
    ) -> types.CallToolResult:
        """A tools/call without a client to ask (in-process callers: the console, the tests)."""
        result = (await self.reply(self.envelope(name, arguments, meta, principal))).result
        assert isinstance(result, types.CallToolResult)  # only the MCP surface answers a first round
        return result

    async def reply(self, call: Call) -> Reply:
        try:
            session = self._session(call.meta)
            args = dict(call.arguments or {})
            answer_meta = _META_ANSWERS.get(call.name)
            if answer_meta is not None:
                return Reply(await answer_meta(self, args, session, call.principal))
            generation = call.generation
            request = self._request(
                generation, generation.served[call.name], args, call.meta, session, call.principal
            )
            return await self._guarded_call(request, call.channel)
        except asking.InputRequired as first_round:  # the client's user is asked; it calls again
            return Reply(first_round.result, INPUT_REQUIRED)
        except GateError as exc:
            return refused(exc, replayed=False)
        except LedgerUnavailable as exc:
            log.warning("the ledger could not answer %s: %s", call.name, exc)
            return refused(errors.ledger_unavailable(), replayed=False)

    # --- approvals asked of the client's user -----------------------------------------------------

    async def _guarded_call(self, request: CallRequest, channel: ClientChannel | None) -> Reply:
        """The boundary's answer; a call waiting for approval asks the client's user when it can
        (on 2026-07-28 by raising InputRequired, which the surface answers)."""
        if channel is not None and channel.answered_operation is not None:
            await self._client_answered(request, channel)
        answer = await self.boundary.call(request)
        op = answer.operation
        if channel is None or op is None or not _asks_client(answer) or not channel.can_ask:
            return replied(answer)
        if channel.multi_round:
            if channel.answered_operation is not None:  # asked already; cancelled or unanswered
                return replied(answer)
            raise asking.InputRequired(
                asking.input_required(op.operation_id, (await self._question(op)).text)
            )
        assert channel.elicit is not None
        return replied(await self._ask_now(request, op, channel))

    async def _question(self, op: Operation) -> approvals.Question:
        served = self.served.get(op.tool)
        earlier_id = op.approval.duplicate_of if op.approval is not None else None
        earlier = await self.ledger.get_by_id(op.principal, earlier_id) if earlier_id else None
        budget = await budgets.standing(
            self.ledger, served.guard.budget if served else None, op, self.boundary.clock()
        )
        return approvals.question(op, served.guard.policy if served else None, earlier, budget)

    async def _ask_now(self, request: CallRequest, op: Operation, channel: ClientChannel) -> Answer:
        """Handshake era: elicit during the call, while watching the ledger for another decider.

        Bounded by respond_within; no answer (or cancel) leaves it awaiting: approval_pending.
        """
        assert channel.elicit is not None
        elicit, question = channel.elicit, await self._question(op)
        said: list[types.ElicitResult] = []

        async def ask(scope: anyio.CancelScope) -> None:
            try:
                said.append(await elicit(question.text, asking.SCHEMA))
            except Exception as exc:  # the client failed to ask: still awaiting, said in the log
                log.warning("%s: asking the client for approval failed: %s", op.operation_id, exc)
            scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            delay = 0.05
            while (await self.boundary.poll(await self._current(op))).state is State.AWAITING_APPROVAL:
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
            scope.cancel()  # decided elsewhere (an operator) or expired

        with anyio.move_on_after((request.settings or self.generation.settings).respond_within):
            async with anyio.create_task_group() as group:
                group.start_soon(ask, group.cancel_scope)
                group.start_soon(watch, group.cancel_scope)
        if said:
            await self._decide_for_client(op, request.principal, said[0])
        return await self.boundary.call(request)

    async def _current(self, op: Operation) -> Operation:
        return await self.ledger.get_by_id(op.principal, op.operation_id) or op

    async def _client_answered(self, request: CallRequest, channel: ClientChannel) -> None:
        """2026-07-28, second round: the state must name this very call's operation in the ledger."""
        operation_id = channel.answered_operation
        assert operation_id is not None
        op = await self.ledger.get_by_id(request.principal, operation_id)
        digest = fingerprint(request.tool.name, request.arguments_json or canonical_json(request.arguments))
        if op is None or (op.session, op.step, op.tool, op.fingerprint) != (
            request.session,
            request.key,
            request.tool.name,
            digest,
        ):
            log.warning("a requestState that names no operation of this call was refused")
            raise errors.invalid_arguments(
                "the requestState does not belong to this call; call the tool again without it"
            )
        if channel.answer is not None:
            await self._decide_for_client(op, request.principal, channel.answer)

    async def _decide_for_client(self, op: Operation, principal: str, said: types.ElicitResult) -> None:
        if said.action == "cancel":
            return
        reason = (said.content or {}).get("reason") if said.action in ("accept", "decline") else None
        reason = reason if isinstance(reason, str) and reason.strip() else None
        decision: approvals.Decision = "approve" if said.action == "accept" else "deny"
        try:
            await approvals.decide(
                self.ledger,
                op.operation_id,
                decision,
                by=principal,
                via="client",
                reason=reason
                or f"{'accepted' if said.action == 'accept' else 'declined'} by the client's user",
                now=time.time(),
                principal=principal,
            )
        except approvals.ApprovalRefused as exc:  # decided meanwhile, expired, or not the client's to decide
            log.info("the client's answer was not applied: %s", exc)

    def _session(self, meta: Mapping[str, Any]) -> str:
        session = meta.get(SESSION_META)
        if session is None:
            return self.policy.server.session
        return check_session(session, f"_meta[{SESSION_META!r}]")

    def _request(
        self,
        generation: Generation,
        served: ServedTool,
        args: dict[str, Any],
        meta: Mapping[str, Any],
        session: str,
        principal: str,
    ) -> CallRequest:
        tool = served.guard
        key = args.pop("idempotency_key", None)
        confirmed = duplicates.take_confirm(args, tool.policy)
        step = meta.get(STEP_META)
        if key is not None and step is not None and key != step:
            raise errors.invalid_key(
                f"the argument ({key!r}) and _meta['{STEP_META}'] ({step!r}) differ; send one, or the same value"
            )
        checked = check_key(key if key is not None else step, tool)
        try:
            validated = served.guard.source.validate(args)
        except GateError:
            raise
        except Exception as exc:
            raise errors.invalid_arguments(str(exc)) from None
        # Encoded once: this text is what the size limit measures, the fingerprint hashes and the ledger keeps.
        arguments_json = canonical_json(validated)
        size = len(arguments_json) if arguments_json.isascii() else len(arguments_json.encode())
        limit = generation.policy.server.limits.max_argument_bytes
        if size > limit:
            raise errors.invalid_arguments(f"the arguments are {size} bytes; at most {limit} are accepted")
        return CallRequest(
            tool,
            validated,
            checked,
            session,
            principal,
            arguments_json,
            confirm_duplicate=confirmed,
            settings=generation.settings,
        )

    # --- meta tools ------------------------------------------------------------------------------

    def _forwards_key(self, op: Operation) -> bool:
        served = self.served.get(op.tool)
        return bool(served and served.guard.policy.forwards_key)

    async def _answer_status(
        self, args: dict[str, Any], session: str, principal: str
    ) -> types.CallToolResult:
        status = await self._get_operation_status(args, session, principal)
        return _structured(status, None if status["found"] else _not_found_advice(args, session))

    async def _answer_list(self, args: dict[str, Any], session: str, principal: str) -> types.CallToolResult:
        return _structured(await self._list_operations(args, principal))

    async def _answer_compensate(
        self, args: dict[str, Any], session: str, principal: str
    ) -> types.CallToolResult:
        return _structured(await self._compensate_session(args, session, principal))

    async def _get_operation_status(
        self, args: dict[str, Any], session: str, principal: str
    ) -> dict[str, Any]:
        parsed = _parse(_StatusArgs, args)
        if parsed.operation_id is not None:
            op = await self.ledger.get_by_id(principal, parsed.operation_id)
        elif parsed.idempotency_key is not None:
            op = await self.ledger.get(principal, parsed.session or session, parsed.idempotency_key)
        else:
            raise errors.invalid_arguments("pass idempotency_key (and optionally session) or operation_id")
        if op is None:
            return {"found": False, "operation": None}
        op = await self.boundary.poll(op)
        return {"found": True, "operation": status_view(op, self._forwards_key(op))}

    async def _list_operations(self, args: dict[str, Any], principal: str) -> dict[str, Any]:
        parsed = _parse(_ListArgs, args)
        limit = self.policy.server.limits.list_limit
        if parsed.limit > limit:
            raise errors.invalid_arguments(f"limit: at most {limit}")
        where = OperationFilter(principal, parsed.session, parsed.state, parsed.tool, limit=parsed.limit)
        now = time.time()
        found = await self.ledger.find(where)
        touched = await expiry.touch_all(self.ledger, found, now, self.boundary.tell, self.boundary.runs)
        return {"operations": [status_view(op, self._forwards_key(op), now) for op in touched]}

    async def _compensate_session(self, args: dict[str, Any], session: str, principal: str) -> dict[str, Any]:
        parsed = _parse(_CompensateArgs, args)
        generation = self.generation
        tools = {name: served.guard for name, served in generation.served.items()}
        saga = Saga(self.ledger, self.boundary, tools, generation.settings)
        return await saga.compensate(
            principal, parsed.session or session, parsed.idempotency_keys, parsed.reason
        )


MetaAnswer = Callable[[Gateway, dict[str, Any], str, str], Awaitable[types.CallToolResult]]
# What answers each meta tool (the table of META_TOOLS), given (arguments, session, principal).
_META_ANSWERS: dict[str, MetaAnswer] = {
    "get_operation_status": Gateway._answer_status,
    "list_operations": Gateway._answer_list,
    "compensate_session": Gateway._answer_compensate,
}


def _asks_client(answer: Answer) -> bool:
    """Waiting for a decision the client's user may take."""
    op = answer.operation
    if answer.error is None or answer.error.code is not ErrorCode.APPROVAL_PENDING or op is None:
        return False
    return op.approval is not None and "client" in op.approval.deciders


def _parse(model: type[M], args: dict[str, Any]) -> M:
    try:
        return model.model_validate(args)
    except ValidationError as exc:
        raise errors.invalid_arguments(describe(exc)) from None


# --- rendering ---------------------------------------------------------------------------------


def replied(answer: Answer) -> Reply:
    """A guarded call's answer, rendered, with what it says."""
    if answer.error is not None:
        return refused(answer.error, answer.replayed)
    if answer.result is None:  # a success always carries a result; never pretend otherwise
        assert answer.operation is not None
        return refused(error_for_state(answer.operation), answer.replayed)
    return Reply(render(answer), OK, answer.operation, answer.replayed)


def refused(error: GateError, replayed: bool) -> Reply:
    """An error's answer, rendered, with its code, operation and message."""
    return Reply(render_error(error, replayed), error.code.value, error.operation, replayed, error.message)


def render(answer: Answer) -> types.CallToolResult:
    """A successful answer (its result is set) as the client reads it."""
    assert answer.result is not None
    meta = dict(answer.result.meta or {})  # the tool's own keys, then commitgate's
    if answer.operation:
        meta[OPERATION_META] = operation_meta(answer.operation, answer.replayed)
    content = _blocks(answer.result.content)
    if answer.replayed and answer.operation is not None:
        # Clients such as Claude Desktop show the model the content, not `_meta`: say it in words too.
        content.append(_text(replay_note(answer.operation)))
    return types.CallToolResult(
        content=content, structured_content=answer.result.structured, _meta=meta or None
    )


# Text blocks (nearly every block a tool answers with) are made as models here: pydantic takes a
# model as it is, where validating the same block as a dict inside the result cost twice as much.
# Any other block is validated with the result, as before; the fields set are the same either way.
def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _blocks(content: Sequence[Mapping[str, Any]]) -> list[Any]:
    return [
        types.TextContent(type="text", text=block["text"])
        if isinstance(block, dict)
        and block.keys() <= _TEXT_KEYS
        and type(block.get("text")) is str
        and block.get("type") == "text"
        else block
        for block in content
    ]


_TEXT_KEYS = frozenset({"type", "text"})


def replay_note(op: Operation) -> str:
    """The block added after a replayed result's own content (its structuredContent is unchanged)."""
    when = iso(op.completed_at or op.updated_at)
    return (
        f"Already done at {when} (idempotency_key {op.step!r}): this is the recorded outcome; "
        "nothing was executed again."
    )


def _not_found_advice(args: Mapping[str, Any], session: str) -> str:
    if args.get("operation_id") is not None:
        what = f"No operation with operation_id {args['operation_id']!r} is visible to you."
    else:
        what = (
            f"No operation with idempotency_key {args.get('idempotency_key')!r} in session "
            f"{args.get('session') or session!r} is visible to you."
        )
    return (
        f"{what} Either it was never started (so nothing was done: call the tool with that key to do it), "
        "or the key or session differs from the ones you used (list_operations shows what you ran), "
        "or its record was deleted after its retention period."
    )


def render_error(error: GateError, replayed: bool) -> types.CallToolResult:
    op = error.operation
    op_view = operation_meta(op, replayed) if op is not None else None
    return types.CallToolResult(
        content=[_text(f"[{error.code.value}] {error.message}")],
        structured_content={
            "error": {
                "code": error.code.value,
                "message": error.message,
                "operation": op_view,
                **error.details,
            }
        },
        is_error=True,
        _meta={OPERATION_META: op_view} if op_view else None,
    )


def _structured(value: dict[str, Any], advice: str | None = None) -> types.CallToolResult:
    """A meta tool's answer: the structured value, and the same as readable JSON text for the model."""
    text = json.dumps(_readable(value), indent=2, ensure_ascii=False)
    blocks = [types.TextContent(type="text", text=text)]
    if advice:
        blocks.append(types.TextContent(type="text", text=advice))
    return types.CallToolResult(content=list(blocks), structured_content=value)


def _readable(value: Any) -> Any:
    """Recorded results shown by their structured value (or text) instead of JSON nested in strings."""
    if isinstance(value, dict):
        result = value.get("result")
        if isinstance(result, dict) and "content" in result and "structuredContent" in result:
            value = {**value, "result": _shown_result(result)}
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_readable(v) for v in value]
    return value


def _shown_result(result: dict[str, Any]) -> Any:
    if result["structuredContent"] is not None:
        return result["structuredContent"]
    texts = [b.get("text") for b in result["content"] if isinstance(b, dict) and b.get("type") == "text"]
    return "\n".join(t for t in texts if isinstance(t, str)) if texts else result["content"]
