"""What a call costs the disk: WAL pages and syncs per call, counted by strace on a real server; and
`counted()`, strace attached for a while to a running server, its system calls counted by kind.

    python -m commitgate.server.bench.syscalls [--calls N] [--durability full|claim] [--json]

Starts `commitgate serve` (the bench's overhead policy, a fresh SQLite ledger) under
`strace -f`, calls it over stdio with an MCP client, one call at a time, and splits the
server's system calls at each `tools/call` request it reads. For each call: the frames it
wrote to the ledger's WAL (one `pwrite64` of a page each) before its first WAL sync (the
claim) and after it (the outcome), its syncs of the WAL, and the checkpoints' page writes
and syncs of the database file that fell inside it. Three kinds of call: a guarded call with
a new key, a replay of a key already answered, and the same tool unguarded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from commitgate.server.bench.overhead import OVERHEAD_POLICY, keyed_arguments

PAGE = 4096  # the ledger's page size (SQLite's default)
# strace -y names each descriptor's file: `pwrite64(5</tmp/x/ledger.db-wal>, "…", 4096, 8192) = 4096`
_LINE = re.compile(r"^\d+\s+(?P<call>\w+)\((?P<fd>\d+)(?:<(?P<path>[^>]*)>)?(?P<rest>.*)$")
_MARK = '\\"tools/call\\"'  # a request as strace quotes the bytes read
_UNFINISHED, _RESUMED = (
    re.compile(r"^(\d+)\s+(.*) <unfinished \.\.\.>$"),
    re.compile(r"^(\d+)\s+<\.\.\. \w+ resumed>(.*)$"),  # strace pads the pid with spaces
)


def joined(lines: list[str]) -> list[str]:
    """strace's lines with each call another thread interrupted joined back into one line, placed
    where it started (a request read before the writes it caused, even if logged after them)."""
    pending: dict[str, int] = {}
    out: list[str] = []
    for line in lines:
        if match := _UNFINISHED.match(line):
            pending[match[1]] = len(out)
            out.append(f"{match[1]} {match[2]}")
        elif (match := _RESUMED.match(line)) and match[1] in pending:
            out[pending.pop(match[1])] += match[2]
        else:
            out.append(line)
    return out


@dataclass(frozen=True, slots=True)
class CallIO:
    """One call's disk work, as the server's system calls show it."""

    claim_pages: int  # WAL frames written up to the first WAL sync after one
    outcome_pages: int  # WAL frames after it
    wal_syncs: int
    checkpoint_pages: int  # pages copied back into the database file
    db_syncs: int


def split_calls(lines: list[str], ledger: Path) -> list[CallIO]:
    """The strace log cut at each `tools/call` the server read, one `CallIO` per call."""
    wal, db = f"{ledger}-wal", str(ledger)
    calls: list[list[str]] = []
    for line in joined(lines):
        match = _LINE.match(line)
        if match is None:
            continue
        if match["call"] == "read" and _MARK in match["rest"]:
            calls.append([])
        elif calls and match["call"] in ("pwrite64", "fdatasync", "fsync"):
            path = match["path"] or ""
            if path == wal:
                calls[-1].append("wal-sync" if match["call"] != "pwrite64" else _page(match["rest"], "wal"))
            elif path == db:
                calls[-1].append("db-sync" if match["call"] != "pwrite64" else _page(match["rest"], "db"))
    return [_count(events) for events in calls]


def _page(rest: str, file: str) -> str:
    """A frame's page (a write of a whole page), or its 24-byte header (not counted)."""
    return f"{file}-page" if rest.rstrip().endswith(f"= {PAGE}") else f"{file}-other"


def _count(events: list[str]) -> CallIO:
    # the claim's commit ends at the first WAL sync after a frame (a checkpoint syncs the WAL too)
    first_page = events.index("wal-page") if "wal-page" in events else len(events)
    rest = events[first_page:]
    first_sync = first_page + (rest.index("wal-sync") + 1 if "wal-sync" in rest else len(rest))
    return CallIO(
        claim_pages=events[:first_sync].count("wal-page"),
        outcome_pages=events[first_sync:].count("wal-page"),
        wal_syncs=events.count("wal-sync"),
        checkpoint_pages=events.count("db-page"),
        db_syncs=events.count("db-sync"),
    )


# The kinds of system call a served call is made of, by strace's names.
KINDS = {
    "disk_syncs": ("fdatasync", "fsync"),
    "reads": ("read", "recvfrom", "recvmsg", "readv", "pread64"),
    "writes": ("write", "sendto", "sendmsg", "writev", "pwrite64"),
    "epoll_waits": ("epoll_wait", "epoll_pwait", "epoll_pwait2"),
    "futex": ("futex",),  # a thread woken or waiting for a lock (the interpreter's among them)
}
ATTACH_TIMEOUT = 5.0


