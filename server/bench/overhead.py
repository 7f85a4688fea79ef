"""What a guarded call costs: the overhead suite of `commitgate bench`, and the disk's floor.

The overhead suite runs its variants side by side: calls are interleaved one by one
(in a fresh random order each time), each variant answered by a server process of its
own, grouped in rounds; each round gives a median per variant and a paired ratio, and the
summary is the median ratio with its spread. Beside the compared variants (on the
default, lean stdio transport of serve/stdio.py) it measures the guarded call without
fsyncs (what the guard costs in software), the same calls on the SDK's stdio transport,
what duplicate detection adds (the same guarded no-op with `duplicates = false`), the
guarded call with `[ledger] durability = "claim"` (the outcome synced by the next group
commit), what one durable SQLite commit costs in syncs on this disk, and, timed in the
same rounds, the least software a SQLite claim and outcome need (`LeastClaim`).

The disk floor (a 4 KiB overwrite of a preallocated file + fdatasync) is timed in a block of
its own once the rounds are over and every server has gone quiet: timed between the calls,
it would absorb the syncs the servers run in the background (checkpoints, the outcomes a
`durability = "claim"` server syncs after answering). Those interleaved samples are kept as
"a sync under the bench's own load". The guard's cost is reported in units of two idle
floors, what a claim and an outcome need at the least.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import sqlite3
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mcp import Client

from commitgate.server.bench.stats import spread
from commitgate.server.bench.workspace import Bench, BenchError, operation_of

OVERHEAD_POLICY = """
# The same no-op twice: unguarded (safe-retry, no ledger) and guarded (key-required, durable ledger).
[server]
name = "commitgate-bench"
[ledger]
synchronous = "FULL"
[tools.noop]
class = "safe-retry"
python = "commitgate.server.bench.tools:noop"
retry = { attempts = 1 }
[tools.noop_keyed]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
retry = { attempts = 1 }
[tools.noop_keyed_unchecked]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
retry = { attempts = 1 }
duplicates = false
"""
# The guarded server as a team runs it with evidence: receipts (on by default) and a webhook; and the
# same without either, to measure what they add. (The no-op raises no event, so the outbox costs its
# check per change; the webhook is never called.)
EVIDENCE_POLICY = (
    OVERHEAD_POLICY
    + """
