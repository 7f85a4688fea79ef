"""The safety experiments of `commitgate bench`, through real server processes.

Every experiment drives real `commitgate serve` processes over stdio with the
SDK's `Client`, and counts effects in the system of record (the demo sandbox
store, a SQLite file), never in commitgate's own answers:

  1. double charge: bookings with 50 % of acknowledgements lost after commit; a
     naive client (no key, pass-through policy, retries until it sees success)
     vs the same agent through commitgate;
  2. saga: reserve -> pay -> confirm with 30 % confirmation failures, undone by
     compensate_session (sent twice at once, then again, with refund acks lost);
  3. backoff: concurrent retriers against a capacity-limited service, retried by
     commitgate's safe-retry class with immediate retries vs full jitter;
  4. concurrency: concurrent duplicates of each key through one server process
     and through several processes sharing one ledger file;
  5. fresh keys: bookings with 50 % of answers lost before the client reads them,
     by a naive client that mints a new key on every try, with duplicate
     detection off and on (the default).
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import Client
from mcp.types import CallToolResult

from commitgate.server.bench.stats import quantile
from commitgate.server.bench.workspace import (
    Bench,
    BenchError,
    cpu_seconds,
    error_code,
    operation_of,
    pool,
    session_meta,
)
from commitgate.server.demo.sandbox import server_pids

# --- policies -------------------------------------------------------------------------------------

BACKOFF_POLICY = """
[server]
name = "commitgate-bench-backoff"
[ledger]
synchronous = "FULL"
[tools.work]
class = "safe-retry"
python = "commitgate.server.bench.tools:overloaded_service"
timeout = "60s"
retry = {retry}
[tools.service_load]
class = "safe-retry"
python = "commitgate.server.bench.tools:service_load"
retry = {{ attempts = 1 }}
"""
IMMEDIATE_RETRY = (
    '{ attempts = 100, initial = "0ms", max = "0ms", multiplier = 1.0, jitter = "none", deadline = "300s" }'
)
JITTER_RETRY = (
    '{ attempts = 100, initial = "100ms", max = "2s", multiplier = 2.0, jitter = "full", deadline = "300s" }'
)

# Up to 128 identical calls run at once from one principal (64 copies of 2 keys): above the default
# limit of 64 per principal, which would refuse the surplus before it reaches the ledger (nothing
# executed, `retries_exhausted`) and leave some keys with no effect at all. The experiment is about
# the ledger deciding between concurrent duplicates, so every call must reach it.
CONCURRENCY_POLICY = """
[server]
name = "commitgate-bench-concurrency"
in_progress_wait = "60s"
respond_within = "60s"
[server.limits]
max_concurrent_per_principal = 1000
[ledger]
synchronous = "FULL"
[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
timeout = "60s"
"""


# --- experiment 1: double charge ------------------------------------------------------------------------


async def double_charge(bench: Bench) -> dict[str, Any]:
    bookings = bench.scale.bookings
    tick = bench.task("double charge", 2 * bookings)
    naive = await _bookings(bench, guarded=False, tick=tick)
    guarded = await _bookings(bench, guarded=True, tick=tick)
    return {
        "sandbox": "demo sandbox store (SQLite), fault charge_card.lose_ack=50%: the charge commits, "
        "then its acknowledgement is lost",
        "naive": naive,
        "guarded": guarded,
    }


async def _bookings(bench: Bench, *, guarded: bool, tick: Callable[[int], None]) -> dict[str, Any]:
    from commitgate.server.demo.sandbox import (
        NAIVE_POLICY,  # safe-retry, one attempt: what an agent gets without commitgate
    )

    arm = "guarded" if guarded else "naive"
    policy = None if guarded else bench.policy("naive-charge", NAIVE_POLICY)
    params = bench.serve(policy, bench.ledger(f"double-charge-{arm}"), faults="charge_card.lose_ack=50%")
    bookings = bench.scale.bookings
    calls = recovered = 0
    started = time.perf_counter()
    async with bench.connect(params) as client:

        async def book(n: int) -> None:
            nonlocal calls, recovered
            arguments: dict[str, Any] = {"card": f"{arm}-{n}", "amount_cents": 100 + n % 900}
            if guarded:
                arguments["idempotency_key"] = f"booking-{n}"
            while True:  # the agent retries until it sees success
                calls += 1
                result = await client.call_tool("charge_card", arguments)
                if not result.is_error:
                    break
                if calls > 100 * bookings:
                    raise BenchError(f"{arm}: booking {n} never succeeded: {result.content}")
            recovered += bool(operation_of(result).get("replayed"))
            tick(1)

        await pool(bookings, bench.scale.agents, book)
    seconds = time.perf_counter() - started
    figures = {
        "bookings": bookings,
        **_charges_of(f"{arm}-", bookings),
        "retries": calls - bookings,
        "seconds": round(seconds, 2),
    }
    if guarded:
        figures["lost_acks_recovered_by_status_check"] = recovered
    return figures


def _charges_of(cards: str, bookings: int) -> dict[str, Any]:
    """The charges in the sandbox store for `bookings` bookings, one card each, named `cards`<n>."""
    from commitgate.server.demo import tools as demo

    per_booking = Counter(row["card"] for row in demo.rows("charges") if str(row["card"]).startswith(cards))
    charges = sum(per_booking.values())
    return {
        "charges": charges,
        "duplicate_charges": charges - bookings,
        "duplicate_rate": round((charges - bookings) / bookings, 4),
        "double_charged_bookings": sum(1 for n in per_booking.values() if n > 1),
        "uncharged_bookings": bookings - len(per_booking),
    }


# --- experiment 2: saga ----------------------------------------------------------------------------------


@dataclass
class _Order:
    n: int
    booking_id: str = ""
    confirmed: bool = False

    @property
    def session(self) -> str:
        return f"saga-order-{self.n}"

    @property
    def card(self) -> str:
        return f"saga-card-{self.n}"

    @property
    def amount(self) -> int:
        return 1000 + self.n


async def saga(bench: Bench) -> dict[str, Any]:
    orders = [_Order(n) for n in range(bench.scale.orders)]
    tick = bench.task("saga", 2 * len(orders))
    faults = "confirm.fail_permanent=30%,refund.lose_ack=30%"
    outcomes: Counter[str] = Counter()
    started = time.perf_counter()
    async with bench.connect(bench.serve(None, bench.ledger("saga"), faults=faults)) as client:

        async def call(order: _Order, tool: str, key: str, **arguments: Any) -> CallToolResult:
            arguments["idempotency_key"] = key
            return await client.call_tool(tool, arguments, meta=session_meta(order.session))

        async def book(index: int) -> None:
            order = orders[index]
            reserved = await call(order, "reserve", "reserve", resource=f"room-{order.n}", customer="c")
            paid = await call(order, "pay_booking", "pay", card=order.card, amount_cents=order.amount)
            if reserved.is_error or paid.is_error:
                raise BenchError(
                    f"saga order {order.n}: reserve/pay failed: {reserved.content} {paid.content}"
                )
            order.booking_id = str((reserved.structured_content or {})["booking_id"])
            confirmed = await call(order, "confirm", "confirm", booking_id=order.booking_id)
            order.confirmed = not confirmed.is_error
            if confirmed.is_error and error_code(confirmed) != "operation_failed":
                raise BenchError(f"saga order {order.n}: unexpected confirm answer {confirmed.content}")
            tick(1)

        await pool(len(orders), bench.scale.agents, book)
        failed = [order for order in orders if not order.confirmed]
        before = _charged_unconfirmed(orders)

        async def compensate(order: _Order) -> dict[str, Any]:
            answer = await client.call_tool(
                "compensate_session", {"reason": "confirmation failed"}, meta=session_meta(order.session)
            )
            return dict(answer.structured_content or {})

        async def undo(index: int) -> None:
            order = failed[index]
            async with anyio.create_task_group() as group:  # a retry racing the first call
                for _ in range(2):
                    group.start_soon(compensate, order)
            outcomes[str((await compensate(order)).get("state"))] += 1  # and once more, later
            tick(1)

        tick(len(orders) - len(failed))
        await pool(len(failed), bench.scale.agents, undo)
    return {
        "orders": len(orders),
        "confirmation_failures": len(failed),
        "faults": faults,
        "charged_without_confirmation_before": before,
        "charged_without_confirmation_after": _charged_unconfirmed(orders),
        "compensate_session_calls": 3 * len(failed),
        "final_compensation_states": dict(outcomes),
        **_refund_counts(orders),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _charged_unconfirmed(orders: list[_Order]) -> int:
    """Orders whose customer is charged (not refunded) while the booking is not confirmed."""
    from commitgate.server.demo import tools as demo

    charges = {row["card"]: row for row in demo.rows("charges")}
    status = {row["id"]: row["status"] for row in demo.rows("bookings")}
    count = 0
    for order in orders:
        charge = charges.get(order.card)
        if charge is None:
            continue
        charged = charge["amount_cents"] - charge["refunded_cents"] > 0
        count += charged and status.get(order.booking_id) != "confirmed"
    return count


def _refund_counts(orders: list[_Order]) -> dict[str, int]:
    from commitgate.server.demo import tools as demo

    ours = {order.card for order in orders}
    charges = {row["id"]: row for row in demo.rows("charges") if row["card"] in ours}
    per_charge = Counter(row["charge_id"] for row in demo.rows("refunds") if row["charge_id"] in charges)
    released = {row["id"] for row in demo.rows("bookings", status="released")}
    return {
        "refunds": sum(per_charge.values()),
        "refunds_issued_twice": sum(1 for n in per_charge.values() if n > 1),
        "over_refunded_charges": sum(
            1 for charge in charges.values() if charge["refunded_cents"] > charge["amount_cents"]
        ),
        "bookings_released": sum(1 for order in orders if order.booking_id in released),
    }


# --- experiment 3: backoff -------------------------------------------------------------------------------


async def backoff(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("backoff", 2 * scale.retriers)
    arms = {}
    for arm, retry in (("immediate", IMMEDIATE_RETRY), ("full_jitter", JITTER_RETRY)):
        arms[arm] = await _retriers(bench, arm, retry, tick)
    return {
        "retriers": scale.retriers,
        "capacity": scale.capacity,
        "service_ms": {"median": scale.median_ms, "p99": scale.p99_ms},
        "retrying": "in commitgate's safe-retry class; the client calls again only on retries_exhausted",
        **arms,
    }


async def _retriers(bench: Bench, arm: str, retry: str, tick: Callable[[int], None]) -> dict[str, Any]:
    scale = bench.scale
    ledger = bench.ledger(f"backoff-{arm}")
    policy = bench.policy(f"backoff-{arm}", BACKOFF_POLICY.format(retry=retry))
    params = bench.serve(policy, ledger, env={"COMMITGATE_BENCH_CAPACITY": str(scale.capacity)})
    completion: list[float] = []
    client_calls = 0
    async with bench.connect(params, timeout=600.0) as client:
        pid = (server_pids(str(ledger)) or [0])[0]
        cpu_before = cpu_seconds(pid) or 0.0
        started = time.perf_counter()

        async def retrier(n: int) -> None:
            nonlocal client_calls
            arguments = {"job": f"job-{n}", "median_ms": scale.median_ms, "p99_ms": scale.p99_ms}
            while True:
                client_calls += 1
                result = await client.call_tool("work", arguments)
                if not result.is_error:
                    break
                if error_code(result) != "retries_exhausted":
                    raise BenchError(f"backoff {arm}: unexpected answer {result.content}")
            completion.append(time.perf_counter() - started)
            tick(1)

        await pool(scale.retriers, scale.retriers, retrier)
        load = (await client.call_tool("service_load", {})).structured_content or {}
        cpu = (cpu_seconds(pid) or 0.0) - cpu_before
    bench.raw.setdefault("backoff_completion_s", {})[arm] = completion
    return {
        "policy": f"retry = {retry}",
        "p50_completion_s": round(quantile(completion, 0.5), 3),
        "p99_completion_s": round(quantile(completion, 0.99), 3),
        "max_completion_s": round(max(completion), 3),
        "attempts": load.get("attempts"),
        "attempts_per_job": round(int(load.get("attempts", 0)) / scale.retriers, 1),
        "rejected": load.get("rejected"),
        "peak_in_service": load.get("peak_in_service"),
        "peak_attempts_per_s": load.get("peak_attempts_per_s"),
        "client_calls": client_calls,
        "server_cpu_s": round(cpu, 2),
    }


# --- experiment 4: concurrency -----------------------------------------------------------------------------


async def concurrency(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("concurrency", 2 * scale.dup_keys)
    return {
        "keys": scale.dup_keys,
        "duplicates_per_key": scale.dup_copies,
        "tool_latency_s": scale.tool_latency,
        "one_process": await _duplicates(bench, processes=1, tick=tick),
        "several_processes": await _duplicates(bench, processes=scale.processes, tick=tick),
    }


async def _duplicates(bench: Bench, *, processes: int, tick: Callable[[int], None]) -> dict[str, Any]:
    scale = bench.scale
    mode = f"p{processes}"
    ledger = bench.ledger(f"concurrency-{mode}")
    params = bench.serve(
        bench.policy("concurrency", CONCURRENCY_POLICY),
        ledger,
        faults=f"create_ticket.latency={scale.tool_latency}s",
    )
    answers: Counter[str] = Counter()
    started = time.perf_counter()
    async with bench.connect_all({n: params for n in range(processes)}) as by_process:
        clients = list(by_process.values())

        async def one(client: Client, key: str, k: int) -> None:
            result = await client.call_tool(
                "create_ticket", {"title": f"ticket {k}", "body": "bench", "idempotency_key": key}
            )
            if result.is_error:
                answers[str(error_code(result))] += 1
            else:
                answers["replayed" if operation_of(result).get("replayed") else "executed"] += 1

        async def duplicates(k: int) -> None:
            key = f"{mode}-key-{k}"
            async with anyio.create_task_group() as group:
                for copy in range(scale.dup_copies):
                    group.start_soon(one, clients[copy % processes], key, k)
            tick(1)

        await pool(scale.dup_keys, scale.keys_in_flight, duplicates)
    from commitgate.server.demo import tools as demo

    effects = Counter(
        row["idempotency_key"]
        for row in demo.rows("tickets")
        if str(row["idempotency_key"]).startswith(f"{mode}-key-")
    )
    per_key = [effects.get(f"{mode}-key-{k}", 0) for k in range(scale.dup_keys)]
    return {
        "processes": processes,
        "calls": scale.dup_keys * scale.dup_copies,
        "effects": sum(per_key),
        "max_effects_per_key": max(per_key),
        "min_effects_per_key": min(per_key),
        "keys_not_exactly_once": sum(1 for n in per_key if n != 1),
        "answers": dict(answers),
        "seconds": round(time.perf_counter() - started, 2),
    }


# --- experiment 5: fresh keys -----------------------------------------------------------------------------
# An agent whose answer was lost calls again, but with a key of its own making, new on every
# try: the key cannot tell the retry from a new booking. Answers are lost on the client's side
# (after the server answered), which no status check can see.

FRESH_KEYS_POLICY = """
[server]
name = "commitgate-bench-fresh-keys"
[ledger]
synchronous = "FULL"
[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
{duplicates}
"""
LOST_ANSWERS = 0.5


async def fresh_keys(bench: Bench) -> dict[str, Any]:
    bookings = bench.scale.bookings
    tick = bench.task("fresh keys", 2 * bookings)
    return {
        "client": f"mints a new idempotency_key on every try; {LOST_ANSWERS:.0%} of answers are lost before it "
        "reads them; it stops at the first answer it reads (a success, or possible_duplicate with the earlier "
        "charge's result)",
        "without_detection": await _fresh_key_bookings(bench, detection=False, tick=tick),
        "with_detection": await _fresh_key_bookings(bench, detection=True, tick=tick),
    }


async def _fresh_key_bookings(
    bench: Bench, *, detection: bool, tick: Callable[[int], None]
) -> dict[str, Any]:
    arm = "detect" if detection else "nodetect"
    text = FRESH_KEYS_POLICY.format(duplicates="" if detection else "duplicates = false")
    params = bench.serve(bench.policy(f"fresh-keys-{arm}", text), bench.ledger(f"fresh-keys-{arm}"))
    bookings = bench.scale.bookings
    rng = random.Random(f"fresh-keys-{bench.scale.bookings}")  # the same losses for both arms
    calls = 0
    answers: Counter[str] = Counter()
    started = time.perf_counter()
    async with bench.connect(params) as client:

        async def book(n: int) -> None:
            nonlocal calls
            arguments: dict[str, Any] = {"card": f"fresh-{arm}-{n}", "amount_cents": 100 + n % 900}
            while True:
                calls += 1
                arguments["idempotency_key"] = f"booking-{n}-{uuid.uuid4().hex[:8]}"  # the naive part
                result = await client.call_tool("charge_card", arguments)
                code = error_code(result) or "success"
                if rng.random() < LOST_ANSWERS:
                    continue  # the answer never reached the agent
                answers[code] += 1
                if code in ("success", "possible_duplicate"):
                    break
                if calls > 100 * bookings:
                    raise BenchError(f"fresh keys ({arm}): booking {n} never settled: {result.content}")
            tick(1)

        await pool(bookings, bench.scale.agents, book)
    seconds = time.perf_counter() - started
    return {
        "bookings": bookings,
        "calls": calls,
        **_charges_of(f"fresh-{arm}-", bookings),
        "answers_read": dict(answers),
        "seconds": round(seconds, 2),
    }
