"""Hot reload: a running server follows edits of its policy file.

A valid edit is applied to the gateway for new calls and announced to
clients; an invalid one is rejected with the messages `policy check` prints,
and the previous policy keeps serving. Calls already in flight hold the
`GuardedTool` they started with, so an edit never changes an operation under
way; a removed tool's records stay in the ledger and stay answerable.

Changes arrive through `watchfiles` (inotify and friends); a slow tick
compares the file's stat signature too, so an edit made while the watcher was
starting, or on a filesystem without notifications, is not lost.

An edit that weakens a guard (policy/guards.py) applies only once the file has
stayed unchanged for QUIET_SECONDS and reads the same twice: an editor writing
in place may leave, for a moment, a prefix that is valid on its own but lacks a
line the full text keeps. Until then the running policy serves; a timer re-reads
the file when the wait is over, so no further file event is needed. Edits that
only tighten apply at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import mcp.types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.context import CallNext, HandlerResult
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ServerEvent, ToolsListChanged
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from watchfiles import Change, awatch

from commitgate.server.policy.guards import weakenings
from commitgate.server.policy.loading import PolicyReport, analyse_text, read_policy_file
from commitgate.server.policy.models import Policy
from commitgate.server.policy.problems import Problem, with_lines
from commitgate.server.serve.checking import check_report, format_report, served_schemas, source_problems
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.registry import ServedTool, build_tools
from commitgate.tools.base import ToolBuildError, ToolSource
from commitgate.tools.upstream import UpstreamConnection, implied_entries
from commitgate.tools.upstream_definitions import record_listed

log = logging.getLogger("commitgate.reload")

OnApplied = Callable[[], Awaitable[None]]
QUIET_SECONDS = 2.0  # how long a weakening edit must leave the file unchanged before it applies


# --- announcing the change -------------------------------------------------------------------


class ToolListAnnouncer:
    """Tells connected clients that the tool list changed, in both protocol eras.

    Handshake-era clients get `notifications/tools/list_changed` on their
    connection; 2026-07-28 clients get it on their `subscriptions/listen`
    streams (the only place that era carries it). `install` adds both to a
    low-level server: the listen handler, and a middleware that remembers
    handshake-era connections.
    """

    def __init__(self) -> None:
        self.bus = InMemorySubscriptionBus()
        self.listen = ListenHandler(self.bus)
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()

    def install(self, server: Server[Any]) -> None:
        server.add_request_handler(
            "subscriptions/listen", types.SubscriptionsListenRequestParams, self.listen
        )
        server.middleware.append(self._remember)

    async def _remember(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            # The SDK keeps the connection behind the per-request session; it has no public accessor.
            connection = getattr(ctx.session, "_connection", None)
            if connection is not None:
                self._connections.add(connection)
        return await call_next(ctx)

    async def announce(
        self, event: ServerEvent | None = None, send: Callable[[Any], Awaitable[None]] | None = None
    ) -> None:
        """Tell every client: the tool list changed, or `event` (sent to handshake-era ones by `send`)."""
        await self.bus.publish(event or ToolsListChanged())
        for connection in list(self._connections):
            if send is None:
                await connection.send_tool_list_changed()  # best effort: never raises
                continue
            try:
                await send(connection)
            except Exception:  # a client that went away
                log.debug("could not tell a client of %s", type(event).__name__)

    def close(self) -> None:
        self.listen.close()


# --- one reload ---------------------------------------------------------------------------------


class ReloadStatus(StrEnum):
    APPLIED = "applied"
    REJECTED = "rejected"
    UNCHANGED = "unchanged"
    UNREADABLE = "unreadable"
    WAITING = "waiting"  # a weakening edit, not quiet yet: read the file again in `reread_in` seconds


@dataclass(frozen=True, slots=True)
class ReloadResult:
    status: ReloadStatus
    problems: list[Problem] = field(default_factory=list)
    announced: bool = False
    reread_in: float | None = None


@dataclass
class PolicyReloader:
    """Reads the policy file, validates and builds it, and applies it to the gateway."""

    gateway: Gateway
    path: Path
    on_applied: OnApplied
    quiet: float = QUIET_SECONDS
    _text: str | None = None
    _stat: tuple[int, int, int] | None = None
    _file_ledger: Any = None
    _waiting: tuple[str, tuple[int, int, int] | None] | None = None  # a weakening edit: text, signature
    _waiting_since: float = 0.0

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def _read(self) -> str:
        """The file's text, read off the event loop: a slow disk or an odd file never stalls serving."""
        return await anyio.to_thread.run_sync(read_policy_file, self.path)

    async def prime(self) -> None:
        """Remember the file when it is what serves now; otherwise the first tick reloads it."""
        signature = self._signature()
        try:
            text = await self._read()
        except (OSError, UnicodeDecodeError):
            return
        report = analyse_text(text, str(self.path))
        if report.policy is not None:
            self._file_ledger = report.policy.ledger
            if self._with_running_ledger(report.policy) == self.gateway.policy:
                self._text, self._stat = text, signature

    def changed_on_disk(self) -> bool:
        return self._signature() != self._stat

    async def reload(self) -> ReloadResult:
        self._stat = self._signature()
        try:
            text = await self._read()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read policy %s (%s); the current policy keeps serving", self.path, exc)
            return ReloadResult(ReloadStatus.UNREADABLE)
        if text == self._text:
            self._waiting = None  # edited back: nothing waits any more
            return ReloadResult(ReloadStatus.UNCHANGED)
        if not text.strip():  # an editor truncating before it writes: wait for the content
            log.info("policy %s is empty; the current policy keeps serving", self.path)
            return ReloadResult(ReloadStatus.UNREADABLE)
        async with self.gateway.rebuilding:
            policy, served, problems = await self._validate(text)
            if policy is None or served is None:
                self._text, self._waiting = text, None
                await self._retire_upstreams(self.gateway.policy)  # whatever the rejected edit connected
                log.error(
                    "policy edit rejected; the previous policy keeps serving.\n%s",
                    format_report(str(self.path), problems),
                )
                return ReloadResult(ReloadStatus.REJECTED, problems)
            served_now = as_served(self.gateway.policy, self.gateway.served)
            weaker = weakenings(served_now, self._to_be_served(policy))
            reread_in = self._still_to_wait(text, weaker)
            if reread_in is None and weaker and self.changed_on_disk():
                reread_in = 0.0  # edited again while this text was checked: it is not what the file says
            if reread_in is not None:
                await self._retire_upstreams(self.gateway.policy)  # built again once it may apply
                return ReloadResult(ReloadStatus.WAITING, reread_in=reread_in)
            self._text, self._waiting = text, None
            changed = self._apply(policy, served)
            await self._retire_upstreams(policy)
        if changed:
            await _announce(self.on_applied)
        return ReloadResult(ReloadStatus.APPLIED, [], changed)

    def _still_to_wait(self, text: str, weaker: list[str]) -> float | None:
        """None when the edit may apply now; else the seconds until the file may have been quiet long
        enough. A weakening edit applies once the same text (and file) was read twice, `quiet` apart."""
        if not weaker:
            return None
        now, seen = time.monotonic(), (text, self._stat)
        if self._waiting != seen:
            self._waiting, self._waiting_since = seen, now
            log.warning(
                "policy %s weakens a guard (%s); it applies once the file stays unchanged for %gs,"
                " until then the current policy keeps serving",
                self.path,
                "; ".join(weaker),
                self.quiet,
            )
        waited = now - self._waiting_since
        return None if waited >= self.quiet and self._waiting_since < now else self.quiet - waited

    async def _validate(self, text: str) -> tuple[Policy | None, dict[str, ServedTool] | None, list[Problem]]:
        report = analyse_text(text, str(self.path))
        if report.policy is None:
            return None, None, check_report(report, self.path.parent)  # every problem, as `check` finds them
        self._note_restart_only_changes(report.policy)
        policy = self._with_running_ledger(report.policy)
        try:
            await self.gateway.upstreams.update(policy, retire=False)  # the current policy still serves
            using = self.gateway.collaborators(policy)
            served = build_tools(policy, self.path.parent, using, self._reusable(policy))
        except ToolBuildError as exc:
            return None, None, self._all_problems(report, exc.problems)
        problems = source_problems(policy.tools, served_schemas(served))
        return (None, None, self._all_problems(report, problems)) if problems else (policy, served, [])

    def _to_be_served(self, policy: Policy) -> Policy:
        """`policy` with the tools it will serve as its entries: its own, and those its `tools = "all"`
        upstreams add. An upstream whose connection under the edited declaration has not listed its
        tools (yet) is taken at what it offers now: its tools are served once it does."""
        upstreams, running = self.gateway.upstreams, self.gateway.policy

        def offer(name: str) -> UpstreamConnection | None:
            edited = upstreams.connection(name, policy.upstreams[name]) if name in policy.upstreams else None
            if (edited is None or not edited.listed) and name in running.upstreams:
                return upstreams.connection(name, running.upstreams[name]) or edited
            return edited

        return policy.model_copy(update={"tools": {**policy.tools, **implied_entries(policy, offer)}})

    def _all_problems(self, report: PolicyReport, found: list[Problem]) -> list[Problem]:
        """What `check` reports, plus what only live upstream connections could reveal."""
        checked = check_report(report, self.path.parent)
        return list(dict.fromkeys(checked + with_lines(found, report.text or "")))

    async def _retire_upstreams(self, serving: Policy) -> None:
        await self.gateway.upstreams.retire(serving)

    def _with_running_ledger(self, policy: Policy) -> Policy:
        # The ledger is opened once: `--ledger` and the file's [ledger] both apply only at start.
        return policy.model_copy(update={"ledger": self.gateway.policy.ledger})

    def _note_restart_only_changes(self, policy: Policy) -> None:
        if self._file_ledger is not None and policy.ledger != self._file_ledger:
            log.warning("[ledger] changed in %s: it takes effect at the next restart", self.path)
        self._file_ledger = policy.ledger
        if policy.server.name != self.gateway.policy.server.name:
            log.warning("[server] name changed in %s: it takes effect at the next restart", self.path)

    def _reusable(self, policy: Policy) -> dict[str, ToolSource]:
        """Sources of tools whose declaration did not change: kept, not rebuilt."""
        current, old_policy = self.gateway.served, self.gateway.policy
        reuse: dict[str, ToolSource] = {}
        for name, tool in policy.tools.items():
            served = current.get(name)
            if served is None or served.guard.policy != tool:
                continue
            if tool.upstream and old_policy.upstreams.get(tool.upstream) != policy.upstreams.get(
                tool.upstream
            ):
                continue
            reuse[name] = served.guard.source
        return reuse

    def _apply(self, policy: Policy, served: dict[str, ServedTool]) -> bool:
        before = self.gateway.list_tools()
        self.gateway.apply(policy, served)
        changed = self.gateway.list_tools() != before
        log.info(  # routine news: an operator asked for this change
            "policy %s applied: %d tool(s)%s",
            self.path,
            len(served),
            "; tool list changed" if changed else "; tool list unchanged",
        )
        return changed


