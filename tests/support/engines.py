"""The durable-engine kill-point tests: one commitgate server over HTTP, a worker that forks the runs.

tests/procs/engine_worker.py does the runs (see its docstring); this side starts the server the
worker's "gate" runs call, runs the worker, and counts shipments in the system of record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools_e2e import engines

from support.http_servers import Served, running

TESTS_DIR = Path(__file__).resolve().parent.parent
WORKER = TESTS_DIR / "procs" / "engine_worker.py"
KILLS = 20  # kill points per engine and mode

POLICY = """
[server]
name = "commitgate-engines"
lease = "2s"
respond_within = "20s"
in_progress_wait = "10s"

[server.limits]
max_concurrent_per_principal = 256

[ledger]
synchronous = "FULL"

[tools.ship]
class = "key-required"
python = "tools_e2e.engines:ship"
timeout = "30s"
description = "Ship an order."
"""


def engines_env(root: Path) -> dict[str, str]:
    return {engines.ENV_DIR: str(root), "PYTHONPATH": str(TESTS_DIR), "PYTHONUNBUFFERED": "1"}


@contextmanager
def commitgate_server(root: Path) -> Iterator[Served]:
    """`commitgate serve` over streamable HTTP with the `ship` tool, its record in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    policy = root / "policy.toml"
    policy.write_text(POLICY, encoding="utf-8")
    with running(
        root, policy, "streamable-http", ledger=root / "ledger.db", sandbox=root / "sandbox.db",
        env=engines_env(root), log_level="warning",
    ) as served:  # fmt: skip
        yield served


def run_worker(engine: str, served: Served, root: Path, kills: int = KILLS) -> dict[str, Any]:
    """Runs the engine's kill points without and through commitgate; the worker's summary."""
    config = {
        "engine": engine,
        "modes": ["direct", "gate"],
        "kills": kills,
        "root": str(root),
        "url": served.endpoint,
    }
    done = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(config)],
        capture_output=True, text=True, timeout=240, env={**os.environ, **engines_env(root)},
    )  # fmt: skip
    assert done.returncode == 0, f"worker failed:\n{done.stderr[-5000:]}"
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    summary["stderr"] = done.stderr
    return summary


def shipments(root: Path) -> dict[str, int]:
    os.environ[engines.ENV_DIR] = str(root)
    return engines.shipments()