[[notify]]
url = "http://127.0.0.1:9/never-called"
events = ["approval_waiting", "approval_expired", "unknown", "reconciled"]
secret = "${COMMITGATE_BENCH_HOOK_SECRET}"
"""
)
NO_EVIDENCE_POLICY = OVERHEAD_POLICY + "\n[receipts]\nenabled = false\n"
# The same servers with no fsync per commit: what the guard costs in software alone.
NO_FSYNC_POLICY = OVERHEAD_POLICY.replace('synchronous = "FULL"', 'synchronous = "NORMAL"')

# --- the disk: what durability costs at the least ---------------------------------------------------------

# The frames a claim of a new key writes to the ledger's WAL when no page splits: the row, its five
# indexes and the audit entry (tests/test_sqlite_write_path.py counts them).
CLAIM_PAGES = 7
_RESULT_JSON = '{"ok":true}'


def commit_sync_us(directory: Path, samples: int = 400, warm_up: int = 100) -> float:
    """What durability adds to one SQLite commit in `directory`: synchronous=FULL minus NORMAL.

    Two WAL databases shaped like the ledger (a row, a unique index, a second index),
    committed in turn so that both see the same disk; the difference of the median
    commits is the sync a durable claim or outcome waits for. Two per guarded call
    bound the guarded call's cost from below whatever the software does. The warm-up commits grow the WAL;
    later ones reuse it, as a ledger's do.
    """
    timings: dict[str, list[float]] = {"FULL": [], "NORMAL": []}
    conns: dict[str, sqlite3.Connection] = {}
    try:
        for mode in timings:
            path = directory / f".commit-probe-{mode}-{uuid.uuid4().hex}.db"
            conn = conns[mode] = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {mode}")
            conn.execute("CREATE TABLE ops (id TEXT PRIMARY KEY, k TEXT NOT NULL UNIQUE, at REAL, body TEXT)")
            conn.execute("CREATE INDEX ops_at ON ops (at)")
        for i in range(warm_up + samples):
            for mode, conn in conns.items():
                start = time.perf_counter()
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(
                    "INSERT INTO ops VALUES (?, ?, ?, ?)", (uuid.uuid4().hex, f"k{i}", start, "x" * 300)
                )
                conn.execute("COMMIT")
                if i >= warm_up:
                    timings[mode].append(time.perf_counter() - start)
    finally:
        for conn in conns.values():
            conn.close()
        for probe in directory.glob(".commit-probe-*"):
            probe.unlink(missing_ok=True)
    full, normal = (statistics.median(timings[mode]) for mode in ("FULL", "NORMAL"))
    return round(max(0.0, full - normal) * 1e6, 1)


class LeastClaim:
    """The least software a SQLite claim and its outcome need, in the measuring process: stdlib
    `sqlite3`, WAL, synchronous = NORMAL (no sync), `INSERT … ON CONFLICT DO NOTHING` + `COMMIT`,
    then `UPDATE` + `COMMIT`. Timed in the overhead rounds beside the calls; the guard's software
    (guarded minus unguarded on a ledger that does not sync) is reported in units of it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f".least-claim-{uuid.uuid4().hex}.db"
        self._conn = sqlite3.connect(self.path, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.execute("CREATE TABLE ops (k TEXT PRIMARY KEY, state TEXT NOT NULL, result TEXT)")
        self._next = 0
        self.samples: list[list[float]] = []  # µs, one list per round

    def sample(self) -> float:
        key = f"k{self._next}"
        self._next += 1
        start = time.perf_counter_ns()
        execute = self._conn.execute
        execute("BEGIN")
        execute("INSERT INTO ops VALUES (?, 'RUNNING', NULL) ON CONFLICT DO NOTHING", (key,))
        execute("COMMIT")
        execute("BEGIN")
        execute("UPDATE ops SET state = 'SUCCEEDED', result = ? WHERE k = ?", (_RESULT_JSON, key))
        execute("COMMIT")
        return (time.perf_counter_ns() - start) / 1000.0

    def close(self) -> None:
        self._conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)


class DiskFloor:
    """The least a durable write can cost on this filesystem: overwrite one 4 KiB frame of a
    preallocated file and fdatasync it, as a WAL commit at its least does. Timed inside the
    overhead rounds, beside the calls, so that a busy disk or CPU weighs on both alike.

    With `pages`, each sample overwrites that many consecutive frames before its sync, as a
    commit that touched that many B-tree pages does: a sync costs more the more it carries."""

    FRAME = 4096
    FRAMES = 64

    def __init__(self, directory: Path, pages: int = 1) -> None:
        self.pages = pages
        self.path = directory / f".disk-floor-{uuid.uuid4().hex}"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        os.write(self._fd, os.urandom(self.FRAME * self.FRAMES))  # allocated, so no sync grows the file
        os.fsync(self._fd)
        self._frame = os.urandom(self.FRAME)
        self._next = 0
        self.samples: list[list[float]] = []  # µs, one list per round

    def sample(self) -> float:
        start = time.perf_counter_ns()
        for _ in range(self.pages):
            os.pwrite(self._fd, self._frame, (self._next % self.FRAMES) * self.FRAME)
            self._next += 1
        getattr(os, "fdatasync", os.fsync)(self._fd)
        return (time.perf_counter_ns() - start) / 1000.0

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


class Probe(Protocol):
    """Something timed in the rounds beside the calls that touches no server."""

    samples: list[list[float]]

    def sample(self) -> float: ...