def as_served(policy: Policy, served: Mapping[str, ServedTool]) -> Policy:
    """`policy` with the tools it serves as its entries: its own, and those `tools = "all"` upstreams
    add. Guards are compared on these: dropping the entry of a tool its upstream still offers, or a
    looser `default_class`, changes what is served without an entry changing the same way."""
    return policy.model_copy(update={"tools": {name: s.guard.policy for name, s in served.items()}})


# --- watching ----------------------------------------------------------------------------------


async def watch_policy(
    gateway: Gateway,
    path: Path,
    on_applied: OnApplied,
    *,
    stop: anyio.Event | None = None,
    tick: float = 1.0,
) -> None:
    """Follow edits of `path` until `stop` is set (or the task is cancelled)."""
    target = path.resolve()
    logging.getLogger("watchfiles").setLevel(logging.WARNING)  # one "change detected" line per save is noise
    reloader = PolicyReloader(gateway, target, on_applied)
    await reloader.prime()

    def ours(change: Change, changed: str) -> bool:
        return Path(changed) == target

    log.info("watching %s for policy edits", target)
    async with anyio.create_task_group() as tasks:
        rereads = _Rereads(reloader, tasks)
        # Polled, not inotify: the directory may also hold the ledger, whose every commit would wake
        # the watcher (about 0.15 ms of a 2-core machine per guarded call, measured).
        async for changes in awatch(
            target.parent,
            watch_filter=ours,
            stop_event=stop,
            rust_timeout=max(1, int(tick * 1000)),
            yield_on_timeout=True,
            recursive=False,
            force_polling=True,
            poll_delay_ms=max(50, int(tick * 500)),
        ):
            if changes or reloader.changed_on_disk():
                await rereads.reload()
        tasks.cancel_scope.cancel()


