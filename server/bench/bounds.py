"""What bounds a figure of the load section, in words built from the figures measured.

`level_bound` reads one concurrency's figures: by how much the guarded server missed the plain
server's throughput and tail, and which process or thread held the CPU meanwhile. `untimed_reading`
reads the untimed block after the rounds: the two servers' profiles by room and their system calls
per call. Both are pure functions of the bench's JSON, so the reading is tested on sample figures.
"""

from __future__ import annotations

from typing import Any

from commitgate.server.bench.procstat import EVENT_LOOP, OTHER, THREAD_ROLES
from commitgate.server.bench.profile import ROOMS

BUSY = 0.8  # cores: a process or thread this busy is what its figure waits for
IDLE = 0.5  # cores: below this in both processes, the calls mostly waited
FULL = 0.85  # share of the machine's cores: busier than this, the machine's CPU is what everyone waits for
SHOWN_SHARE = 0.05  # rooms below this share of a profile are left out of the sentence
SYSCALL_WORDS = {
    "disk_syncs": "disk syncs",
    "reads": "reads",
    "writes": "writes",
    "epoll_waits": "epoll waits",
    "futex": "futex calls",
}


def level_bound(level: dict[str, Any], cpus: int | None) -> str:
    """One concurrency in a sentence: the miss, and the process or thread that bounds it."""
    plain, guarded = level["per_server"]["plain_sdk"], level["per_server"]["guarded"]
    ratio = level["guarded_over_plain"]["median"]
    parts = [
        f"at {level['sessions']} sessions the guarded server made {ratio:.2f} × the plain server's calls per second"
    ]
    if ratio < 1.0:
        parts[0] += (
            f" ({1 - ratio:.0%} short: {guarded.get('calls_per_s', 0):.0f} against {plain.get('calls_per_s', 0):.0f})"
        )
    if guarded["p99_ms"] > plain["p99_ms"] > 0:
        parts.append(
            f"its p99 was {guarded['p99_ms']:.1f} ms against {plain['p99_ms']:.1f} ms "
            f"({guarded['p99_ms'] / plain['p99_ms'] - 1:.0%} longer)"
        )
    if "server_cpu_us_per_call" in guarded:
        parts.append(
            f"it used {guarded['server_cpu_us_per_call']:.0f} µs of CPU per call against the plain server's "
            f"{plain['server_cpu_us_per_call']:.0f} µs, with {guarded.get('context_switches_per_call', 0):.1f} "
            f"context switches per call against {plain.get('context_switches_per_call', 0):.1f}"
        )
        parts.append(bounded_by(guarded, cpus))
    return "; ".join(parts) + "."


def bounded_by(guarded: dict[str, Any], cpus: int | None) -> str:
    """Which process or thread bounds the guarded server's figure, from the cores each kept busy and
    the cores the whole machine kept busy meanwhile."""
    server, client = guarded["server_cpu_cores"], guarded["client_cpu_cores"]
    machine = guarded.get("machine_cpu_cores", server + client)
    threads = guarded.get("thread_cpu_cores", {})
    loop = threads.get(EVENT_LOOP, server)
    split = ", ".join(f"{role} {threads.get(role, 0.0):.2f}" for role in THREAD_ROLES if role in threads)
    held = (
        f"the server kept {server:.2f} cores busy"
        + (f" ({split})" if split else "")
        + f", the client {client:.2f}"
    )
    if cpus and machine >= FULL * cpus:
        if server + client >= FULL * cpus:
            return f"{held}: together they filled the machine's {cpus} cores, so the CPU of both bounds it"
        return (
            f"{held}, and other processes {machine - server - client:.2f}: the machine's {cpus} cores were "
            "full, so its other work bounds this figure, not the server"
        )
    if loop >= BUSY:
        return f"{held}: the event loop's thread is near a whole core, so the server's Python on it bounds it"
    if client >= BUSY and client >= server:
        return f"{held}: the client is the busier process, so the client bounds it as much as the server"
    if max(server, client) < IDLE:
        return (
            f"{held}, with cores to spare: neither process kept half a core busy, so the calls mostly "
            "waited, for the disk's syncs and the hand-offs between threads"
        )
    writer = threads.get("ledger writer", 0.0)
    return (
        f"{held}: no one thread is near a whole core; the event loop and the ledger writer"
        f"{' (the busier of the two)' if writer > loop else ''} take turns under one interpreter lock, "
        "so together they bound it"
    )


def untimed_reading(bounds: dict[str, Any]) -> str:
    """The untimed block in a sentence or two: where each server's Python time went, and its syscalls."""
    if not bounds:
        return ""
    profile, syscalls = bounds.get("profile", {}), bounds.get("syscalls_per_call", {})
    words = [f"Measured untimed at {bounds['sessions']} sessions"]
    if "note" in profile:
        words.append(f"{profile['note']}")
    elif {"plain_sdk", "guarded"} <= profile.keys():
        words.append(
            "of the guarded server's time holding the interpreter lock (py-spy), "
            f"{rooms_text(profile['guarded'])}; of the plain server's, {rooms_text(profile['plain_sdk'])}"
        )
    if "note" in syscalls:
        words.append(f"{syscalls['note']}")
    elif {"plain_sdk", "guarded"} <= syscalls.keys():
        words.append(
            f"per call the guarded server made {syscalls_text(syscalls['guarded'])} (strace), the plain server "
            f"{syscalls_text(syscalls['plain_sdk'])}"
        )
    return words[0] + ": " + "; ".join(words[1:]) + "." if len(words) > 1 else ""


def rooms_text(figures: dict[str, Any]) -> str:
    """The rooms of one profile, largest share first, those under 5 % left out."""
    rooms = sorted(figures.get("rooms", {}).items(), key=lambda item: -item[1])
    shown = [f"{share:.0%} {ROOMS[room].split(' (')[0]}" for room, share in rooms if share >= SHOWN_SHARE]
    return ", ".join(shown) + f" ({figures.get('samples', 0)} samples)"


def syscalls_text(per_call: dict[str, float]) -> str:
    return ", ".join(f"{per_call.get(kind, 0.0):.1f} {words}" for kind, words in SYSCALL_WORDS.items())


def thread_text(figures: dict[str, Any]) -> str:
    """A server's cores busy by thread, the roles it has (a plain server has no ledger threads)."""
    threads = figures.get("thread_cpu_cores", {})
    shown = [role for role in THREAD_ROLES if role in (EVENT_LOOP, OTHER) or threads.get(role)]
    return ", ".join(f"{role} {threads.get(role, 0.0):.2f}" for role in shown)
