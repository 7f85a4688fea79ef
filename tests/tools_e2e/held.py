"""A charge whose attempt a test holds in flight: it marks that it started, waits for a gate file,
then charges in the sandbox. Its status check finds the charge made under the operation's key.

Annotations are evaluated (no `from __future__ import annotations`) so the
tool source sees the real `OperationContext` type, as in the demo tools.
"""

from pathlib import Path

import anyio

from commitgate.server.demo import tools as demo
from commitgate.server.model.context import OperationContext


async def held_charge(card: str, amount_cents: int, gate: str, ctx: OperationContext | None = None) -> dict:
    """Charge `amount_cents` once the file `gate` exists (`gate`.started says the attempt began)."""
    Path(gate + ".started").touch()
    while not Path(gate).exists():
        await anyio.sleep(0.02)
    return demo.charge_card(card, amount_cents, ctx=ctx)


def find_held_charge(
    card: str, amount_cents: int, gate: str, ctx: OperationContext | None = None
) -> dict | None:
    """The charge made under this operation's key, or None."""
    return demo.find_charge(card, amount_cents, ctx=ctx)
