"""`commitgate demo` is the README's first command: it must run and every step must hold."""

from __future__ import annotations

import subprocess
import sys


def test_demo_quick_runs_and_every_step_holds() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "commitgate.server.cli", "demo", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NO" not in done.stdout.split("What happened")[-1]
    assert "duplicates=0" in done.stdout
