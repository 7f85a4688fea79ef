"""The sandbox harness that the demo and the benchmark share: a throwaway directory with a
system of record, ledgers, and real `commitgate serve` processes over stdio."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

NAIVE_POLICY = """
# What an agent gets without commitgate: every call runs, retries included.
[ledger]
synchronous = "FULL"
[tools.charge_card]
class = "safe-retry"
python = "commitgate.server.demo.tools:charge_card"
retry = { attempts = 1 }
"""


@dataclass
class Sandbox:
    root: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            "COMMITGATE_SANDBOX": str(self.root / "sandbox.db"),
            "PYTHONUNBUFFERED": "1",
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", str(self.root)),
        }

    def count(self, table: str, **where: Any) -> int:
        os.environ["COMMITGATE_SANDBOX"] = str(self.root / "sandbox.db")
        from commitgate.server.demo import tools as demo

        return demo.count(table, **where)

    def server(
        self, *, faults: str = "", policy: Path | None = None, ledger: str = "ledger.db"
    ) -> StdioServerParameters:
        args = ["-m", "commitgate.server.cli", "serve", "--ledger", f"sqlite:///{self.root / ledger}"]
        if policy is not None:
            args += ["--policy", str(policy)]
        env = {**self.env, "COMMITGATE_SANDBOX_FAULTS": faults, "COMMITGATE_DEMO_MARKER": str(self.root)}
        return StdioServerParameters(command=sys.executable, args=args, env=env)

    def ops(self, arguments: list[str]) -> int:
        """`commitgate ops ...` on this sandbox's ledger, as an operator runs it: another process."""
        command = [sys.executable, "-m", "commitgate.server.cli", "ops", *arguments]
        command += ["--ledger", f"sqlite:///{self.root / 'ledger.db'}"]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        return done.returncode


@contextlib.asynccontextmanager
async def connect(params: StdioServerParameters) -> AsyncIterator[Client]:
    async with Client(params, read_timeout_seconds=30) as client:
        yield client


def server_pids(marker: str) -> list[int]:
    """Pids of commitgate server processes whose command line holds `marker` (their unique ledger path)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and "commitgate" in cmdline and int(entry.parent.name) != os.getpid():
            found.append(int(entry.parent.name))
    return found


def kill_servers(marker: str) -> int:
    """kill -9 every server process of this demo (found by its unique directory in the command line)."""
    pids = server_pids(marker)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return len(pids)
