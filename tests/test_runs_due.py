"""respond_within's timers: callers waiting for their work share one timer per moment on a grid."""

from __future__ import annotations

import asyncio

from commitgate.server.core.requests import Answer
from commitgate.server.core.runs import DUE_GRID, DueAnswers


class CountingLoop:
    """Counts the timers a loop is asked for while `due` adds its waiters."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.timers = loop, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.loop, name)

    def call_at(self, when: float, callback: object, *args: object) -> asyncio.TimerHandle:
        self.timers += 1
        return self.loop.call_at(when, callback, *args)  # type: ignore[arg-type]


async def _wait_all(due: DueAnswers, count: int, within: float) -> tuple[int, list[float], float]:
    loop = asyncio.get_running_loop()
    counting = CountingLoop(loop)
    started = loop.time()
    answered: list[asyncio.Future[Answer | None]] = [loop.create_future() for _ in range(count)]
    for future in answered:
        due.add(counting, future, within)  # type: ignore[arg-type]
    ended: list[float] = []
    for future in answered:
        assert await asyncio.wait_for(future, 2.0) is None  # not answered by its work within respond_within
        ended.append(loop.time())
    return counting.timers, ended, started


def test_waiters_added_together_share_one_timer_and_are_never_answered_early() -> None:
    due = DueAnswers()
    timers, ended, started = asyncio.run(_wait_all(due, 50, 0.05))
    assert timers <= 2  # one moment, or two when the adds straddle a grid line; not one per call
    assert all(started + 0.05 <= at <= started + 0.05 + DUE_GRID + 0.5 for at in ended)


def test_a_waiter_answered_by_its_work_is_left_alone() -> None:
    async def run() -> tuple[Answer | None, int]:
        loop, due = asyncio.get_running_loop(), DueAnswers()
        answered: asyncio.Future[Answer | None] = loop.create_future()
        waiting = due.add(loop, answered, 0.02)
        sentinel = Answer(None, None, False)
        answered.set_result(sentinel)  # the work answered first
        waiting.discard(answered)
        await asyncio.sleep(0.02 + 2 * DUE_GRID)  # the moment passes: nothing to answer, no error
        return answered.result(), len(waiting)

    result, left = asyncio.run(run())
    assert result is not None and left == 0


def test_a_new_event_loop_gets_timers_of_its_own() -> None:
    """Runs may outlive a loop (tests, a restarted console): a moment's timer on a closed loop never
    fires, so waiters on a new loop must not join it."""
    due = DueAnswers()
    loop = asyncio.new_event_loop()
    try:  # a moment opened on a loop that then closes with its timer still pending
        future: asyncio.Future[Answer | None] = loop.create_future()
        due.add(loop, future, 0.05)
    finally:
        loop.close()
    timers, ended, started = asyncio.run(_wait_all(due, 3, 0.05))
    assert timers >= 1 and all(at >= started + 0.05 for at in ended)
