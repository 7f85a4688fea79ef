"""For the agent-framework tests: a directory with a system of record, and the servers an agent talks to.

Each framework's scripted model charges order 42, "loses" the answer, and charges again under a
new key and a new tool-call id, as models and framework retry loops do. Charges are counted in
the demo tools' sandbox database, which does not deduplicate (that is commitgate's job).
"""

from __future__ import annotations

import os
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CHARGE = {"card": "4242", "amount_cents": 1299, "description": "order 42"}
POLICY = """
[server]
name = "agent-test"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
"""


@dataclass
class AgentSandbox:
    """A directory holding the system of record, a policy and a ledger; servers run from this venv."""

    root: Path

    @classmethod
    def create(cls, root: Path) -> AgentSandbox:
        root.mkdir(parents=True)
        (root / "policy.toml").write_text(POLICY, encoding="utf-8")
        return cls(root)

    @property
    def env(self) -> dict[str, str]:
        return {
            "COMMITGATE_SANDBOX": str(self.root / "sandbox.db"),
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", str(self.root)),
        }

    @property
    def commitgate(self) -> list[str]:
        """The command line of a commitgate server over stdio for this sandbox."""
        ledger = f"sqlite:///{self.root / 'ledger.db'}"
        policy = str(self.root / "policy.toml")
        return [
            sys.executable,
            "-m",
            "commitgate.server.cli",
            "serve",
            "--policy",
            policy,
            "--ledger",
            ledger,
        ]

    @property
    def plain(self) -> list[str]:
        """The same charge_card as a plain MCP server, without commitgate."""
        return [sys.executable, str(EXAMPLES / "plain_charge_server.py")]

    def charges(self) -> int:
        path = self.root / "sandbox.db"
        if not path.exists():
            return 0
        with sqlite3.connect(path) as conn:
            return int(conn.execute("SELECT count(*) FROM charges").fetchone()[0])
