"""A side effect whose moment a test decides: it waits for a gate file, then records a task.

Annotations are evaluated (no `from __future__ import annotations`) so the
tool source sees the real `OperationContext` type, as in the demo tools.
"""

from pathlib import Path

import anyio

from commitgate.server.demo import tools as demo
from commitgate.server.model.context import OperationContext


async def gated_task(gate: str, label: str = "", ctx: OperationContext | None = None) -> dict:
    """Wait until the file `gate` exists, then record a task in the sandbox and return it."""
    while not Path(gate).exists():
        await anyio.sleep(0.02)
    return await demo.slow_task(0.0, label, ctx)