def summary_counts(text: str) -> dict[str, int]:
    """Calls by system call from `strace -c`'s table (% time, seconds, usecs/call, calls, [errors,] name)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[-1] != "total" and fields[3].isdigit() and fields[0][0].isdigit():
            counts[fields[-1]] = int(fields[3])
    return counts


def per_call(counts: dict[str, int], calls: int) -> dict[str, float]:
    """Each kind's system calls per served call, and all of them."""
    out = {
        kind: round(sum(counts.get(name, 0) for name in names) / max(1, calls), 2)
        for kind, names in KINDS.items()
    }
    return {**out, "all": round(sum(counts.values()) / max(1, calls), 2)}


def _traced(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(line.split()[1:] != ["0"] for line in status.splitlines() if line.startswith("TracerPid:"))


@contextmanager
def counted(pid: int, out: Path) -> Iterator[Path]:
    """`strace -c -f` attached to process `pid` while the block runs; its table is in the file yielded
    once the block ends. Raises OSError when strace is missing or may not attach (ptrace is refused
    to a process that is not an ancestor of the server, unless run as root)."""
    strace = shutil.which("strace")
    if strace is None:
        raise OSError("strace is not installed")
    with open(out.with_suffix(".err"), "wb") as errors:
        proc = subprocess.Popen(
            [strace, "-c", "-f", "-q", "-o", str(out), "-p", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )
    try:
        deadline = time.monotonic() + ATTACH_TIMEOUT
        while not _traced(pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                reason = out.with_suffix(".err").read_text(errors="replace").strip().splitlines()
                raise OSError(reason[-1] if reason else "strace did not attach")
            time.sleep(0.02)
        yield out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # detach and write the table
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def count_calls(calls: int = 200, durability: str = "full") -> dict[str, Any]:
    """Serve under strace, make `calls` calls of each kind (interleaved), and count their disk work."""
    strace = shutil.which("strace")
    if strace is None:
        raise SystemExit("strace is not installed: install it (apt-get install strace) and run this again")
    with tempfile.TemporaryDirectory(prefix="commitgate-syscalls-") as tmp:
        root = Path(tmp)
        policy = OVERHEAD_POLICY
        if durability == "claim":
            policy = policy.replace('synchronous = "FULL"', 'synchronous = "FULL"\ndurability = "claim"')
        (root / "policy.toml").write_text(policy)
        ledger, log = root / "ledger.db", root / "strace.log"
        serve = [sys.executable, "-m", "commitgate.server.cli", "serve", "--ledger", f"sqlite:///{ledger}"]
        trace = ["-f", "-y", "-qq", "-s", "256", "-e", "trace=read,pwrite64,fdatasync,fsync", "-o", str(log)]
        params = StdioServerParameters(
            command=strace, args=[*trace, *serve, "--policy", str(root / "policy.toml")]
        )
        new_key, seen = keyed_arguments(uuid.uuid4().hex[:8]), keyed_arguments("seen")
        kinds: list[str] = []
        with open(os.devnull, "w") as quiet:
            async with Client(stdio_client(params, errlog=quiet), read_timeout_seconds=60) as client:
                await _call(client, kinds, "warm-up", "noop_keyed", seen(-1, 0))
                for i in range(calls):
                    await _call(client, kinds, "guarded", "noop_keyed", new_key(0, i))
                    await _call(client, kinds, "replay", "noop_keyed", seen(-1, 0))
                    await _call(client, kinds, "unguarded", "noop", {"n": i})
        measured = split_calls(log.read_text().splitlines(), ledger)
    if len(measured) != len(kinds):
        raise SystemExit(f"expected {len(kinds)} calls in the trace, found {len(measured)}")
    by_kind: dict[str, list[CallIO]] = {}
    for kind, io in zip(kinds, measured, strict=True):
        by_kind.setdefault(kind, []).append(io)
    return {
        "calls_per_kind": calls,
        "durability": durability,
        "page_bytes": PAGE,
        "per_call": {kind: _summary(ios) for kind, ios in by_kind.items() if kind != "warm-up"},
    }


async def _call(client: Client, kinds: list[str], kind: str, tool: str, arguments: dict[str, Any]) -> None:
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise SystemExit(f"{kind} call failed: {result.content}")
    kinds.append(kind)


def _summary(ios: list[CallIO]) -> dict[str, Any]:
    """Means per call, and how often each claim size occurred (a page split writes more)."""
    fields = asdict(ios[0]).keys()
    means = {name: round(statistics.fmean(getattr(io, name) for io in ios), 2) for name in fields}
    return {**means, "claim_pages_seen": dict(sorted(Counter(io.claim_pages for io in ios).items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.syscalls", description=__doc__)
    parser.add_argument("--calls", type=int, default=200, help="calls of each kind")
    parser.add_argument("--durability", default="full", choices=["full", "claim"])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = asyncio.run(count_calls(args.calls, args.durability))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"per call, means of {args.calls} (durability = {args.durability!r}, {PAGE}-byte pages):")
    for kind, row in figures["per_call"].items():
        print(
            f"  {kind:<10} claim {row['claim_pages']:>5} pages  outcome {row['outcome_pages']:>5} pages  "
            f"WAL syncs {row['wal_syncs']:>5}  checkpoint {row['checkpoint_pages']:>5} pages, "
            f"{row['db_syncs']:>4} syncs  (claims by pages: {row['claim_pages_seen']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
