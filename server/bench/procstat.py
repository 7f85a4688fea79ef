"""What a server process did while the bench called it, read from /proc: CPU by thread, context
switches and read/write system calls.

Each thread's CPU time is in /proc/PID/task/TID/stat and its OS-level name in .../comm (commitgate's
threads name themselves, see commitgate.server.ledger.threads). A thread that ended between two
readings takes its CPU time with it; the bench's servers keep theirs for the whole run.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commitgate.server.ledger.threads import os_thread_name

# What each of a server's threads is, by its OS-level name; the process's first thread runs the event loop.
EVENT_LOOP = "event loop"
OTHER = "other threads"
ROLES = {
    os_thread_name("commitgate-ledger-writer"): "ledger writer",
    os_thread_name("commitgate-ledger-checkpoint"): "checkpointer",
}
THREAD_ROLES = (EVENT_LOOP, *ROLES.values(), OTHER)


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of a process: CPU seconds by thread role, and counters since it started."""

    cpu_by_role: dict[str, float] = field(default_factory=dict)
    context_switches: int = 0  # voluntary and involuntary, all threads
    read_syscalls: int = 0  # read(2) and its kin: syscr of /proc/PID/io
    write_syscalls: int = 0  # write(2) and its kin: syscw
    machine_busy_s: float = 0.0  # every process's CPU time on every core (and the host's steal)


def role_of(pid: int, tid: int, name: str) -> str:
    return EVENT_LOOP if tid == pid else ROLES.get(name, OTHER)


def sample(pid: int) -> Sample:
    """A reading of `pid` now; what cannot be read counts as nothing (the process has gone)."""
    cpu: dict[str, float] = dict.fromkeys(THREAD_ROLES, 0.0)
    switches = 0
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                role = role_of(pid, int(task.name), (task / "comm").read_text().strip())
                cpu[role] += (int(fields[11]) + int(fields[12])) / tick
                switches += _context_switches((task / "status").read_text())
    io = _io_counters(pid)
    return Sample(cpu, switches, io.get("syscr", 0), io.get("syscw", 0), _machine_busy_s(tick))


def _machine_busy_s(tick: int) -> float:
    """CPU seconds the whole machine was busy since boot: all but idle and waiting for I/O."""
    with contextlib.suppress(OSError, ValueError):
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        )
        return (user + nice + system + irq + softirq + steal) / tick
    return 0.0


def _context_switches(status: str) -> int:
    return sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)


def _io_counters(pid: int) -> dict[str, int]:
    with contextlib.suppress(OSError, ValueError):
        pairs = (line.split(":") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return {key.strip(): int(value) for key, value in pairs}
    return {}


@dataclass(slots=True)
class Tally:
    """What a server did over several blocks of calls: the sum of (after - before) of each block."""

    cpu_by_role: dict[str, float] = field(default_factory=lambda: dict.fromkeys(THREAD_ROLES, 0.0))
    context_switches: int = 0
    read_syscalls: int = 0
    write_syscalls: int = 0
    machine_busy_s: float = 0.0

    def add(self, before: Sample, after: Sample) -> None:
        for role, seconds in after.cpu_by_role.items():
            self.cpu_by_role[role] += max(0.0, seconds - before.cpu_by_role.get(role, 0.0))
        self.context_switches += after.context_switches - before.context_switches
        self.read_syscalls += after.read_syscalls - before.read_syscalls
        self.write_syscalls += after.write_syscalls - before.write_syscalls
        self.machine_busy_s += after.machine_busy_s - before.machine_busy_s

    def figures(self, wall_s: float, calls: int) -> dict[str, Any]:
        """Cores busy by thread and in the whole machine over `wall_s`, and the counters per call."""
        per_call = max(1, calls)
        return {
            "machine_cpu_cores": round(self.machine_busy_s / (wall_s or 1.0), 2),
            "thread_cpu_cores": {role: round(s / (wall_s or 1.0), 2) for role, s in self.cpu_by_role.items()},
            "context_switches_per_call": round(self.context_switches / per_call, 2),
            "read_syscalls_per_call": round(self.read_syscalls / per_call, 2),
            "write_syscalls_per_call": round(self.write_syscalls / per_call, 2),
        }
