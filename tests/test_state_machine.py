"""Property tests of the state machine: no sequence of outcomes produces two effects for one key.

Hypothesis draws a history for one idempotency key: calls whose attempts end in
any outcome (success, retryable, permanent, ambiguous before or after the effect,
a crash before or after the effect), status checks that find, find nothing or
fail, concurrent duplicates, lease expiries, sweeps and polls. After every step
the ledger must agree with the system of record (or say UNKNOWN), and the record
must hold at most one effect. A final settling call must then reach a decided
state wherever the class can decide one.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.boundary import (
    Crash,
    FakeClock,
    ScriptedTool,
    SystemOfRecord,
    call_request,
    effect_of,
    guarded,
    make_boundary,
)

from commitgate.server.core.boundary import ATTEMPT_SLACK, CommitBoundary
from commitgate.server.core.requests import Answer
from commitgate.server.ledger.base import AttemptStart, Claim, ClaimKind, ClaimRequest, Ledger, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.facts import ErrorCode, State
from commitgate.server.model.records import Operation

LEASE = 10.0
TIMEOUT = 2.0  # the tools' timeout (support.boundary.guarded)
EXAMPLES = int(os.environ.get("COMMITGATE_SM_EXAMPLES", "60"))  # raise it to hunt harder
ATTEMPT = st.sampled_from(
    ["ok", "retryable", "permanent", "ambiguous_before", "ambiguous_after", "crash_before", "crash_after"]
)
STATUS = st.sampled_from(["lookup", "fail"])
CALL = st.tuples(
    st.sampled_from(["call", "duplicates", "call_and_poll"]),
    st.lists(ATTEMPT, max_size=4),
    st.lists(STATUS, max_size=3),
)
ACTION = st.one_of(CALL, st.sampled_from([("expire",), ("sweep",), ("poll",)]))
CONFIGS = [
    ("key-required", False),
    ("key-required", True),
    ("key-and-status-check", False),
    ("compensable", False),
]


class ModelTime:
    """The real ledger, whose clock for attempts is the model's: an attempt is as old as the model
    time passed since its take (time passes only when the model says, never while it runs)."""

    def __init__(self, inner: Ledger, clock: FakeClock) -> None:
        self.inner, self.clock = inner, clock
        self.taken: dict[tuple[str, int], float] = {}

    async def claim(self, request: ClaimRequest, now: float) -> Claim:
        claim = await self.inner.claim(request, now)
        if claim.kind is ClaimKind.NEW:
            self.taken[(claim.operation.operation_id, claim.operation.fence)] = self.clock()
        return claim

    async def update(
        self, operation_id: str, change: Transition, now: float, *, current: Operation | None = None
    ) -> Operation | None:
        op = await self.inner.update(operation_id, change, now, current=current)
        if op is not None and change.lease is not None:
            self.taken[(operation_id, op.fence)] = self.clock()
        return op

    async def attempt_start(self, operation_id: str, fence: int) -> AttemptStart | None:
        start = await self.inner.attempt_start(operation_id, fence)
        if start is None:
            return None
        return AttemptStart(start.owner, self.clock() - self.taken.get((operation_id, fence), self.clock()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class World:
    """One key's world: the ledger, the system of record, and the process currently serving."""

    ledger: Ledger
    record: SystemOfRecord
    cls: str
    forwards_key: bool
    attempts: int
    clock: FakeClock = field(default_factory=FakeClock)
    generation: int = 0
    source: ScriptedTool | None = None
    boundary: CommitBoundary | None = None
    log: list[str] = field(default_factory=list)

    def restart(self) -> None:
        """A new server process (the previous one crashed, or this is the first)."""
        self.generation += 1
        self.source = ScriptedTool(self.record, dedup=self.forwards_key)
        tool = guarded(
            "charge", self.cls, self.source, forwards_key=self.forwards_key, retry={"attempts": self.attempts}
        )
        self.boundary = make_boundary(
            self.ledger,
            [tool],
            clock=self.clock,
            owner=f"node{self.generation}:1:x",  # another host: only its lease says it is gone
            lease=LEASE,
            in_progress_wait="0s",
        )

    async def op(self) -> Operation | None:
        return await self.ledger.get("alice", "s1", "k1")

    async def call(self, script: list[str], status: list[str], copies: int, *, poll: bool = False) -> None:
        assert self.source is not None and self.boundary is not None
        self.source.script, self.source.status_script = list(script), list(status)
        tool = self.boundary.tools["charge"]
        calls: list[Awaitable[Any]] = [self.boundary.call(call_request(tool, "k1")) for _ in range(copies)]
        if poll:  # a poll racing the call; its effect on the ledger is checked like every other step
            calls.append(self._poll())
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        crashed = False
        for outcome in outcomes:
            if isinstance(outcome, Crash):
                crashed = True
            elif isinstance(outcome, BaseException):
                raise outcome
            elif isinstance(outcome, Answer):
                self.check_answer(outcome, alone=len(calls) == 1)
        if crashed:
            self.restart()

    def check_answer(self, answer: Answer, *, alone: bool) -> None:
        """A success reports the effect; a failure that says "not applied" is true when it is read.

        Among concurrent duplicates an early "not applied" may be followed by a legitimate re-run,
        so failures are only checked for a call that ran alone.
        """
        effects = self.record.effect_ids()
        if answer.error is None:
            assert answer.result is not None and effect_of(answer.result) in effects, (
                "success without its effect"
            )
            return
        code = answer.error.code
        self.log.append(code.value)
        if alone and code in (ErrorCode.OPERATION_FAILED, ErrorCode.RETRIES_EXHAUSTED):
            assert effects == [], f"{code.value} although the effect happened"

    async def check(self) -> None:
        effects = self.record.effect_ids()
        assert len(effects) <= 1, f"{len(effects)} effects for one key: {self.log}"
        op = await self.op()
        if op is None:
            assert effects == []
            return
        self.log.append(op.state.value)
        if op.state is State.SUCCEEDED:
            assert effect_of(op.result) in effects, f"SUCCEEDED without its effect: {self.log}"
        elif op.state in (State.FAILED_FINAL, State.FAILED_RETRYABLE):
            assert effects == [], f"{op.state.value} although the effect happened: {self.log}"

    async def step(self, action: tuple[Any, ...]) -> None:
        kind = action[0]
        self.log.append(kind)
        assert self.boundary is not None
        if kind in ("call", "duplicates", "call_and_poll"):
            await self.call(
                action[1], action[2], 3 if kind == "duplicates" else 1, poll=kind == "call_and_poll"
            )
        elif kind == "expire":
            self.clock.advance(LEASE + 1)
        elif kind == "sweep":
            await self.ledger.expire_leases(self.clock())
        elif kind == "poll":
            await self._poll()

    async def _poll(self) -> None:
        assert self.boundary is not None
        if (op := await self.op()) is not None:
            await self.boundary.poll(op)

    async def settle(self) -> None:
        """Time passes and the client calls once more, with everything healthy: where can it end?
        (Past any attempt's lease and timeout: a status check may then say "not found".)"""
        self.clock.advance(LEASE + TIMEOUT + ATTEMPT_SLACK + 1)
        await self.call(["ok"], ["lookup"], 1)
        await self.check()
        op = await self.op()
        assert op is not None
        decidable = self.cls == "key-and-status-check" or self.forwards_key
        allowed = {State.SUCCEEDED, State.FAILED_FINAL} | (set() if decidable else {State.UNKNOWN})
        assert op.state in allowed, f"settled in {op.state.value}: {self.log}"


async def play(cls: str, forwards_key: bool, attempts: int, actions: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory(prefix="commitgate-sm-") as tmp:
        # fsync proves nothing here (no process dies for real): skip it so examples stay cheap
        ledger = await SQLiteLedger.open(Path(tmp) / "ledger.db", synchronous="OFF")
        try:
            clock = FakeClock()
            model = ModelTime(ledger, clock)
            world = World(model, SystemOfRecord(Path(tmp) / "record.db"), cls, forwards_key, attempts, clock)
            world.restart()
            for action in actions:
                await world.step(action)
                await world.check()
            await world.settle()
        finally:
            await ledger.close()


@pytest.mark.parametrize(("cls", "forwards_key"), CONFIGS)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attempts=st.integers(1, 3), actions=st.lists(ACTION, min_size=1, max_size=8))
def test_no_history_produces_two_effects_for_one_key(
    cls: str, forwards_key: bool, attempts: int, actions: list[tuple[Any, ...]]
) -> None:
    asyncio.run(play(cls, forwards_key, attempts, actions))
