"""DBOS in the engine worker: a sync workflow whose one step ships the order (see engine_worker.py)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import dbos._sys_db_sqlite  # noqa: F401  # what DBOS imports at launch: once here, before the forks
import engine_common as common
import sqlalchemy.dialects.sqlite  # noqa: F401
from anyio.from_thread import start_blocking_portal
from dbos import DBOS, SetWorkflowID
from tools_e2e import engines

from commitgate.client.dbos import DBOSGate

GATE: DBOSGate | None = None


@DBOS.step()
def ship_step(order: str) -> dict[str, Any]:
    if GATE is not None:
        shipped = GATE.call("ship", {"order": order}).structured or {}
    else:
        shipped = engines.ship(order)
    common.CURRENT.kill.arm()
    return shipped


@DBOS.workflow()
def deliver(order: str) -> dict[str, Any]:
    return ship_step(order)


@contextlib.contextmanager
def gate() -> Iterator[None]:
    global GATE
    if not common.CURRENT.gate:
        yield
        return
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(common.commitgate_client()) as client,
    ):
        GATE = DBOSGate(portal, client)
        yield


def database(root: Path, order: str) -> Path:
    return root / f"dbos-{order}.sqlite"


def seed(root: Path, template: str, orders: Iterable[str]) -> None:
    """Starts each run's system database as a copy of one DBOS has already set up (as any restarted
    application finds it): its schema, and the finished calibration run, which recovery skips."""
    with contextlib.closing(sqlite3.connect(database(root, template))) as source:
        for order in orders:
            with contextlib.closing(sqlite3.connect(database(root, order))) as target:
                source.backup(target)


def run(phase: str) -> None:
    order = common.CURRENT.order
    dbos = DBOS(
        config={
            "name": "engines",
            "system_database_url": f"sqlite:///{database(common.CURRENT.root, order)}",
            "log_level": "WARNING",
        }
    )
    with gate():
        DBOS.launch()  # on resume: recovers the workflow the crash left PENDING
        sys_db = dbos._sys_db  # its write of a step's result, hooked for the kill point
        record = sys_db.record_operation_result

        def recorded(*args: Any, **kwargs: Any) -> Any:
            common.CURRENT.kill.at_record()
            return record(*args, **kwargs)

        sys_db.record_operation_result = recorded  # type: ignore[method-assign]
        if phase == "resume":
            DBOS.retrieve_workflow(order).get_result(polling_interval_sec=0.5)
        else:
            with SetWorkflowID(order):
                DBOS.start_workflow(deliver, order).get_result()
