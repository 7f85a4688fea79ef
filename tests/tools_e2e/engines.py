"""The side effect of the durable-engine tests: a shipment row per call, in a SQLite system of record.

The same function runs inside the engine's worker (without commitgate) and inside the commitgate
server (through it). A kill file `kill-ORDER` holding a pid makes the call SIGKILL that process
right after the shipment is committed: the worker dies with the effect landed and its answer lost.
"""

import os
import signal
import sqlite3
import uuid
from pathlib import Path

ENV_DIR = "COMMITGATE_ENGINES_DIR"  # the directory of the record and the kill files


def record_path(root: Path | None = None) -> Path:
    return (root or Path(os.environ[ENV_DIR])) / "record.db"


def ship(order: str) -> dict:
    """Ship `order`: one new row in the system of record each time it is called."""
    shipment = uuid.uuid4().hex[:12]
    conn = sqlite3.connect(record_path(), timeout=30)
    try:
        with conn:
            conn.execute("CREATE TABLE IF NOT EXISTS shipments (order_id TEXT, shipment_id TEXT)")
            conn.execute("INSERT INTO shipments VALUES (?, ?)", (order, shipment))
    finally:
        conn.close()
    kill_file = Path(os.environ[ENV_DIR]) / f"kill-{order}"
    if kill_file.exists():
        pid = int(kill_file.read_text())
        kill_file.unlink()
        os.kill(pid, signal.SIGKILL)
    return {"order": order, "shipment_id": shipment}


def shipments(root: Path) -> dict[str, int]:
    """Rows per order in the system of record kept in `root`."""
    conn = sqlite3.connect(record_path(root), timeout=30)
    try:
        rows = conn.execute("SELECT order_id, COUNT(*) FROM shipments GROUP BY order_id").fetchall()
    except sqlite3.OperationalError:
        rows = []
    finally:
        conn.close()
    return dict(rows)
