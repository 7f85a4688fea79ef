"""Tools and count functions for the `commitgate verify` tests: effects counted in the systems of record."""

import os
import sqlite3
from contextlib import closing

from commitgate.server import OperationContext
from commitgate.server.demo import tools as demo

API_DB_ENV = "VERIFY_SANDBOX_API_DB"  # the sandbox payments API's store


def demo_charges(key: str) -> int:
    """Charges the demo tools made under `key` (in $COMMITGATE_SANDBOX)."""
    return demo.count("charges", idempotency_key=key)


def api_charges(key: str) -> int:
    """Charges the sandbox payments API made under `key` (its own SQLite store)."""
    with closing(sqlite3.connect(os.environ[API_DB_ENV])) as db:
        return int(db.execute("SELECT COUNT(*) FROM charges WHERE idempotency_key = ?", (key,)).fetchone()[0])


def not_a_number(key: str) -> str:
    return "three"


def find_nothing(
    card: str, amount_cents: int, description: str = "", ctx: OperationContext | None = None
) -> dict | None:
    """A broken status check: it never finds anything, not even what the tool just did."""
    return None


def find_anything(
    card: str, amount_cents: int, description: str = "", ctx: OperationContext | None = None
) -> dict | None:
    """A broken status check: it always says found, even for a key never used."""
    return {"charge_id": "ch_imagined", "card": card, "amount_cents": amount_cents, "status": "succeeded"}


def stub_records(key: str) -> int:
    """Notes the upstream stub MCP server recorded for the step `key` (its JSONL log, $STUB_LOG)."""
    import json

    with open(os.environ["STUB_LOG"], encoding="utf-8") as log:
        return sum(1 for line in log if json.loads(line).get("step") == key)
