"""`commitgate demo` is the README's first command: it must run, every step must hold, and it must
speak plainly: what each step did, what happened, why that is good, and what to try next."""

from __future__ import annotations

import re
import subprocess
import sys

JARGON = ("replayed=", "lost ack", "system of record", "as expected", "duplicates=")


def test_demo_quick_runs_and_every_step_holds() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "commitgate.server.cli", "demo", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "NO" not in out.split("What happened")[-1]
    assert out.count("why it matters:") == 9 and out.count("did:") == 9
    assert "large refund, approved from" in out and "commitgate ops approve op_" in out
    words = " ".join(out.split())  # the console wraps long lines
    assert "refused with budget_exceeded (spent $6,000 of $10,000 within 1d)" in words
    assert "nothing was charged: 1 charge on that card" in words and "commitgate ops budgets" in words
    assert "charges, 0 extra" in out  # through commitgate
    # and why the agent did not need to retry there: each lost answer was looked up for it
    assert re.search(
        r"0 retries: for each of the [1-9]\d* lost answers? commitgate asked the payments store", words
    )
    assert not [line for line in done.stderr.splitlines() if "warning" in line.lower()], done.stderr
    assert "the problem" in out  # the direct calls are the baseline, not a passed check
    assert "What to try next" in out and "commitgate claude-config" in out
    assert not [word for word in JARGON if word in out]
