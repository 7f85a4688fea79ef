"""commitgate's threads carry OS-level names, so `top -H` and the bench's per-thread CPU tell them apart."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.threads import name_os_thread, os_thread_name


def test_os_names_fit_the_kernels_fifteen_bytes() -> None:
    assert os_thread_name("commitgate-ledger-writer") == "cg-ledger-write"
    assert os_thread_name("commitgate-ledger-checkpoint") == "cg-ledger-check"
    assert os_thread_name("commitgate-ledger-sync") == "cg-ledger-sync"
    assert os_thread_name("someone-elses-thread-name") == "someone-elses-t"


def _os_names() -> set[str]:
    return {path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names from /proc")
def test_a_named_thread_shows_its_name_to_the_kernel() -> None:
    seen: list[str] = []

    def run() -> None:
        name_os_thread()
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run, name="commitgate-test")
    thread.start()
    thread.join()
    assert seen == ["cg-test"]


@pytest.mark.anyio
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names from /proc")
async def test_the_sqlite_ledgers_threads_are_named(tmp_path: Path) -> None:
    ledger = await open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        assert {"cg-ledger-write", "cg-ledger-check"} <= _os_names()
    finally:
        await ledger.close()
