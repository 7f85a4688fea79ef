"""LangGraph: a worker SIGKILLed after its tool node acted and before the checkpoint recorded it, then resumed.

Without commitgate the resumed tool node ships the order again; through it (keys from the thread
id and the checkpointed tool call id, commitgate.client.langgraph) the second run replays the first outcome.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import KILLS, run_kill_points, shipments

pytestmark = pytest.mark.slow


def test_a_resumed_tool_node_ships_once_through_commitgate_and_twice_without(tmp_path: Path) -> None:
    summary = run_kill_points("langgraph", tmp_path)
    modes = summary["modes"]
    assert all(summary["crash"][order] == "signal 9" for order in modes), summary["crash"]
    assert all(summary["resume"][order] == "exit 0" for order in modes), summary["stderr"][-5000:]
    counts = shipments(tmp_path)
    for mode, effects in (("direct", 2), ("gate", 1)):
        orders = [order for order, m in modes.items() if m == mode]
        assert len({summary["points"][o] for o in orders}) == KILLS  # distinct kill points
        assert {o: counts.get(o) for o in orders} == dict.fromkeys(orders, effects)
        assert counts[f"langgraph-{mode}-calibrate"] == 1
