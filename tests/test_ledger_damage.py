"""The ledger file damaged under a running server, and a full disk, seen before anything runs.

A SQLite ledger truncated or overwritten in place (same path, same inode) while a server runs would
take claims that nobody reads again (the next start refuses the file): the next keyed call answers
`ledger_unavailable` and its tool runs 0 times, and `/healthz` says so. `/healthz` probes a real
write and the room left on the ledger's disk: a full disk (a small tmpfs, mounted as root) is
reported, and its recovery too. Effects are counted in the sandbox (the system of record).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from support.e2e import Deployment
from support.http_servers import connect, error_code, running, write_policy


def tickets(root: Path, sandbox: Path) -> int:
    return Deployment(root, root / "policy.toml", root / "ledger.db", sandbox).count("tickets")


def health(base: str) -> int:
    return httpx2.get(base + "/healthz", timeout=10).status_code


def damage(ledger: Path, how: str) -> None:
    """In place: the path and inode stay, the bytes change."""
    size = ledger.stat().st_size
    if how == "truncated":
        os.truncate(ledger, 0)
    else:
        with ledger.open("r+b") as file:
            file.write(os.urandom(size))


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["truncated", "overwritten"])
async def test_a_ledger_damaged_in_place_refuses_the_next_keyed_call(tmp_path: Path, how: str) -> None:
    ledger, sandbox = tmp_path / "ledger.db", tmp_path / "sandbox.db"
    with running(
        tmp_path, write_policy(tmp_path), "streamable-http", ledger=ledger, sandbox=sandbox
    ) as served:
        async with connect(served) as client:
            first = await client.call_tool("create_ticket", {"title": "one", "idempotency_key": "k1"})
            assert not first.is_error, first.content
            assert health(served.base) == 200
            damage(ledger, how)
            for key in ("k2", "k3"):
                refused = await client.call_tool("create_ticket", {"title": key, "idempotency_key": key})
                assert error_code(refused) == "ledger_unavailable", refused.content
            assert health(served.base) == 503
        assert "in place while serving; keyed calls are refused" in served.stderr()
    assert tickets(tmp_path, sandbox) == 1


@contextlib.contextmanager
def small_disk(where: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at `where` (root only)."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("a full disk is made with a tmpfs mount, which needs root (CI runs as root)")
        pytest.skip("a full disk is made with a tmpfs mount, which needs root")
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Write until the disk is full (the close that flushes the last bytes fails too: suppressed)."""
    filler = disk / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as file:
        while True:
            file.write(b"\0" * 65536)
            file.flush()
    return filler


@pytest.mark.anyio
async def test_healthz_reports_a_full_disk_and_its_recovery(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        ledger = disk / "ledger.db"
        policy = write_policy(tmp_path)
        with running(
            tmp_path, policy, "streamable-http", ledger=ledger, sandbox=tmp_path / "sandbox.db"
        ) as served:
            assert health(served.base) == 200
            filler = fill(disk)
            assert health(served.base) == 503
            filler.unlink()
            assert health(served.base) == 200
