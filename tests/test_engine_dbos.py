"""DBOS: a worker SIGKILLed after its step's tool acted and before DBOS recorded the step, then recovered.

Without commitgate the recovered step ships the order again; through it (keys from the workflow
id and the step id, commitgate.client.dbos) the second run replays the first outcome.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import KILLS, run_kill_points, shipments

pytestmark = pytest.mark.slow


def test_a_recovered_step_ships_once_through_commitgate_and_twice_without(tmp_path: Path) -> None:
    summary = run_kill_points("dbos", tmp_path)
    modes = summary["modes"]
    assert all(summary["crash"][order] == "signal 9" for order in modes), summary["crash"]
    assert all(summary["resume"][order] == "exit 0" for order in modes), summary["stderr"][-5000:]
    counts = shipments(tmp_path)
    for mode, effects in (("direct", 2), ("gate", 1)):
        orders = [order for order, m in modes.items() if m == mode]
        assert len({summary["points"][o] for o in orders}) == KILLS  # distinct kill points
        assert {o: counts.get(o) for o in orders} == dict.fromkeys(orders, effects)
        assert counts[f"dbos-{mode}-calibrate"] == 1