@dataclass
class _Rereads:
    """Reloads one at a time, and the timer that re-reads the file once a waiting edit may apply."""

    reloader: PolicyReloader
    tasks: anyio.abc.TaskGroup
    _lock: anyio.Lock = field(default_factory=anyio.Lock)
    _timer: anyio.CancelScope | None = None

    async def reload(self) -> None:
        async with self._lock:
            try:
                result = await self.reloader.reload()
            except Exception:  # an unexpected failure rejects this edit, not the watching
                log.exception("reloading %s failed; the current policy keeps serving", self.reloader.path)
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if result.reread_in is not None:
                self._timer = anyio.CancelScope()
                self.tasks.start_soon(self._reread, self._timer, result.reread_in)

    async def _reread(self, timer: anyio.CancelScope, delay: float) -> None:
        with timer:  # only the wait is cancelled: a reload under way always finishes
            await anyio.sleep(delay + 0.01)
        if not timer.cancel_called:
            await self.reload()


async def _announce(on_applied: OnApplied) -> None:
    """Tell clients the tool list changed; best effort: what was applied stays applied."""
    try:
        await on_applied()
    except Exception:
        log.exception("could not announce the changed tool list")


# --- an upstream's tools changed --------------------------------------------------------------------


async def refresh_upstream_tools(gateway: Gateway, on_applied: OnApplied) -> bool:
    """Rebuild the upstream tools of the serving policy from what the upstreams offer now.

    An upstream that was down at start is served from the policy alone (a permissive schema
    unless it declares one, and no key forwarding); one that comes back with other tools has
    stale schemas. Other tools keep their sources. True when clients were told of a change.
    """
    async with gateway.rebuilding:
        policy = gateway.policy
        try:
            kept = {
                name: s.guard.source for name, s in gateway.served.items() if s.guard.policy.upstream is None
            }
            policy_dir = gateway.policy_path.parent if gateway.policy_path else None
            served = build_tools(policy, policy_dir, gateway.collaborators(policy), kept)
        except ToolBuildError as exc:  # e.g. it no longer offers a declared tool: keep what serves
            log.error(
                "the tools an upstream offers do not fit the policy; the current tools keep serving.\n%s",
                exc,
            )
            return False
        before = gateway.list_tools()
        gateway.apply(policy, served)
        changed = gateway.list_tools() != before
    if changed:
        # Normal at every first connect (definitions merged in, `tools = "all"` tools added); what an
        # upstream adds or drops later is said where it is seen (tools/upstream.py).
        log.info("upstream tools refreshed: the tool list changed")
        await _announce(on_applied)
    return changed