async def settle(directory: Path, quiet: float = 0.5, limit: float = 10.0) -> None:
    """Wait until no file in `directory` has changed for `quiet` seconds (at most `limit`): the
    servers' checkpoints and deferred syncs are done, and a sync timed now has the disk alone."""

    def state() -> list[tuple[str, int, int]]:
        files = []
        for path in directory.iterdir():
            with contextlib.suppress(OSError):  # a file removed meanwhile
                st = path.stat()
                files.append((path.name, st.st_size, st.st_mtime_ns))
        return sorted(files)

    deadline, last, since = time.monotonic() + limit, state(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        await asyncio.sleep(0.05)
        if (now := state()) != last:
            last, since = now, time.monotonic()


def idle_floors(directory: Path, blocks: int, per_block: int) -> tuple[list[list[float]], list[list[float]]]:
    """The disk floor and the claim's floor, each timed `blocks` times `per_block` samples in a block
    of its own while nothing else writes (alternating block by block, so that both see the same disk)."""
    floors = DiskFloor(directory), DiskFloor(directory, pages=CLAIM_PAGES)
    try:
        for _ in range(blocks):
            for floor in floors:
                floor.samples.append([floor.sample() for _ in range(per_block)])
    finally:
        for floor in floors:
            floor.close()
    return floors[0].samples, floors[1].samples


# --- overhead: guarded, replayed and plain-SDK calls ---------------------------------------------------------------------------------


@dataclass
class _Variant:
    name: str
    client: Client
    tool: str
    arguments: Callable[[int, int], dict[str, Any]]
    replayed: bool | None  # what _meta must say (None: no operation block expected)
    samples: list[list[float]] = field(default_factory=list)  # µs, one list per round


async def _timed(variant: _Variant, round_no: int, i: int) -> float:
    arguments = variant.arguments(round_no, i)
    start = time.perf_counter_ns()
    result = await variant.client.call_tool(variant.tool, arguments)
    elapsed = (time.perf_counter_ns() - start) / 1000.0
    if result.is_error:
        raise BenchError(f"{variant.name}: {result.content}")
    if variant.replayed is not None and operation_of(result).get("replayed") is not variant.replayed:
        raise BenchError(f"{variant.name}: expected replayed={variant.replayed}, got {result.meta}")
    return elapsed


async def overhead(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("cost per call", scale.rounds)
    ledger = bench.ledger("overhead")
    claim_only = OVERHEAD_POLICY.replace('synchronous = "FULL"', 'synchronous = "FULL"\ndurability = "claim"')
    policy, claim_policy = (
        bench.policy("overhead", OVERHEAD_POLICY),
        bench.policy("overhead-claim", claim_only),
    )
    no_fsync_policy = bench.policy("overhead-normal", NO_FSYNC_POLICY)
    evidence_policy = bench.policy("overhead-evidence", EVIDENCE_POLICY)
    hook = {"COMMITGATE_BENCH_HOOK_SECRET": uuid.uuid4().hex}
    # A server of its own for each variant: every process then waits as long between its calls (its
    # caches as cold) as every other. A server answering four variants was called four times as often
    # as one answering one, and measured several hundred µs faster per call for that alone.
    servers = {
        "unguarded": bench.serve(policy, bench.ledger("overhead-unguarded")),
        "guarded": bench.serve(evidence_policy, ledger, env=hook),
        "guarded_no_evidence": bench.serve(
            bench.policy("overhead-no-evidence", NO_EVIDENCE_POLICY), bench.ledger("overhead-no-evidence")
        ),
        "guarded_no_detection": bench.serve(policy, bench.ledger("overhead-no-detection")),
        "replay": bench.serve(policy, bench.ledger("overhead-replay")),
        "plain_sdk": bench.plain(),
        "guarded_no_fsync": bench.serve(no_fsync_policy, bench.ledger("overhead-normal")),
        "guarded_claim_durability": bench.serve(claim_policy, bench.ledger("overhead-claim")),
        "unguarded_sdk_stdio": bench.serve(policy, bench.ledger("overhead-sdk-stdio-unguarded"), stdio="sdk"),
        "guarded_sdk_stdio": bench.serve(policy, bench.ledger("overhead-sdk-stdio"), stdio="sdk"),
    }
    async with bench.connect_all(servers) as clients:
        variants = _overhead_variants(clients, scale.warm_up_calls)
        for variant in variants:  # warm every path up; the replays' keys are among these
            for i in range(scale.warm_up_calls):
                await variant.client.call_tool(variant.tool, variant.arguments(-1, i))
        load_floor, least = DiskFloor(bench.root), LeastClaim(bench.root)
        try:
            for round_no in range(scale.rounds):
                await _round(variants, round_no, scale.calls_per_round, [load_floor, least])
                tick(1)
        finally:
            load_floor.close()
            least.close()
        # The servers stay up but idle: once their background writes have settled, the disk is ours.
        await settle(bench.root, quiet=scale.quiet_s)
        floor, claim_floor = idle_floors(bench.root, scale.rounds, scale.calls_per_round)
    by_name = {variant.name: variant for variant in variants}
    bench.raw["overhead_us"] = {name: [s for r in v.samples for s in r] for name, v in by_name.items()}
    sync_us = commit_sync_us(bench.root, scale.sync_samples, warm_up=scale.sync_samples // 4)
    unguarded = statistics.median(bench.raw["overhead_us"]["unguarded"])
    floor_us = statistics.median(s for r in floor for s in r)

    def ratio(top: str, bottom: str) -> dict[str, float]:
        return _paired(by_name[top], by_name[bottom])

    return {
        "rounds": scale.rounds,
        "calls_per_round": scale.calls_per_round,
        "interleaving": "one call of each variant in turn, in a fresh random order each time; ratios paired per round",
        "per_call_us": {
            name: spread([statistics.median(r) for r in v.samples], 1) for name, v in by_name.items()
        },
        "least_claim_us": spread([statistics.median(r) for r in least.samples], 1),
        "ratios": {
            "guarded_over_unguarded": ratio("guarded", "unguarded"),
            "replay_over_unguarded": ratio("replay", "unguarded"),
            "guarded_over_plain_sdk": ratio("guarded", "plain_sdk"),
            "sdk_stdio_guarded_over_unguarded": ratio("guarded_sdk_stdio", "unguarded_sdk_stdio"),
            "sdk_stdio_guarded_over_plain_sdk": ratio("guarded_sdk_stdio", "plain_sdk"),
            "unguarded_over_plain_sdk": ratio("unguarded", "plain_sdk"),
            "sdk_stdio_unguarded_over_unguarded": ratio("unguarded_sdk_stdio", "unguarded"),
            "guarded_no_fsync_over_unguarded": ratio("guarded_no_fsync", "unguarded"),
            "guarded_over_guarded_no_detection": ratio("guarded", "guarded_no_detection"),
            "guarded_over_guarded_no_evidence": ratio("guarded", "guarded_no_evidence"),
            "claim_durability_over_unguarded": ratio("guarded_claim_durability", "unguarded"),
            "claim_durability_over_plain_sdk": ratio("guarded_claim_durability", "plain_sdk"),
        },
        "guard_software_over_least": guard_software_over_least(by_name, least),
        "disk_floor_us": spread([statistics.median(r) for r in floor], 1),
        "disk_floor_claim_pages": CLAIM_PAGES,
        "disk_floor_claim_us": spread([statistics.median(r) for r in claim_floor], 1),
        "sync_under_load_us": spread([statistics.median(r) for r in load_floor.samples], 1),
        "overhead_over_floor": {
            "full": _over_floor(by_name["guarded"], by_name["unguarded"], floor_us),
            "claim": _over_floor(by_name["guarded_claim_durability"], by_name["unguarded"], floor_us),
        },
        "variants": {
            "unguarded, guarded, replay": "commitgate serve as users get it (the lean stdio transport)",
            "guarded": "with receipts and a [[notify]] webhook; guarded_no_evidence: [receipts] enabled = false,"
            " no webhook",
            "guarded_no_fsync": "the guarded call on a ledger with synchronous=NORMAL (no fsync per commit)",
            "guarded_claim_durability": 'the guarded call with [ledger] durability = "claim" (one sync per call)',
            "disk_floor": "overwrite a 4 KiB frame of a preallocated file + fdatasync, in the ledgers' directory, "
            "timed after the rounds with every server idle",
            "sync_under_load": "the same sync timed between the calls of the rounds, beside the servers' "
            "background writes",
            "least_claim": "stdlib sqlite3 in the measuring process, WAL, synchronous = NORMAL: "
            "INSERT … ON CONFLICT DO NOTHING + COMMIT, then UPDATE + COMMIT",
            "disk_floor_claim": f"the same with {CLAIM_PAGES} frames before the sync: the pages a new key's claim writes",
            "*_sdk_stdio": "the same server on the MCP SDK's stdio transport (commitgate serve --stdio sdk)",
        },
        "commit_sync_us": sync_us,
        "guarded_over_unguarded_floor": round(1 + 2 * sync_us / unguarded, 3),
        "syncs_in_server": _syncs_in_server(by_name),
        "duplicate_lookup": _duplicate_lookup(by_name),
        "receipts_and_outbox": _added_to_guarded(by_name, without="guarded_no_evidence"),
        "ledger_bytes_per_operation": _bytes_per_operation(ledger),
    }


def keyed_arguments(prefix: str) -> Callable[[int, int], dict[str, Any]]:
    """A guarded variant's arguments for call `i` of round `r`: a new key under `prefix` each time."""

    def new_key(r: int, i: int) -> dict[str, Any]:
        # arguments of their own too: the same ones under a new key would be a possible duplicate
        return {"n": (r + 2) * 1_000_000 + i, "idempotency_key": f"{prefix}-{r}-{i}"}

    return new_key


def _overhead_variants(clients: dict[str, Client], replay_keys: int) -> list[_Variant]:
    """The same no-op ten ways; only the guarded ones carry a key (a new one, or one of the first
    `replay_keys` already seen)."""
    run = uuid.uuid4().hex[:8]
    new_key = keyed_arguments(run)

    def other_new_key(r: int, i: int) -> dict[str, Any]:  # another tool: keys of its own
        return {**new_key(r, i), "idempotency_key": f"{run}-unchecked-{r}-{i}"}

    def seen_key(r: int, i: int) -> dict[str, Any]:
        return new_key(-1, i % replay_keys)  # a call its server's warm-up made

    def bare(r: int, i: int) -> dict[str, Any]:
        return {"n": i}

    return [
        _Variant("unguarded", clients["unguarded"], "noop", bare, None),
        _Variant("guarded", clients["guarded"], "noop_keyed", new_key, False),
        _Variant(
            "guarded_no_detection",
            clients["guarded_no_detection"],
            "noop_keyed_unchecked",
            other_new_key,
            False,
        ),
        _Variant("guarded_no_evidence", clients["guarded_no_evidence"], "noop_keyed", new_key, False),
        _Variant("replay", clients["replay"], "noop_keyed", seen_key, True),
        _Variant("plain_sdk", clients["plain_sdk"], "noop", bare, None),
        _Variant("guarded_no_fsync", clients["guarded_no_fsync"], "noop_keyed", new_key, False),
        _Variant(
            "guarded_claim_durability", clients["guarded_claim_durability"], "noop_keyed", new_key, False
        ),
        _Variant("unguarded_sdk_stdio", clients["unguarded_sdk_stdio"], "noop", bare, None),
        _Variant("guarded_sdk_stdio", clients["guarded_sdk_stdio"], "noop_keyed", new_key, False),
    ]


async def _round(
    variants: list[_Variant], round_no: int, calls: int, probes: list[Probe] | None = None
) -> None:
    order: list[_Variant | Probe] = [*variants, *(probes or [])]
    for item in order:
        item.samples.append([])
    last: Client | None = None
    for i in range(calls):
        # A fresh order each time: a fixed cycle always hands the same variant's call to the server
        # just after the same other one ran (caches and wake-ups cold in the same way), which biased the ratios.
        last = shuffle_apart(order, last)
        for item in order:
            if isinstance(item, _Variant):
                item.samples[-1].append(await _timed(item, round_no, i))
            else:
                item.samples[-1].append(item.sample())


def shuffle_apart(order: list[_Variant | Probe], last: Client | None, tries: int = 1000) -> Client | None:
    """Shuffle `order` so that no call goes to the server the call before it went to (`last` ends
    the previous order); return the server of its last call.

    A call right after one to the same server finds that process awake and its caches warm: about
    40 µs faster on this project's 2-core VM. Each variant has a server of its own, so only the
    turn from one order to the next could do that. Probes touch no server."""
    for _ in range(tries):
        random.shuffle(order)
        servers = [last, *(item.client for item in order if isinstance(item, _Variant))]
        if all(a is not b for a, b in itertools.pairwise(servers)):
            break
    calls = [item.client for item in order if isinstance(item, _Variant)]
    return calls[-1] if calls else last


def _paired(top: _Variant, bottom: _Variant) -> dict[str, float]:
    ratios = [
        statistics.median(a) / statistics.median(b) for a, b in zip(top.samples, bottom.samples, strict=True)
    ]
    return spread(ratios)


def _over_floor(guarded: _Variant, unguarded: _Variant, floor_us: float) -> dict[str, float]:
    """What the guard adds to a call, in units of what durability needs: (guarded - unguarded) ÷
    (2 × the idle disk floor), per round. 1.0 would be a guard whose only cost is its two syncs."""
    rounds = zip(guarded.samples, unguarded.samples, strict=True)
    return spread([(statistics.median(g) - statistics.median(u)) / (2 * floor_us) for g, u in rounds])


def guard_software_over_least(by_name: dict[str, _Variant], least: LeastClaim) -> dict[str, float]:
    """The guard's software in units of the least a SQLite claim and outcome need: (guarded minus
    unguarded, both on servers whose ledgers do not sync) ÷ `LeastClaim`, per round."""
    rounds = zip(
        by_name["guarded_no_fsync"].samples, by_name["unguarded"].samples, least.samples, strict=True
    )
    return spread(
        [(statistics.median(g) - statistics.median(u)) / statistics.median(s) for g, u, s in rounds]
    )


def _syncs_in_server(by_name: dict[str, _Variant]) -> dict[str, dict[str, float]]:
    """What the two durable commits cost a guarded call in a server: guarded minus the same call on a
    ledger without syncs, per round, in µs and as a share of the unguarded call (what they add to the guarded call's ratio)."""
    return _added_to_guarded(by_name, without="guarded_no_fsync")


def _duplicate_lookup(by_name: dict[str, _Variant]) -> dict[str, dict[str, float]]:
    """What duplicate detection (one indexed lookup in the claim, one more index entry) adds to a
    guarded call: guarded minus the same tool with `duplicates = false`, per round."""
    return _added_to_guarded(by_name, without="guarded_no_detection")


def _added_to_guarded(by_name: dict[str, _Variant], *, without: str) -> dict[str, dict[str, float]]:
    """Guarded minus the variant `without` one part of the guard, per round: in µs, and as a share
    of the unguarded call (what that part adds to guarded ÷ unguarded)."""
    rounds = zip(
        by_name["guarded"].samples,
        by_name[without].samples,
        by_name["unguarded"].samples,
        strict=True,
    )
    added = [(statistics.median(g), statistics.median(n), statistics.median(u)) for g, n, u in rounds]
    return {
        "us_per_call": spread([g - n for g, n, _ in added], 1),
        "added_to_guarded_ratio": spread([(g - n) / u for g, n, u in added]),
    }


def _bytes_per_operation(ledger: Path) -> float | None:
    """File bytes (database + WAL) per operation of a ledger written by real guarded calls."""
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as conn:
        operations = conn.execute("SELECT count(*) FROM operations").fetchone()[0]
    size = sum(p.stat().st_size for p in (ledger, Path(f"{ledger}-wal")) if p.exists())
    return round(size / operations, 1) if operations else None
