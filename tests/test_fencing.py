"""A lapsed lease never lets a status check's "not found" run an action twice.

The owner of a `key-and-status-check` operation is frozen (SIGSTOP) in the middle of its attempt,
past its lease, with its effect about to land; a second server process on the same ledger (a SQLite
file, or PostgreSQL as a replica would share it) polls and calls with the same key. The status check
finds nothing yet, which proves nothing while the first attempt can still land: the operation stays
`UNKNOWN` (a call answers `operation_in_progress`), never "not found" and run again. Once the owner
runs again its charge lands and it records the outcome. The charges in the sandbox (the system of
record) are counted: exactly one.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.e2e import Deployment, error_code, operation, serve, together

HELD = """
[tools.held_charge]
class = "key-and-status-check"
python = "tools_e2e.held:held_charge"
status_check = "tools_e2e.held:find_held_charge"
timeout = "60s"
retry = { attempts = 3, initial = "10ms", max = "50ms" }
"""


def deployment(root: Path) -> Deployment:
    d = Deployment.create(root, lease="1s", respond_within="1s", in_progress_wait="300ms")
    d.policy.write_text(d.policy.read_text(encoding="utf-8") + HELD, encoding="utf-8")
    return d


async def ledger_url(backend: str, d: Deployment) -> str:
    if backend == "sqlite":
        return f"sqlite:///{d.ledger}"
    from support.postgres import fresh_url

    return await fresh_url()


async def until(probe: Any, within: float = 30.0) -> Any:
    with anyio.fail_after(within):
        while not (value := await probe()):
            await anyio.sleep(0.05)
        return value


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_frozen_owner_past_its_lease_never_lets_the_action_run_twice(
    tmp_path: Path, backend: str
) -> None:
    d = deployment(tmp_path)
    url = await ledger_url(backend, d)
    gate = tmp_path / "gate"
    args = {"card": "4242", "amount_cents": 500, "gate": str(gate), "idempotency_key": "k1"}
    async with together(serve(d, ledger=url), serve(d, ledger=url)) as (owner, other):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(owner.call, "held_charge", args)
            await until(lambda: anyio.Path(f"{gate}.started").exists())
            os.kill(owner.pid, signal.SIGSTOP)
            try:
                gate.touch()  # the owner's charge lands as soon as it runs again
                verdicts: list[str | None] = []

                async def lapsed() -> dict[str, Any] | None:
                    answer = await other.status(None, idempotency_key="k1")
                    op = answer["operation"]
                    verdicts.append((op.get("reconciliation") or {}).get("verdict"))
                    return op if op["state"] != "RUNNING" else None

                polled = await lapsed() or await until(lapsed)  # the lease runs out; the poll checks
                assert polled["state"] == "UNKNOWN", (
                    polled
                )  # not FAILED_RETRYABLE: nothing proves it did not happen
                assert polled["reconciliation"]["verdict"] == "cannot_tell"
                again = await other.call("held_charge", args)  # the same key, from the other process
                assert error_code(again) == "operation_in_progress", again.content
                assert (await lapsed() or {}).get("state") == "UNKNOWN"
                assert "not_found" not in verdicts
                assert d.count("charges") == 0
            finally:
                os.kill(owner.pid, signal.SIGCONT)
        done = await until(lambda: _succeeded(other), within=60)  # the owner records its late outcome
        assert done["attempts"] == 1
        replay = await other.call("held_charge", args)
        assert not replay.is_error and operation(replay)["replayed"] is True
        assert replay.structured_content is not None
        assert replay.structured_content["charge_id"] == done["result"]["structuredContent"]["charge_id"]
    assert d.count("charges") == 1


async def _succeeded(server: Any) -> dict[str, Any] | None:
    op = (await server.status(None, idempotency_key="k1"))["operation"]
    return op if op["state"] == "SUCCEEDED" else None