@contextlib.asynccontextmanager
async def upstream_refresher(gateway: Gateway, on_applied: OnApplied) -> AsyncIterator[None]:
    """Run `refresh_upstream_tools` whenever an upstream lists other tools, beside the body."""
    upstreams = gateway.upstreams

    async def follow() -> None:
        while True:
            await upstreams.tools_changed.wait()
            upstreams.tools_changed.clear()
            try:
                await refresh_upstream_tools(gateway, on_applied)
                # What they list now is what the next start advertises before they connect.
                await record_listed(upstreams, gateway.policy, gateway.ledger)
            except Exception:  # refreshing must never take the server down
                log.exception("refreshing upstream tools failed; the current tools keep serving")

    task = asyncio.create_task(follow(), name="commitgate-upstream-refresh")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def policy_watcher(gateway: Gateway, on_applied: OnApplied) -> AsyncIterator[None]:
    """Run `watch_policy` beside the body when the gateway serves a policy file."""
    path = gateway.policy_path
    if path is None:
        yield
        return
    stop = anyio.Event()

    async def guarded() -> None:
        try:
            await watch_policy(gateway, path, on_applied, stop=stop)
        except Exception:  # losing reload must never take the server down
            log.exception("policy reload stopped; restart to pick up further edits")

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(guarded)
        try:
            yield
        finally:
            stop.set()  # wakes the watcher thread at its next step
            tasks.cancel_scope.cancel()
