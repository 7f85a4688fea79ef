"""LangGraph: a worker SIGKILLed after its tool node acted and before the checkpoint recorded it, then resumed.

Without commitgate the resumed tool node ships the order again; through it (keys from the thread
id and the checkpointed tool call id, commitgate.client.langgraph) the second run replays the first outcome.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import assert_once_through_commitgate_twice_without

pytestmark = pytest.mark.slow


def test_a_resumed_tool_node_ships_once_through_commitgate_and_twice_without(tmp_path: Path) -> None:
    assert_once_through_commitgate_twice_without("langgraph", tmp_path)
