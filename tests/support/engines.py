"""The durable-engine kill-point tests: one commitgate server over HTTP, a worker that forks the runs.

tests/procs/engine_worker.py does the runs (see its docstring); this side starts the server that
the worker's "gate" runs call, runs the worker, and counts shipments in the system of record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tools_e2e import engines

from support.http_servers import free_port, running

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


def run_kill_points(engine: str, root: Path, kills: int = KILLS) -> dict[str, Any]:
    """Runs the engine's kill points without and through commitgate; the worker's summary.

    The worker imports its engine while the server starts, and begins once the server is ready."""
    root.mkdir(parents=True, exist_ok=True)
    policy = root / "policy.toml"
    policy.write_text(POLICY, encoding="utf-8")
    port = free_port()
    config = {
        "engine": engine, "modes": ["direct", "gate"], "kills": kills, "root": str(root),
        "url": f"http://127.0.0.1:{port}/mcp",
    }  # fmt: skip
    with (root / "worker.stderr").open("w+", encoding="utf-8") as stderr:
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=stderr, text=True, env={**os.environ, **engines_env(root)},
        )  # fmt: skip
        try:
            with running(
                root, policy, "streamable-http", ledger=root / "ledger.db", sandbox=root / "sandbox.db",
                env=engines_env(root), log_level="warning", port=port,
            ):  # fmt: skip
                out, _ = worker.communicate("go\n", timeout=240)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        stderr.seek(0)
        errors = stderr.read()
    assert worker.returncode == 0, f"worker failed:\n{errors[-5000:]}"
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    summary["stderr"] = errors
    return summary


def shipments(root: Path) -> dict[str, int]:
    return engines.shipments(root)


def assert_once_through_commitgate_twice_without(engine: str, root: Path) -> None:
    """Run every kill point of `engine` both ways; each crash was a SIGKILL, each resume finished, and
    the record holds 2 shipments per order shipped directly and 1 per order shipped through commitgate."""
    summary = run_kill_points(engine, root)
    modes = summary["modes"]
    assert all(summary["crash"][order] == "signal 9" for order in modes), summary["crash"]
    assert all(summary["resume"][order] == "exit 0" for order in modes), summary["stderr"][-5000:]
    counts = shipments(root)
    for mode, effects in (("direct", 2), ("gate", 1)):
        orders = [order for order, m in modes.items() if m == mode]
        assert len({summary["points"][o] for o in orders}) == KILLS  # distinct kill points
        assert {o: counts.get(o) for o in orders} == dict.fromkeys(orders, effects)
        assert counts[f"{engine}-{mode}-calibrate"] == 1
