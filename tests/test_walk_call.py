"""The developer's walk of one guarded call (tests/support/walk_call.py) runs from a checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "support" / "walk_call.py"


def test_the_walk_of_one_call_counts_its_rooms() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    walk = json.loads(done.stdout)
    assert walk["rooms"] > 0 and walk["folders"] > 0 and walk["transitions"] > 0
    assert 0 <= walk["returns"] <= walk["transitions"]
    assert len(set(walk["walk"])) == walk["rooms"]
    # The call passes every layer of the flow: surface, gateway, boundary, tool source, ledger.
    for room in ("server/serve/surface", "server/serve/gateway", "server/core/boundary", "tools/python"):
        assert room in walk["walk"], room
    assert any(room.startswith("server/ledger/") for room in walk["walk"])
