"""Several OS processes on one ledger file: exactly-once claims, and crash recovery after SIGKILL.

Each process is tests/procs/worker.py run with this interpreter; effects are
counted in a SQLite system of record file that every process shares.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.boundary import KEYED_CLASSES, SystemOfRecord

from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._schema import MIGRATIONS
from commitgate.server.model.records import Operation

WORKER = Path(__file__).resolve().parent / "procs" / "worker.py"


class Site:
    """Files shared by the processes of one test: the ledger, the system of record, markers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ledger = root / "ledger.db"
        self.record = SystemOfRecord(root / "record.db")

    def marker(self, name: str) -> str:
        return str(self.root / f"{name}.flag")

    def spawn(self, **config: Any) -> subprocess.Popen[str]:
        config = {"ledger": str(self.ledger), "record": str(self.record.path), "key": "k1", **config}
        return subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def operation(self) -> Operation | None:
        async def read() -> Operation | None:
            ledger = await SQLiteLedger.open(self.ledger)
            try:
                return await ledger.get("alice", "s1", "k1")
            finally:
                await ledger.close()

        return asyncio.run(read())


def wait_for(path: str, procs: list[subprocess.Popen[str]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        for proc in procs:
            if proc.poll() is not None:
                _, err = proc.communicate()
                pytest.fail(f"worker exited with {proc.returncode} before {Path(path).name}: {err}")
        if time.monotonic() > deadline:
            pytest.fail(f"{Path(path).name} did not appear within {timeout}s")
        time.sleep(0.005)


def answers(proc: subprocess.Popen[str], timeout: float = 60.0) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def start_together(site: Site, count: int, **config: Any) -> list[subprocess.Popen[str]]:
    """Start `count` workers and release them at once, when all are ready."""
    procs = [site.spawn(ready=site.marker(f"ready{i}"), go=site.marker("go"), **config) for i in range(count)]
    for i in range(count):
        wait_for(site.marker(f"ready{i}"), procs)
    Path(site.marker("go")).touch()
    return procs


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("cls", KEYED_CLASSES)
def test_concurrent_duplicates_across_processes_execute_once(tmp_path: Path, cls: str) -> None:
    site = Site(tmp_path)
    procs = start_together(site, 3, cls=cls, copies=4, default="slow", server={"in_progress_wait": "60s"})
    results = [answer for proc in procs for answer in answers(proc)]
    assert len(results) == 12
    assert all(r["code"] is None and r["state"] == "SUCCEEDED" for r in results), results
    assert len({r["effect"] for r in results}) == 1
    assert [r["replayed"] for r in results].count(False) == 1
    assert site.record.count() == 1
    op = site.operation()
    assert op is not None and (op.attempts, op.fence) == (1, 1)


# (class, where the process dies) -> what a restarted process answers, and the effects in the end
AFTER_RESTART = {
    ("key-required", "after"): ("operation_outcome_unknown", "UNKNOWN", 1),
    ("key-required", "before"): ("operation_outcome_unknown", "UNKNOWN", 0),
    ("compensable", "after"): ("operation_outcome_unknown", "UNKNOWN", 1),
    ("compensable", "before"): ("operation_outcome_unknown", "UNKNOWN", 0),
    ("key-and-status-check", "after"): (None, "SUCCEEDED", 1),  # reconciled: found
    ("key-and-status-check", "before"): (None, "SUCCEEDED", 1),  # not found: executed once, now
}


@pytest.mark.parametrize("cls", KEYED_CLASSES)
@pytest.mark.parametrize("dies", ["after", "before"])
def test_a_process_killed_before_recording_is_not_rerun_after_restart(
    tmp_path: Path, cls: str, dies: str
) -> None:
    site = Site(tmp_path)
    marker = site.marker("effect" if dies == "after" else "entered")
    crashing = site.spawn(
        cls=cls, script=[f"hold_{dies}"], effect=site.marker("effect"), entered=site.marker("entered")
    )
    wait_for(marker, [crashing])
    kill(crashing)  # between the effect (or the attempt) and the ledger write
    op = site.operation()
    assert op is not None and op.state.value == "RUNNING"
    assert op.lease_owner is not None and f":{crashing.pid}:" in op.lease_owner
    code, state, effects = AFTER_RESTART[(cls, dies)]
    assert site.record.count() == (1 if dies == "after" else 0)

    first, again = (answers(site.spawn(cls=cls, running=True)) for _ in range(2))
    assert [(a["code"], a["state"]) for a in first + again] == [(code, state)] * 2
    if state == "SUCCEEDED":
        assert first[0]["replayed"] is (dies == "after")  # found by reconciliation, not executed here
        assert again[0]["replayed"] is True and first[0]["effect"] == again[0]["effect"]
        assert site.record.effect_ids() == [first[0]["effect"]]
    assert site.record.count() == effects
    recovered = site.operation()
    assert recovered is not None and recovered.state.value == state


def test_with_claim_durability_a_process_killed_after_the_effect_leaves_unknown_not_a_second_run(
    tmp_path: Path,
) -> None:
    """`durability = "claim"` still syncs the claim before the effect: the restart finds the claim."""
    site = Site(tmp_path)
    crashing = site.spawn(
        cls="key-required", script=["hold_after"], effect=site.marker("effect"), durability="claim"
    )
    wait_for(site.marker("effect"), [crashing])
    kill(crashing)
    restarted = answers(site.spawn(cls="key-required", running=True, durability="claim"))
    assert [(a["code"], a["state"]) for a in restarted] == [("operation_outcome_unknown", "UNKNOWN")]
    assert site.record.count() == 1


def test_a_restart_without_a_sweep_finds_the_dead_owner_on_claim(tmp_path: Path) -> None:
    site = Site(tmp_path)
    crashing = site.spawn(cls="key-required", script=["hold_after"], effect=site.marker("effect"))
    wait_for(site.marker("effect"), [crashing])
    kill(crashing)
    (answer,) = answers(site.spawn(cls="key-required", running=False, server={"lease": "1h"}))
    assert (answer["code"], answer["state"]) == ("operation_outcome_unknown", "UNKNOWN")
    assert site.record.count() == 1


def test_processes_opening_a_new_ledger_at_once_migrate_it_once(tmp_path: Path) -> None:
    site = Site(tmp_path)
    procs = start_together(site, 5, mode="open")
    assert [answers(proc) for proc in procs] == [[{"claimed": "new"}]] * 5
    with sqlite3.connect(site.ledger) as conn:
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_version ORDER BY version")]
        assert versions == list(range(1, len(MIGRATIONS) + 1))
        assert conn.execute("SELECT count(*) FROM operations").fetchone()[0] == 5
    assert stat.S_IMODE(os.stat(site.ledger).st_mode) == 0o600
