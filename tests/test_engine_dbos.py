"""DBOS: a worker SIGKILLed after its step's tool acted and before DBOS recorded the step, then recovered.

Without commitgate the recovered step ships the order again; through it (keys from the workflow
id and the step id, commitgate.client.dbos) the second run replays the first outcome.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import assert_once_through_commitgate_twice_without

pytestmark = pytest.mark.slow


def test_a_recovered_step_ships_once_through_commitgate_and_twice_without(tmp_path: Path) -> None:
    assert_once_through_commitgate_twice_without("dbos", tmp_path)
